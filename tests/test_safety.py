"""The application's safety net: checkpoints never run code when loaded and survive a killed save, runs
never overwrite earlier runs, short runs work, unreadable or unusual images are skipped (counted by
file) or read correctly, and bad model arguments fail at construction with the argument's name.

Every test makes its own data in tmp_path; nothing is downloaded."""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import logging
import os
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

import lightning.pytorch as pl
import numpy as np
import pytest
import timm
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from PIL import Image

import namodels  # noqa: F401  registers the models
import ops
from namodels.models.stylenat import StyleNATGenerator, load_official_generator
from namodels.tasks.gan import load_generator
from namodels.tasks.runner import fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
TINY_G = dict(size=32, channels=[16, 16, 16, 8], style_dim=8, n_mlp=1)
# One or two small batches of digits on one thread: a run takes a few seconds.
QUICK = ["experiment=digits", "threads=1", "logger=csv", "callbacks.progress_bar=null",
         "callbacks.model_summary=null", "data.batch_size=16", "data.val_batch_size=64",
         "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.max_epochs=1",
         "trainer.log_every_n_steps=1", "task.module.scheduler.warmup_epochs=0"]


@pytest.fixture(autouse=True)
def _naive_backend():
    with ops.use_backend("naive"):
        yield


def compose_cfg(name, overrides=()):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def train(root, *overrides):
    cfg = compose_cfg("train", QUICK + [f"paths.root_dir={root}", *overrides])
    return cfg, fit(cfg)


def run_script(script, *argv):
    """Runs train.py / eval.py in this process exactly as from the shell (Hydra, its callbacks, its run
    folders), restoring the logging set-up Hydra replaces."""
    root_logger = logging.getLogger()
    handlers, level = list(root_logger.handlers), root_logger.level
    old_argv = sys.argv
    GlobalHydra.instance().clear()
    sys.argv = [script, *argv]
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    finally:
        sys.argv = old_argv
        GlobalHydra.instance().clear()
        for handler in root_logger.handlers[:]:
            if handler not in handlers:
                root_logger.removeHandler(handler)
                handler.close()
        root_logger.setLevel(level)


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def files_of(folder) -> dict:
    """{relative path: sha256} of every file under ``folder``."""
    out = {}
    for path in glob.glob(os.path.join(str(folder), "**", "*"), recursive=True):
        if os.path.isfile(path):
            out[os.path.relpath(path, folder)] = digest(path)
    return out


# ------------------------------------------------------------------------------------------------
# Loading a checkpoint never runs code
# ------------------------------------------------------------------------------------------------


class RunsShellCommand:
    """Unpickling this runs a shell command that creates ``marker``: what a malicious file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def tiny_generator_state() -> dict:
    torch.manual_seed(0)
    return StyleNATGenerator(**TINY_G).state_dict()


def lightning_gan_checkpoint(path, extra) -> str:
    """A file laid out like our GAN checkpoints (Lightning + the release's state_dicts)."""
    state = {f"ema.module.{k}": v for k, v in tiny_generator_state().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"generator": TINY_G}, **extra}, path)
    return str(path)


def release_checkpoint(path, extra) -> str:
    """A file laid out like a released StyleNAT g_ema checkpoint."""
    torch.save({"g_ema": tiny_generator_state(), **extra}, path)
    return str(path)


@pytest.mark.parametrize("layout", [lightning_gan_checkpoint, release_checkpoint])
def test_loading_a_generator_never_runs_pickled_code(tmp_path, layout):
    marker = tmp_path / "code-ran"
    path = layout(tmp_path / "evil.pt", {"payload": RunsShellCommand(marker)})
    with pytest.raises(ValueError, match="ckpt_path: .*evil.pt.*not plain data"):
        load_generator(path, release_cfg=TINY_G, w_avg_samples=8)
    assert not marker.exists()
    if layout is release_checkpoint:
        with pytest.raises(ValueError, match="not plain data"):
            load_official_generator(StyleNATGenerator(**TINY_G), path, w_avg_samples=8)
        assert not marker.exists()


