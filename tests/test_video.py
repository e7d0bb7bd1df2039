"""Causal video NAT: causality, streaming == full clip, bounded cache, data sets, task.

Models here are tiny (2 blocks, width 32, 24x24 frames -> 6x6 tokens so the dilated blocks really
dilate) to keep the default selection fast on 2 CPU cores.  Tolerances: fp32 streaming vs full
clip differ only by the log-sum-exp merge order, atol 2e-5.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import timm
import torch

import namodels  # noqa: F401  (registers the models)
from namodels.data.moving_digits import MovingDigits
from namodels.data.video import VideoClips
from namodels.models.video import VideoNAT, VideoRope

FP32_ATOL = 2e-5


def tiny_model(**kwargs) -> VideoNAT:
    cfg = dict(img_size=24, in_chans=2, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0,
               kernel_size=3, temporal_kernel=3, dilation=2, layer_scale=1.0, num_classes=4)
    cfg.update(kwargs)
    torch.manual_seed(cfg.pop("seed", 0))
    return VideoNAT(**cfg).eval()


def random_clip(b=2, t=7, c=2, size=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, t, c, size, size, generator=g)


# ----------------------------------------------------------------------------------------- model


def test_registry_sizes_and_shapes():
    assert {"video_nat_nano", "video_nat_tiny", "video_nat_small"} <= set(timm.list_models("video_nat_*"))
    model = timm.create_model("video_nat_tiny", depth=1)  # full width, one block: cheap to build
    assert isinstance(model, VideoNAT) and model.num_classes == 0 and model.embed_dim == 192
    model = timm.create_model("video_nat_nano", num_classes=3, embed_dim=32, depth=2, num_heads=2).eval()
    clip = random_clip(b=1, t=4, c=1, size=32)
    with torch.no_grad():
        feats = model.forward_features(clip)
        assert feats.shape == (1, 4, 8, 8, 32)
        assert model(clip).shape == (1, 3)
        assert model.predict_next_frames(clip).shape == clip.shape
    model.reset_classifier(0)
    with torch.no_grad():
        assert model(clip).shape == clip.shape


def test_dilation_alternates_and_bad_inputs_raise():
    model = tiny_model(depth=4)
    assert model.dilations == [1, 2, 1, 2]
    assert all(b.attn.is_causal == (True, False, False) and b.attn.rpb is None for b in model.blocks)
    with pytest.raises(ValueError, match="clip"):
        model(torch.rand(2, 2, 24, 24))
    with pytest.raises(ValueError, match="frames"):
        model(torch.rand(1, 3, 2, 26, 26))
    with pytest.raises(ValueError, match="kernel_size"):
        model(torch.rand(1, 3, 2, 8, 8))  # 2x2 tokens < 3x3 window
    with pytest.raises(ValueError, match="dilations"):
        tiny_model(dilations=[1])
    with pytest.raises(ValueError, match="patch_size"):
        tiny_model(patch_size=3)


def test_rope_is_relative():
    """Rotated q.k depends only on the position difference (what makes it causal-safe)."""
    rope = VideoRope(12)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 12, generator=g, dtype=torch.float64)
    rot = rope.tables(torch.arange(40), 8, 8, torch.float64)  # [40, 8, 8, 1, 6]
    assert rot.dtype == torch.complex128 and torch.allclose(rot.abs(), torch.ones(()).double())

    def logit(pq, pk):
        return (rope.rotate(q, rot[pq][0]) * rope.rotate(k, rot[pk][0])).sum()

    assert torch.allclose(logit((3, 1, 2), (1, 0, 4)), logit((33, 2, 3), (31, 1, 5)))
    assert not torch.allclose(logit((3, 1, 2), (1, 0, 4)), logit((3, 1, 2), (2, 0, 4)))


@pytest.mark.parametrize("backend", [None, "naive"])
def test_causality_future_frames_never_change_the_past(backend):
    model = tiny_model(backend=backend)
    clip = random_clip()
    t = 4
    changed = clip.clone()
    changed[:, t] = torch.rand(changed[:, t].shape, generator=torch.Generator().manual_seed(7)) * 3 - 1
    with torch.no_grad():
        a, b = model.forward_features(clip), model.forward_features(changed)
        pa, pb = model.predict_next_frames(clip, a), model.predict_next_frames(changed, b)
    assert torch.equal(a[:, :t], b[:, :t]) and torch.equal(pa[:, :t], pb[:, :t])
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=(0, 2, 3, 4)).min() > 1e-3  # every later frame sees it


def test_causality_of_gradients():
    model = tiny_model()
    clip = random_clip().requires_grad_(True)
    t = 3
    model.predict_next_frames(clip)[:, :t].square().sum().backward()
    assert clip.grad[:, t:].abs().max() == 0
    assert clip.grad[:, :t].abs().amax(dim=(0, 2, 3, 4)).min() > 0


@pytest.mark.parametrize("backend", [None, "naive"])
def test_streaming_equals_full_clip(backend):
    """Clip of 9 frames, window 3: every frame's prediction, features and running logits match."""
    model = tiny_model(backend=backend)
    clip = random_clip(t=9)
    with torch.no_grad():
        feats = model.forward_features(clip)
        pred = model.predict_next_frames(clip, feats)
    state = model.init_stream()
    for t in range(clip.shape[1]):
        out = model.step(clip[:, t], state)
        torch.testing.assert_close(out["features"], feats[:, t], atol=FP32_ATOL, rtol=0)
        torch.testing.assert_close(out["next_frame"], pred[:, t], atol=FP32_ATOL, rtol=0)
        with torch.no_grad():
            logits = model.classify(clip[:, : t + 1])
        torch.testing.assert_close(out["logits"], logits, atol=FP32_ATOL, rtol=0)
    assert state.t == clip.shape[1]


