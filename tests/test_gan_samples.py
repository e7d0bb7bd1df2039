"""GAN pictures: sample grids that keep every generated pixel (small models enlarged by a whole factor),
G-EMA samples in TensorBoard, progress bars over generation and FID, and the shared generator module
that GAN training and sampling both import (neither imports the other)."""
from __future__ import annotations

import ast
import os

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from PIL import Image
from torch import nn
from torchvision.utils import save_image

from namodels.data.images import to_unit_range
from namodels.tasks.fid import compute_fid
from namodels.tasks.gan import GANTask
from namodels.tasks.generate import generate_images
from namodels.tasks.generators import DISPLAY_TILE, grid_image, save_grid, tile_scale

from tests.test_stylenat import TINY_D, TINY_G, _naive_backend, tiny_generator  # noqa: F401  (autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _images(n=4, size=32, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2.4 - 1.2


def test_tile_scale():
    assert DISPLAY_TILE == 128
    assert [tile_scale(s, 128) for s in (32, 48, 64, 128, 256, 1024)] == [4, 3, 2, 1, 1, 1]
    assert tile_scale(32, None) == tile_scale(32, 0) == 1
    with pytest.raises(ValueError, match="min_tile"):
        tile_scale(32, -1)


def test_grid_keeps_every_generated_pixel():
    images = _images(5)
    grid = grid_image(images, min_tile=128)
    # 3 tiles a row (ceil(sqrt(5))), 2 rows; each 32x32 sample shown as 128x128, 2-pixel borders
    assert grid.shape == (3, 2 + 2 * (128 + 2), 2 + 3 * (128 + 2))
    unit = to_unit_range(images)
    for i in range(5):
        r, c = divmod(i, 3)
        tile = grid[:, 2 + r * 130: 2 + r * 130 + 128, 2 + c * 130: 2 + c * 130 + 128]
        assert torch.equal(tile[:, ::4, ::4], unit[i])  # the model's own pixels
        assert torch.equal(tile, unit[i].repeat_interleave(4, -2).repeat_interleave(4, -1))  # as 4x4 blocks
    assert grid_image(images, min_tile=0).shape == (3, 2 + 2 * 34, 2 + 3 * 34)
    assert grid_image(_images(4, size=256), min_tile=128).shape == (3, 2 + 2 * 258, 2 + 2 * 258)
    with pytest.raises(ValueError, match=r"images: expected \[N, 3, H, W\]"):
        grid_image(torch.zeros(2, 1, 8, 8))


def test_save_grid_without_enlarging_writes_what_it_did_before(tmp_path):
    images = _images(4)
    save_grid(images, str(tmp_path / "new.png"), nrow=2)
    save_image(to_unit_range(images), str(tmp_path / "old.png"), nrow=2, padding=2)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "new.png")), np.asarray(Image.open(tmp_path / "old.png")))


class _Data(L.LightningDataModule):
    def train_dataloader(self):
        data = torch.rand(8, 3, 32, 32) * 2 - 1
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


def _fit(tmp_path, logger, **task_kwargs):
    torch.manual_seed(0)
    task = GANTask(TINY_G, TINY_D, r1_interval=None, max_kimg=0.008, sample_every_n_steps=1, sample_grid=4,
                   **task_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=10, logger=logger, log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(task, _Data())
    return task


def test_gan_samples_in_tensorboard_at_the_models_pixels(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb", default_hp_metric=False)
    task = _fit(tmp_path, logger)
    assert int(task.d_steps) == 2
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    assert "samples/g_ema" in events.Tags()["images"]
    shown = events.Images("samples/g_ema")
    side = 2 + 2 * (128 + 2)  # 2x2 samples of 32 pixels, each shown 4x
    assert [e.step for e in shown] == [0, 1] and all((e.width, e.height) == (side, side) for e in shown)
    assert [e.step for e in events.Scalars("loss/g")] == [0, 1]  # on the losses' steps
    png = sorted(os.listdir(tmp_path / "samples"))
    assert len(png) == 2 and Image.open(tmp_path / "samples" / png[-1]).size == (side, side)


def test_gan_samples_as_generated_without_tensorboard(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    _fit(tmp_path, CSVLogger(str(tmp_path)), sample_min_tile=0)
    png = sorted(os.listdir(tmp_path / "samples"))
    assert Image.open(tmp_path / "samples" / png[-1]).size == (2 + 2 * 34, 2 + 2 * 34)
    assert not any("tfevents" in f for _, _, files in os.walk(tmp_path) for f in files)


def _generator():
    return tiny_generator().eval()


def test_generate_progress_bar_and_grid(tmp_path, capsys):
    result = generate_images(_generator(), str(tmp_path / "a"), num_images=5, batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "generate" in err and "5/5" in err
    assert Image.open(result["grid"]).size == (2 + 3 * 130, 2 + 2 * 130)
    assert [os.path.basename(p) for p in result["images"]] == [f"seed{s:06d}.png" for s in range(5)]
    assert Image.open(result["images"][0]).size == (32, 32)  # single images as generated
    generate_images(_generator(), str(tmp_path / "b"), num_images=2, progress=False)
    assert capsys.readouterr().err == ""


class _StandIn(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(123)
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, 2), nn.ReLU())
        self.num_features = 8

    def forward(self, x):
        return self.net(x.float()).mean(dim=(2, 3))


def test_fid_progress_bars(capsys):
    real = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.rand(20, 3, 32, 32) * 2 - 1),
                                       batch_size=8)
    result = compute_fid(_generator(), real, num_fake=12, num_real=16, batch_size=8, feature_extractor=_StandIn(),
                         progress=True)
    err = capsys.readouterr().err
    assert result["num_real"] == 16 and result["num_fake"] == 12
    assert "FID real" in err and "16/16" in err and "FID generated" in err and "12/12" in err
    compute_fid(_generator(), real, num_fake=4, batch_size=4, feature_extractor=_StandIn())
    assert capsys.readouterr().err == ""


def test_eval_generate_and_fid_configs_turn_the_bars_and_enlarging_on():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        generate = compose(config_name="eval", overrides=["task=generate"]).task
        fid = compose(config_name="eval", overrides=["task=fid"]).task
        gan = compose(config_name="train", overrides=["experiment=stylenat_skimage"]).task.module
    assert generate.progress and generate.grid_min_tile == DISPLAY_TILE and fid.progress
    assert gan.sample_min_tile == DISPLAY_TILE


def _imported_modules(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = set()
    for node in ast.walk(tree):  # function-level imports included
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_gan_and_generate_share_one_module_and_do_not_import_each_other():
    gan, generate = _imported_modules("namodels/tasks/gan.py"), _imported_modules("namodels/tasks/generate.py")
    assert "namodels.tasks.generate" not in gan and "namodels.tasks.gan" not in generate
    assert "namodels.tasks.generators" in gan and "namodels.tasks.generators" in generate
    import namodels.tasks.gan as gan_module
    import namodels.tasks.generate as generate_module
    import namodels.tasks.generators as shared

    assert gan_module.load_generator is shared.load_generator and generate_module.save_grid is shared.save_grid