@pytest.mark.parametrize("task", ["generate", "fid"])
def test_eval_tasks_never_run_pickled_code(tmp_path, task):
    marker = tmp_path / "code-ran"
    path = release_checkpoint(tmp_path / "g_ema.pt", {"payload": RunsShellCommand(marker)})
    cfg = compose_cfg("eval", [f"task={task}", f"ckpt_path={path}", f"paths.root_dir={tmp_path}",
                               "data=skimage", "+model.generator={size:32,channels:[16,16,16,8],style_dim:8,n_mlp:1}"])
    with pytest.raises(ValueError, match="not plain data"):
        instantiate(cfg.task.run)(cfg)
    assert not marker.exists()


def test_released_files_with_their_metadata_still_load(tmp_path):
    """Released files carry argparse ``args`` and numpy FID floats beside the weights: both are allowed."""
    args = argparse.Namespace(size=16, lr=0.002, device="cuda", rng_state=torch.get_rng_state())
    path = release_checkpoint(tmp_path / "release.pt", {"args": args, "eval_info": {"fid @ 1M": np.float64(3.1)}})
    generator = load_generator(path, release_cfg=TINY_G, w_avg_samples=8)
    torch.testing.assert_close(generator.const, tiny_generator_state()["const"])


@pytest.mark.parametrize("damage", ["empty", "not_safetensors", "truncated"])
def test_broken_safetensors_name_the_file_and_the_setting(tmp_path, damage):
    """A damaged weights file fails with its path and the setting that named it, not safetensors' bare
    'Error while deserializing header'."""
    from namodels.tasks.models import create_model, export_weights

    good = export_weights(timm.create_model("nat_digits").state_dict(), str(tmp_path / "good.safetensors"),
                          model_name="nat_digits", num_classes=10, source="test")
    data = open(good, "rb").read()
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes({"empty": b"", "not_safetensors": b"not a safetensors file",
                        "truncated": data[:len(data) // 2]}[damage])
    with pytest.raises(ValueError, match=r"model.pretrained_file: '.*broken.safetensors' is not a readable "
                                         r"safetensors file \(.*\)"):
        create_model(dict(name="nat_digits", pretrained_file=str(broken)), 10)
    with pytest.raises(ValueError, match=r"ckpt_path: '.*broken.safetensors' is not a readable safetensors file"):
        load_generator(str(broken))
    assert create_model(dict(name="nat_digits", pretrained_file=good), 10) is not None


# ------------------------------------------------------------------------------------------------
# Checkpoints are written atomically, beside their target
# ------------------------------------------------------------------------------------------------


def test_checkpoints_do_not_go_through_tmpdir(tmp_path, monkeypatch):
    """A $TMPDIR that cannot take the checkpoint (full, too small, missing) does not matter."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpdir-that-does-not-exist"))
    _, summary = train(tmp_path)
    assert torch.load(summary["last_checkpoint"], weights_only=True)["global_step"] == 2


def test_checkpoint_is_synced_then_renamed_into_place(tmp_path, monkeypatch):
    from namodels.tasks.checkpoints import AtomicCheckpointIO

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.path.dirname(a))),
                                                     real_replace(a, b))[1])
    target = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(3)}, str(target))
    assert events[0] == "fsync" and events[1] == ("replace", str(target.parent))
    assert os.listdir(target.parent) == ["last.ckpt"]
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(str(target))["w"], torch.ones(3))


def test_checkpoints_and_exports_get_the_mode_of_the_other_outputs(tmp_path):
    """Under umask 022 the checkpoints and exported weights are 0644, as the run's other files (tempfile.mkstemp
    and safetensors' save_file make 0600 files); under umask 027, 0640."""
    import stat

    from namodels.tasks.checkpoints import atomic_save
    from namodels.tasks.models import export_weights

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    old = os.umask(0o022)
    try:
        cfg, summary = train(tmp_path)
        outputs = [summary["best_checkpoint"], summary["last_checkpoint"], *summary["exported"]]
        assert len(outputs) == 3
        summary_file = os.path.join(cfg.paths.output_dir, "summary.json")
        assert {os.path.basename(p): mode(p) for p in outputs + [summary_file]} == \
            {os.path.basename(p): 0o644 for p in outputs + [summary_file]}
        os.umask(0o027)
        atomic_save({"w": torch.ones(2)}, str(tmp_path / "other" / "a.ckpt"))
        export_weights({"w": torch.ones(2)}, str(tmp_path / "other" / "a.safetensors"), model_name="nat_digits",
                       num_classes=10, source="test")
        assert sorted(os.listdir(tmp_path / "other")) == ["a.ckpt", "a.safetensors"]  # no temporary file left
        assert mode(tmp_path / "other" / "a.ckpt") == mode(tmp_path / "other" / "a.safetensors") == 0o640
    finally:
        os.umask(old)


class KillDuringSave(pl.Callback):
    """Test-only: pads every checkpoint with ``ballast_mb`` MiB (so a save takes a while) and, during
    epoch ``epoch``, SIGKILLs its own process as soon as ``last.ckpt`` or a file beside it changes."""

    def __init__(self, epoch: int = 1, ballast_mb: int = 96):
        self.epoch, self.ballast_mb = epoch, ballast_mb

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["ballast"] = torch.ones(self.ballast_mb * 2 ** 18)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            folder = next(cb.dirpath for cb in trainer.checkpoint_callbacks if cb.filename == "last")
            threading.Thread(target=self._watch, args=(folder,), daemon=True).start()

    @staticmethod
    def _watch(folder):
        def state():
            last = os.path.join(folder, "last.ckpt")
            st = os.stat(last)
            others = sorted(f for f in os.listdir(folder) if "last" in f and f != "last.ckpt")
            return st.st_ino, st.st_size, st.st_mtime_ns, others

        before = state()
        while True:
            try:
                if state() != before:
                    os.kill(os.getpid(), signal.SIGKILL)
            except FileNotFoundError:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0005)


def test_killed_save_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL while last.ckpt is being replaced, with $TMPDIR on another filesystem: the previous
    last.ckpt survives whole, the next start removes the killed save's leftovers and resumes from it."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a $TMPDIR on another filesystem than tmp_path")
    overrides = QUICK + ["trainer.max_epochs=2", f"paths.root_dir={tmp_path}", "export=false"]
    cmd = [sys.executable, "train.py", *overrides, "+callbacks.kill._target_=tests.test_safety.KillDuringSave"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, TMPDIR=shm))
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-4000:]
    (last,) = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    folder = os.path.dirname(last)
    assert torch.load(last, weights_only=True)["epoch"] == 0  # the previous checkpoint, whole
    assert [f for f in os.listdir(folder) if f.endswith(".partial")]  # what the killed save left
    _, resumed = train(tmp_path, *overrides[len(QUICK):], "ckpt_path=last")
    assert resumed["last_checkpoint"] == last and resumed["global_step"] == 4
    assert not [f for f in os.listdir(folder) if f.endswith(".partial")]