def test_streaming_other_resolution_window_and_residual_head():
    """Non-default frame size (interpolated absolute embedding), k_t = 4, residual head, no layer scale."""
    model = tiny_model(temporal_kernel=4, predict_residual=True, layer_scale=None, num_classes=0, seed=3)
    clip = random_clip(b=1, t=6, size=32)
    with torch.no_grad():
        pred = model(clip)
    state = model.init_stream()
    streamed = torch.stack([model.step(clip[:, t], state)["next_frame"] for t in range(6)], 1)
    torch.testing.assert_close(streamed, pred, atol=FP32_ATOL, rtol=0)


def test_short_clip_shorter_than_window():
    model = tiny_model(temporal_kernel=5)
    clip = random_clip(t=2)
    with torch.no_grad():
        pred = model.predict_next_frames(clip)
        longer = model.predict_next_frames(torch.cat([clip, random_clip(t=4, seed=9)], 1))
    torch.testing.assert_close(pred, longer[:, :2], atol=FP32_ATOL, rtol=0)  # causal: a prefix is a prefix


def test_cache_memory_is_constant_in_clip_length():
    model = tiny_model()
    state = model.init_stream()
    frames = random_clip(t=30)
    sizes = []
    for t in range(30):
        model.step(frames[:, t], state)
        sizes.append(state.nbytes())
    # per block: keys + values of k_t frames of [B, 6, 6, heads, head_dim] fp32; plus the pooled sum
    expected = len(model.blocks) * 2 * (2 * 3 * 6 * 6 * 32) * 4 + 2 * 32 * 4
    assert sizes[0] == sizes[-1] == expected
    assert all(c.keys.shape[1] == model.temporal_kernel for c in state.caches)
    with pytest.raises(ValueError, match="frame"):
        model.step(random_clip(b=3, t=1)[:, 0], state)  # batch differs from the stream's


def test_rollout_matches_iterated_full_forward():
    model = tiny_model(num_classes=0)
    context = random_clip(b=1, t=3)
    gen = model.rollout(context, 3)
    assert gen.shape == (1, 3, 2, 24, 24)
    seq = context
    with torch.no_grad():
        for i in range(3):
            nxt = model(seq)[:, -1]
            torch.testing.assert_close(gen[:, i], nxt, atol=1e-4, rtol=0)
            seq = torch.cat([seq, nxt[:, None]], 1)


# ----------------------------------------------------------------------------------------- data


