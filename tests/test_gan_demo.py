"""The built-in StyleNAT run shows its progress: the G-EMA half-life ramps up with the images seen (a run shorter
than the 10 kimg half-life still ends with a G-EMA that moved off its initial weights), a grid is written at the end
of training, the progress bar's total is the run's length (not the data epoch's), and ``eval.py task=generate``
names its folder after the checkpoint's training run."""
from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from PIL import Image

from namodels.tasks.console import ProgressBar
from namodels.tasks.gan import GANTask, ema_decay, ema_half_life
from namodels.tasks.run_names import checkpoint_run_name
from tests.test_stylenat import TINY_D, TINY_G, _naive_backend  # noqa: F401  (autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def one_thread():
    """Small matrices: one thread is fastest, and several are many times slower on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Data(L.LightningDataModule):
    """40 images in batches of 4: an epoch of 10 batches, longer than the runs here."""

    def train_dataloader(self):
        data = torch.rand(40, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4, drop_last=True)


def _distance(a: dict, b: dict) -> float:
    return sum((a[k].float() - b[k].float()).norm().item() for k in a if a[k].is_floating_point())


def test_ema_half_life_ramps_up_with_the_images_seen():
    assert ema_half_life(10.0, 2.0, 0.05) == pytest.approx(0.1)    # 2 kimg in: a 100-image half-life
    assert ema_half_life(10.0, 1000.0, 0.05) == 10.0                # long runs: the configured 10 kimg
    assert ema_half_life(10.0, 2.0, None) == ema_half_life(10.0, 2.0, 0) == 10.0  # ramp-up off
    assert ema_half_life(10.0, 0.0, 0.05) == 0.0                    # first step: the EMA copies G
    with pytest.raises(ValueError, match="ema_rampup"):
        GANTask(TINY_G, TINY_D, ema_rampup=-1)
    # 250 steps of batch 8 (the built-in run's 2 kimg) at the fixed 10 kimg half-life keep 87% of the initial weights
    assert ema_decay(8, 10.0) ** 250 > 0.85


def test_short_run_ends_with_a_trained_g_ema_a_final_grid_and_a_full_progress_bar(tmp_path, one_thread):
    """4 batches of 4 (0.016 kimg) with grids every 3 batches and a data epoch of 10 batches: the G-EMA ends nearer
    the trained generator than its initial weights (the task's default ramp-up), a grid is written at the end, and
    the bar's total is the run's 4 batches (Lightning's would be the epoch's 10, the bar stopping at 4/10)."""
    torch.manual_seed(0)
    task = GANTask(TINY_G, TINY_D, r1_interval=None, max_kimg=0.016, sample_every_n_steps=3, sample_grid=4)
    initial = {k: v.clone() for k, v in task.g_ema.state_dict().items()}
    seen = {}

    class Probe(L.Callback):
        def on_train_end(self, trainer, pl_module):
            rich_task = bar.progress.tasks[bar.train_progress_bar_id]
            seen.update(total=rich_task.total, completed=rich_task.completed)

    bar = ProgressBar(metrics_every_n_batches=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=-1, logger=False, callbacks=[bar, Probe()],
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(task, _Data())
    assert int(task.d_steps) == 4 and task.images_seen.item() == 16
    assert seen == {"total": 4, "completed": 4}
    trained = task.generator.state_dict()
    ema = task.g_ema.state_dict()
    assert _distance(ema, trained) < 0.5 * _distance(ema, initial)
    grids = sorted(os.listdir(tmp_path / "samples"))
    assert grids == ["kimg00000.012.png", "kimg00000.016.png"]  # after batch 3, and at the end (batch 4)
    assert Image.open(tmp_path / "samples" / grids[-1]).size == (2 + 2 * 130, 2 + 2 * 130)


def test_generate_folder_names_the_checkpoints_training_run():
    """eval.py task=generate writes under logs/generate/<training run>/ (model and data), not the eval config's
    default data set (digits)."""
    run = os.path.join("logs", "gan", "stylenat_tiny-skimage", "version_3")
    assert checkpoint_run_name(os.path.join(run, "checkpoints", "last.ckpt")) == "stylenat_tiny-skimage"
    assert checkpoint_run_name(os.path.join(run, "export", "g_ema.safetensors")) == "stylenat_tiny-skimage"
    assert checkpoint_run_name("/runs/gan/mine/torchrun-7/checkpoints/kimg00002.000.ckpt") == "mine"
    assert checkpoint_run_name("/runs/mine/checkpoints/last.ckpt") == "mine"  # paths.output_dir=/runs/mine
    assert checkpoint_run_name("/weights/FFHQ256_940k_flip.pt") == "FFHQ256_940k_flip"  # released files: their name
    assert checkpoint_run_name(None, "generate") == "generate"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose("eval", overrides=["task=generate", f"ckpt_path={os.path.join(run, 'checkpoints', 'last.ckpt')}"])
        released = compose("eval", overrides=["task=generate", "ckpt_path=/weights/FFHQ256_940k_flip.pt"])
    assert OmegaConf.select(cfg, "paths.run_dir").endswith(os.path.join("logs", "generate", "stylenat_tiny-skimage"))
    assert OmegaConf.select(released, "paths.run_dir").endswith(os.path.join("generate", "FFHQ256_940k_flip"))


def _tile_spread(path, tile=128, pad=2, rows=4):
    """(std of the tiles' mean colours across tiles, mean std within a tile) of a 4x4 sample grid, in [0, 1] units."""
    import numpy as np

    grid = np.asarray(Image.open(path).convert("RGB"), dtype=np.float64) / 255
    tiles = [grid[pad + r * (tile + pad):][:tile, pad + c * (tile + pad):][:, :tile]
             for r in range(rows) for c in range(rows)]
    means = np.array([t.mean(axis=(0, 1)) for t in tiles])
    return float(means.std(axis=0).mean()), float(np.mean([t.std(axis=(0, 1)).mean() for t in tiles]))


@pytest.mark.slow
def test_builtin_run_ends_with_varied_samples(tmp_path):
    """The acceptance run: python train.py experiment=stylenat_skimage (CPU, about 4 minutes).  A G-EMA left at its
    initial weights draws 16 uniform grey tiles (both spreads about 0.01); the run's final tiles differ from each
    other and have structure (both spreads about 0.15 as measured), and eval.py task=generate on its checkpoint
    writes under the run's name."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "train.py", "experiment=stylenat_skimage", f"paths.root_dir={tmp_path}",
                    "callbacks.progress_bar=null", "logger=csv"], cwd=ROOT, check=True, timeout=30 * 60)
    run = tmp_path / "logs" / "gan" / "stylenat_tiny-skimage" / "version_0"
    final = run / "samples" / "kimg00002.000.png"
    assert final.is_file(), sorted(os.listdir(run / "samples"))
    across, within = _tile_spread(final)
    assert across > 0.08 and within > 0.08, (across, within)
    subprocess.run([sys.executable, "eval.py", "task=generate", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
                    f"paths.root_dir={tmp_path}", "task.progress=false"], cwd=ROOT, check=True, timeout=10 * 60)
    assert (tmp_path / "logs" / "generate" / "stylenat_tiny-skimage" / "version_0" / "images" / "grid.png").is_file()