# ------------------------------------------------------------------------------------------------
# Runs never overwrite runs
# ------------------------------------------------------------------------------------------------


def test_second_run_gets_its_own_folder_and_last_resumes_the_latest(tmp_path):
    first_cfg, first = train(tmp_path)
    first_dir = first_cfg.paths.output_dir
    before = files_of(first_dir)
    assert {"summary.json", os.path.join("checkpoints", "last.ckpt")} <= set(before)
    second_cfg, second = train(tmp_path)
    assert second_cfg.paths.output_dir != first_dir
    assert files_of(first_dir) == before  # untouched: checkpoints, export, summary, logs
    _, resumed = train(tmp_path, "trainer.max_epochs=2", "ckpt_path=last")
    assert resumed["last_checkpoint"] == second["last_checkpoint"] and resumed["global_step"] == 4
    assert files_of(first_dir) == before


def test_multirun_jobs_get_their_own_folders(tmp_path):
    run_script("train.py", "-m", *QUICK, "export=false", f"paths.root_dir={tmp_path}", "seed=1,2")
    summaries = glob.glob(str(tmp_path / "logs" / "classification" / "**" / "summary.json"), recursive=True)
    assert len(summaries) == 2 and len({os.path.dirname(s) for s in summaries}) == 2
    for path in summaries:
        last = json.load(open(path))["last_checkpoint"]
        assert os.path.dirname(os.path.dirname(last)) == os.path.dirname(path)