def test_moving_digits_deterministic_bounded_and_moving():
    ds = MovingDigits(num_clips=5, num_frames=12, image_size=32, num_digits=2, speed=(2.0, 3.0), seed=3)
    clip, label = ds[2]
    again, label2 = MovingDigits(num_clips=5, num_frames=12, image_size=32, num_digits=2, speed=(2.0, 3.0),
                                 seed=3)[2]
    assert clip.shape == (12, 1, 32, 32) and clip.dtype == torch.float32
    assert torch.equal(clip, again) and label == label2 and 0 <= label <= 9
    assert not torch.equal(clip, ds[3][0])
    assert clip.min() >= 0 and clip.max() <= 1 and clip.max() > 0.5
    assert (clip[1:] - clip[:-1]).abs().mean() > 0.01  # digits move
    _, path = ds.trajectories(2)
    assert path.min() >= 0 and path.max() <= 32 - 8
    step = np.abs(np.diff(path, axis=1)).sum(-1)
    assert step.max() <= 2 * 3.0 + 1e-6  # speed bound (reflections shorten a step, never lengthen it)


def test_moving_digits_held_out_sprites_and_bad_args():
    train, val = MovingDigits(split="train"), MovingDigits(split="val")
    assert len(train.images) + len(val.images) == 1797
    train_set = {a.tobytes() for a in train.images}
    assert not any(a.tobytes() in train_set for a in val.images[:50])
    assert not torch.equal(MovingDigits(num_clips=1, split="train")[0][0], MovingDigits(num_clips=1, split="val")[0][0])
    with pytest.raises(ValueError, match="split"):
        MovingDigits(split="other")
    with pytest.raises(ValueError, match="image_size"):
        MovingDigits(image_size=12, digit_scale=2)


def _write_frames(folder, n, size=(20, 30), seed=0):
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (n, *size, 3), dtype=np.uint8)
    for i, f in enumerate(frames):
        Image.fromarray(f).save(os.path.join(folder, f"frame{i}.png"))  # natural order: frame10 after frame9
    return frames


def test_video_clips_frame_folders_gif_and_labels(tmp_path):
    from PIL import Image

    frames = _write_frames(tmp_path / "cats" / "vid_a", 12)
    _write_frames(tmp_path / "dogs" / "vid_b", 9, seed=1)
    _write_frames(tmp_path / "dogs" / "too_short", 3, seed=2)
    gif = [Image.fromarray(np.full((16, 16, 3), 30 * i, np.uint8)) for i in range(8)]
    gif[0].save(tmp_path / "dogs" / "clip.gif", save_all=True, append_images=gif[1:], duration=40, loop=0)

    ds = VideoClips(str(tmp_path), num_frames=4, frame_stride=2, image_size=8, clips_per_video=2,
                    sampling="uniform", center_crop=False)
    assert ds.classes == ["cats", "dogs"] and ds.skipped == 1 and len(ds) == 2 * 3
    clip, label = ds[1]  # second (last) clip of cats/vid_a: start 12 - 7 = 5 -> frames 5, 7, 9, 11
    assert clip.shape == (4, 3, 8, 8) and label == 0
    want = torch.from_numpy(frames[[5, 7, 9, 11]]).permute(0, 3, 1, 2).float() / 255
    want = torch.nn.functional.interpolate(want, size=(8, 8), mode="bilinear", antialias=True, align_corners=False)
    torch.testing.assert_close(clip, want, atol=1e-5, rtol=0)
    gif_clip, gif_label = ds[2]  # clip.gif sorts before vid_b
    assert gif_label == 1 and gif_clip.shape == (4, 3, 8, 8)
    torch.testing.assert_close(gif_clip[:, 0, 0, 0], torch.tensor([0, 60, 120, 180]) / 255.0, atol=2 / 255, rtol=0)

    rnd = VideoClips(str(tmp_path), num_frames=4, image_size=(8, 10), sampling="random", grayscale=True)
    assert rnd[0][0].shape == (4, 1, 8, 10)
    with pytest.raises(ValueError, match="root"):
        VideoClips(str(tmp_path), num_frames=40)
    with pytest.raises(ValueError, match="sampling"):
        VideoClips(str(tmp_path), sampling="every")


# ----------------------------------------------------------------------------------------- task


TINY_MODEL = dict(name="video_nat_nano", backend=None,
                  kwargs=dict(embed_dim=32, depth=2, num_heads=2, kernel_size=3, dilation=2))
TINY_DATA = dict(name="moving_digits", source="moving_digits", num_frames=6, batch_size=4, val_batch_size=8,
                 train_clips=64, val_clips=8)