def test_train_script_writes_hydra_files_into_the_run_folder(tmp_path):
    run_script("train.py", *QUICK, "export=false", f"paths.root_dir={tmp_path}")
    run_script("train.py", *QUICK, "export=false", f"paths.root_dir={tmp_path}")
    logs = sorted(glob.glob(str(tmp_path / "logs" / "classification" / "**" / "train.log"), recursive=True))
    assert len(logs) == 2
    for log_file in logs:
        folder = os.path.dirname(log_file)
        assert os.path.isfile(os.path.join(folder, "summary.json"))
        assert os.path.isfile(os.path.join(folder, ".hydra", "config.yaml"))


def test_generate_runs_do_not_mix_images(tmp_path):
    ckpt = lightning_gan_checkpoint(tmp_path / "gan.ckpt", {})
    common = ["task=generate", f"ckpt_path={ckpt}", f"paths.root_dir={tmp_path}", "task.batch_size=4"]
    run_script("eval.py", *common, "task.num_images=3")
    run_script("eval.py", *common, "task.num_images=1", "task.seed=7")
    folders = glob.glob(str(tmp_path / "logs" / "generate" / "**" / "images"), recursive=True)
    assert sorted(sorted(os.listdir(f)) for f in folders) == [
        ["grid.png", "seed000000.png", "seed000001.png", "seed000002.png"], ["grid.png", "seed000007.png"]]


def test_generate_into_a_folder_of_earlier_images_is_refused(tmp_path):
    from namodels.tasks.generate import generate_images

    torch.manual_seed(0)
    generator = StyleNATGenerator(**TINY_G).eval()
    generate_images(generator, str(tmp_path / "images"), num_images=2)
    with pytest.raises(ValueError, match="out_dir: .*already holds images"):
        generate_images(generator, str(tmp_path / "images"), num_images=1)


# ------------------------------------------------------------------------------------------------
# Short runs work
# ------------------------------------------------------------------------------------------------


def test_one_epoch_run_with_the_default_warmup(tmp_path):
    """``python train.py trainer.max_epochs=1``: the digits recipe warms up for 1 epoch."""
    cfg = compose_cfg("train", [o for o in QUICK if "warmup_epochs" not in o] + [f"paths.root_dir={tmp_path}"])
    assert cfg.task.module.scheduler.warmup_epochs == 1 and cfg.trainer.max_epochs == 1
    summary = fit(cfg)
    assert summary["global_step"] == 2 and 0 <= summary["metrics"]["val/top1"] <= 100


# ------------------------------------------------------------------------------------------------
# Unreadable and unusual images
# ------------------------------------------------------------------------------------------------


def _png(path, value, size=12, mode="RGB"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if mode == "I;16":
        Image.fromarray(np.full((size, size), value, np.uint16)).save(path)
    else:
        Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(path)
    return str(path)


def bad_files(folder, monkeypatch) -> set:
    """A decompression bomb (for a lowered pixel limit), a dangling symlink and a file that is no image."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 2x over it (64x64) is a decompression bomb
    bomb = _png(os.path.join(folder, "bomb.png"), 100, size=64)
    dangling = os.path.join(folder, "dangling.png")
    os.symlink(os.path.join(folder, "deleted.png"), dangling)
    garbage = os.path.join(folder, "garbage.png")
    with open(garbage, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n not an image")
    return {bomb, dangling, garbage}


def test_classification_run_skips_unreadable_files_and_counts_each_once(tmp_path, monkeypatch):
    root = tmp_path / "images"
    for label in range(2):
        for i in range(10):
            _png(root / f"class{label}" / f"{i}.png", 60 + 120 * label)
    bad = bad_files(str(root / "class0"), monkeypatch)
    _, summary = train(tmp_path, "data=image_folder", f"data.root={root}", "data.num_classes=2", "data.img_size=32",
                       "data.num_workers=0", "data.pin_memory=false", "data.val_fraction=0.3", "data.batch_size=4",
                       "data.val_batch_size=8", "data.augment.auto_augment=null", "data.augment.re_prob=0",
                       "trainer.max_epochs=2", "trainer.limit_train_batches=null", "trainer.limit_val_batches=null")
    assert summary["epochs"] == 2
    assert summary["skipped_images"] == 3 and set(summary["skipped_files"]) == bad


def test_gan_image_folder_skips_unreadable_files(tmp_path, monkeypatch):
    from namodels.data.images import GANDataModule

    for i in range(5):
        _png(tmp_path / f"{i}.png", 40 * i)
    bad = bad_files(str(tmp_path), monkeypatch)
    dm = GANDataModule(source="folder", root=str(tmp_path), resolution=8, batch_size=4, pin_memory=False)
    skipped = set()
    for _ in range(2):  # two epochs: each unreadable file counts once
        for images, unreadable in dm.train_dataloader():
            assert images.shape == (4, 3, 8, 8)  # replaced, so batches stay full
            skipped.update(unreadable)
    assert skipped == bad


def _png_header(width: int, height: int) -> bytes:
    """A 68-byte PNG whose header claims ``width`` x ``height`` RGB pixels (its data holds almost none)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(10))) + chunk(b"IEND", b""))