def _fit(tmp_path, **task_kwargs):
    import lightning.pytorch as pl

    from namodels.data.video import VideoDataModule
    from namodels.tasks.video import VideoTask

    task = VideoTask(TINY_MODEL, TINY_DATA, **{"rollout": dict(context=3), "scheduler": dict(warmup_steps=1),
                                               **task_kwargs})
    trainer = pl.Trainer(max_steps=2, limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
                         default_root_dir=str(tmp_path))
    before = [p.detach().clone() for p in task.model.parameters()]
    trainer.fit(task, VideoDataModule(TINY_DATA, seed=0))
    assert any(not torch.equal(a, b) for a, b in zip(before, task.model.parameters()))  # it trained
    return task, {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_task_next_frame_fit_and_metrics(tmp_path):
    task, m = _fit(tmp_path, loss="l1")
    assert task.model.in_chans == 1 and task.model.img_size == (32, 32)  # taken from the data config
    for key in ("val/mse", "val/copy_mse", "val/mse_ratio", "val/psnr", "val/ssim", "val/rollout_mse",
                "val/rollout_psnr", "val/rollout_ssim", "train/loss_step"):
        assert key in m and np.isfinite(m[key]), key
    assert m["val/copy_mse"] > 0 and abs(m["val/mse_ratio"] - m["val/mse"] / m["val/copy_mse"]) < 1e-5
    assert 0 < m["val/psnr"] < 60 and -1 <= m["val/ssim"] <= 1


def test_task_classification_fit(tmp_path):
    task, m = _fit(tmp_path, objective="classification")
    assert task.model.num_classes == 10 and 0 <= m["val/top1"] <= 100 and np.isfinite(m["val/loss"])


def test_task_and_data_config_errors(tmp_path):
    from namodels.data.video import VideoDataModule, check_data_config
    from namodels.tasks.video import VideoTask

    with pytest.raises(ValueError, match="task.module.objective"):
        VideoTask(TINY_MODEL, TINY_DATA, objective="segmentation")
    with pytest.raises(ValueError, match="task.module.rollout.context"):
        VideoTask(TINY_MODEL, TINY_DATA, rollout=dict(context=6))
    with pytest.raises(ValueError, match="model.name"):
        VideoTask(dict(name="nat_digits"), TINY_DATA)
    with pytest.raises(ValueError, match="data: unknown keys"):
        check_data_config(dict(TINY_DATA, img_sise=32))
    with pytest.raises(ValueError, match="data.channels"):
        check_data_config(dict(TINY_DATA, channels=3))
    with pytest.raises(ValueError, match="data.root"):
        check_data_config(dict(source="folder"))
    _write_frames(tmp_path / "v" / "a", 8)
    _write_frames(tmp_path / "v" / "b", 8, seed=1)
    dm = VideoDataModule(dict(source="folder", root=str(tmp_path / "v"), num_frames=4, img_size=16, batch_size=2,
                              val_fraction=0.5, clips_per_video=2), seed=0)
    clips, labels = next(iter(dm.train_dataloader()))
    assert clips.shape == (2, 4, 3, 16, 16) and labels.tolist() == [-1, -1]
    assert len(dm.val_set) == 1 and len(dm.train_set) == 2


@pytest.mark.slow
def test_default_cpu_run_halves_copy_last_frame_mse(tmp_path):
    """The acceptance run: python train.py experiment=video_moving_digits (CPU, < 15 minutes)."""
    import json
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    started = time.time()
    subprocess.run([sys.executable, "train.py", "experiment=video_moving_digits", f"paths.root_dir={tmp_path}",
                    "callbacks.progress_bar=null", "logger=csv"], cwd=root, check=True, timeout=20 * 60)
    elapsed = time.time() - started
    run = tmp_path / "logs" / "video" / "video_nat_nano-moving_digits-next_frame" / "version_0"
    summary = json.load(open(run / "summary.json"))
    m = summary["metrics"]
    assert m["val/mse"] <= 0.5 * m["val/copy_mse"], m
    assert elapsed < 15 * 60, elapsed


# ----------------------------------------------------------------------------------------- pictures and eval


def test_task_rollout_by_step_and_prediction_strip(tmp_path):
    task, m = _fit(tmp_path, rollout=dict(context=3, by_step=True))
    steps = [m[f"val/rollout_mse_step{k}"] for k in (1, 2, 3)]                 # 6 frames, 3 given: 3 generated
    assert "val/rollout_mse_step4" not in m
    assert np.mean(steps) == pytest.approx(m["val/rollout_mse"], rel=1e-5)     # equal frames per step
    clips = MovingDigits(5, num_frames=6, image_size=32, split="val")
    batch = (torch.stack([clips[i][0] for i in range(5)]), torch.zeros(5))
    fig = task.sample_figures(batch)["predictions"]
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[:2] == ["clip 0 true", "clip 0 predicted"] and len(labels) == 8  # the first 4 clips
    classifier, _ = _fit(tmp_path, objective="classification")
    assert classifier.sample_figures(batch) == {}


def _compose(name, overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_video_run_pictures_and_eval_reproduce_its_metrics(tmp_path):
    """A short built-in run writes predictions.png / curves.png / TensorBoard frames; eval.py task=video
    on its checkpoint gives the run's last validation metrics, per-step rollout errors and its own strip."""
    import json

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from namodels.tasks.runner import evaluate, fit

    summary = fit(_compose("train", [
        "experiment=video_moving_digits", f"paths.root_dir={tmp_path}", "logger=tensorboard", "export=false",
        "callbacks.progress_bar=null", "callbacks.model_summary=null", "trainer.max_steps=4",
        "trainer.val_check_interval=2", "data.val_clips=8", "data.val_batch_size=8"]))
    run = os.path.dirname(os.path.dirname(summary["last_checkpoint"]))
    for name in ("predictions.png", "curves.png"):
        assert Image.open(os.path.join(run, name)).format == "PNG", name
    events = EventAccumulator(os.path.join(run, "tensorboard", "version_0"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("val/predictions")] == [2, 4]

    cfg = _compose("eval", ["task=video", f"ckpt_path={summary['last_checkpoint']}", f"paths.root_dir={tmp_path}",
                            "trainer.enable_progress_bar=false"])
    result = evaluate(cfg)
    m = summary["metrics"]
    for key in ("mse", "copy_mse", "mse_ratio", "psnr", "ssim", "rollout_mse", "rollout_psnr", "rollout_ssim"):
        assert result[key] == pytest.approx(m[f"val/{key}"], rel=1e-4, abs=1e-6), key
    assert (result["frames"], result["context"], result["clips"]) == (8, 4, 8)
    assert len(result["rollout_mse_by_step"]) == 4
    assert np.mean(result["rollout_mse_by_step"]) == pytest.approx(result["rollout_mse"], rel=1e-4)
    out = tmp_path / "logs" / "video" / "eval" / "version_0"
    assert json.load(open(out / "results.json")) == json.loads(json.dumps(result))
    assert open(out / "results.csv").read().splitlines()[0].startswith("model,objective,data,clips")
    assert Image.open(out / "predictions.png").format == "PNG"

    # the classification evaluation names the video one instead of failing on the missing classifier
    from namodels.tasks.runner import evaluate as run_eval
    with pytest.raises(ValueError, match="eval.py task=video ckpt_path="):
        run_eval(_compose("eval", [f"ckpt_path={summary['last_checkpoint']}", f"paths.root_dir={tmp_path}"]))


def test_video_eval_refuses_other_checkpoints(tmp_path):
    from namodels.tasks.video_eval import load_video_checkpoint

    path = tmp_path / "classifier.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"model": {"name": "nat_digits"}, "num_classes": 10}}, path)
    with pytest.raises(ValueError, match="not a checkpoint of the video task"):
        load_video_checkpoint(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        load_video_checkpoint(str(tmp_path / "missing.ckpt"))


def test_video_clips_length_scan_has_a_progress_bar(tmp_path, monkeypatch):
    """Knowing a video file's length means decoding it: that scan shows a bar; frame folders need none."""
    from PIL import Image

    import namodels.data.video as video

    bars = []

    class Recording(video.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append((self.total, kwargs.get("disable")))

    monkeypatch.setattr(video, "tqdm", Recording)
    _write_frames(tmp_path / "frames" / "a", 6)
    VideoClips(str(tmp_path / "frames"), num_frames=4, image_size=8)
    gif = [Image.fromarray(np.full((8, 8, 3), 30 * i, np.uint8)) for i in range(6)]
    for name in ("x", "y"):
        gif[0].save(tmp_path / "frames" / f"{name}.gif", save_all=True, append_images=gif[1:], duration=40, loop=0)
    VideoClips(str(tmp_path / "frames"), num_frames=4, image_size=8)
    assert bars == [(1, True), (3, None)]  # off without files; on a terminal over all 3 videos with 2 files