def test_images_over_the_pixel_limit_are_refused_before_decoding(tmp_path, monkeypatch):
    """Pillow warns above Image.MAX_IMAGE_PIXELS (89M pixels) and refuses only above twice that: images in
    between were decoded (up to about 1.3 GB each).  They are refused from their header as decompression
    bombs, skipped and reported by path."""
    import warnings

    from namodels.data.decoding import Unreadable, UnreadableImage, open_rgb
    from namodels.data.images import ImageFolder
    from namodels.data.sources import build_splits

    big = tmp_path / "big.png"  # 100M pixels: over the default limit, under twice it
    big.write_bytes(_png_header(10_000, 10_000))
    with warnings.catch_warnings(), pytest.raises(UnreadableImage) as refused:
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # Pillow's own, from the header
        open_rgb(str(big))
    assert isinstance(refused.value.reason, Image.DecompressionBombError) and str(big) in str(refused.value)

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 40x40 = 1600 pixels: Pillow alone would only warn
    root = tmp_path / "images"
    for label in range(2):
        for i in range(3):
            _png(root / f"class{label}" / f"{i}.png", 60 + 120 * label)  # 12x12: read
    bomb = _png(root / "class0" / "bomb.png", 100, size=40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        train_set, val_set = build_splits(dict(format="image_folder", root=str(root), val_fraction=0.25,
                                               split_seed=0))
        items = [ds[i] for ds in (train_set, val_set) for i in range(len(ds))]
        assert [item.path for item in items if isinstance(item, Unreadable)] == [bomb]
        assert sum(not isinstance(item, Unreadable) for item in items) == 6
        gan = ImageFolder(str(root / "class0"), resolution=8, hflip=False)
        assert [path for i in range(len(gan)) for path in gan[i][1]] == [bomb]


def test_16_bit_png_keeps_its_brightness(tmp_path):
    from namodels.data.images import ImageFolder
    from namodels.data.sources import build_splits
    from namodels.data.video import read_image

    path = _png(tmp_path / "grey" / "a.png", 30000, mode="I;16")  # 30000 / 65535 = 46% grey
    for i in range(3):
        _png(tmp_path / "grey" / f"b{i}.png", 117)
    assert Image.open(path).mode.startswith("I")
    expected = 30000 / 65535
    gan = ImageFolder(str(tmp_path / "grey"), resolution=12, hflip=False)
    assert abs(gan[0][0].mean().item() - (2 * expected - 1)) < 0.01
    assert abs(read_image(path).float().mean().item() / 255 - expected) < 0.01
    train_set, val_set = build_splits(dict(format="image_folder", root=str(tmp_path), val_fraction=0.25, split_seed=0))
    images = [ds[i][0] for ds in (train_set, val_set) for i in range(len(ds))]
    assert all(abs(np.asarray(im, np.float32).mean() / 255 - expected) < 0.01 for im in images)


# ------------------------------------------------------------------------------------------------
# Model arguments
# ------------------------------------------------------------------------------------------------

MODELS = ["nat_mini", "dinat_s_tiny", "nat_digits", "video_nat_nano", "stylenat"]
BAD_ARGUMENTS = [
    ("kernel_size", dict(kernel_size=6), "kernel_size: must be odd"),
    ("mlp_ratio", dict(mlp_ratio=0), "mlp_ratio: must be > 0"),
    ("backend", dict(backend="fuse"), "backend: unknown backend 'fuse'"),
    ("drop_path_rate", dict(drop_path_rate=1.0), r"drop_path_rate: must be in \[0, 1\)"),
    ("drop_path_rate", dict(drop_path_rate=-0.1), r"drop_path_rate: must be in \[0, 1\)"),
]


def build(name, **kwargs):
    if name == "stylenat":
        return StyleNATGenerator(**{**TINY_G, **kwargs})
    if name == "nat_digits" and "kernel_size" in kwargs:
        kwargs["kernel_sizes"] = ((kwargs.pop("kernel_size"), 3), (3, 3))
    return timm.create_model(name, **kwargs)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("argument, kwargs, match", BAD_ARGUMENTS)
def test_bad_model_arguments_fail_at_construction(name, argument, kwargs, match):
    if name == "stylenat" and argument == "drop_path_rate":
        pytest.skip("StyleNAT has no stochastic depth")
    if name == "nat_digits" and argument == "kernel_size":
        match = match.replace("kernel_size", "kernel_sizes")
    with torch.device("meta"), pytest.raises(ValueError, match=match):
        build(name, **kwargs)


@pytest.mark.parametrize("name, shape, argument", [
    ("nat_digits", (0, 3, 32, 32), "x"), ("nat_mini", (0, 3, 32, 32), "x"), ("dinat_s_tiny", (0, 3, 32, 32), "x"),
    ("video_nat_nano", (0, 4, 1, 32, 32), "clip")])
def test_empty_batch_is_named(name, shape, argument):
    kwargs = dict(in_chans=1, img_size=32) if name.startswith("video") else {}
    model = timm.create_model(name, **kwargs).eval()
    with pytest.raises(ValueError, match=f"{argument}: empty batch"):
        model(torch.zeros(shape))


def test_empty_latent_batch_is_named():
    with pytest.raises(ValueError, match="z: empty batch"):
        StyleNATGenerator(**TINY_G)(torch.zeros(0, TINY_G["style_dim"]))


def test_mixup_with_single_image_batches(tmp_path):
    _, summary = train(tmp_path, "data.batch_size=1", "task.module.mixup.mixup_alpha=0.8",
                       "task.module.mixup.cutmix_alpha=1.0", "trainer.limit_train_batches=3", "export=false")
    assert summary["global_step"] == 3 and np.isfinite(summary["metrics"]["train/loss_epoch"])
