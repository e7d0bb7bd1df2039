"""Training-curve PNG (namodels.tasks.curves), sample-image figures and their TensorBoard / run-folder
outputs (namodels.tasks.samples), atomic figure writes (namodels.utils.figures)."""
from __future__ import annotations

import glob
import os

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image

from namodels.tasks.curves import TrainingCurves, draw_curves, metric_panels, plot_curves, smoothed
from namodels.tasks.samples import SampleImages, frame_strip, labelled_grid
from namodels.utils.figures import figure_to_array, new_figure, save_figure


class TinyRegression(pl.LightningModule):
    """Logs what the tasks log: train/loss per step and epoch, val/loss and val/top1 per validation, a
    stepped learning-rate schedule."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.val_losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.val_losses.append(float(loss))
        self.log("val/loss", loss)
        self.log("val/top1", 50.0 + batch_idx)
        self.log("val/skipped_images", 0.0)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _trainer(tmp_path, callbacks, **kwargs):
    settings = dict(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu")
    return pl.Trainer(**{**settings, **kwargs}, default_root_dir=str(tmp_path), callbacks=callbacks)


def test_curves_collect_what_the_run_logs_and_write_a_png(tmp_path):
    curves = TrainingCurves(str(tmp_path / "run"), title="tiny", every_n_steps=1)
    trainer = _trainer(tmp_path, [curves], limit_train_batches=6, limit_val_batches=2)
    trainer.fit(TinyRegression(), _loader(), _loader(8, seed=1))
    s = curves.series
    assert [p[0] for p in s["train/loss"]] == list(range(1, 13))        # every optimizer step
    lrs = [p[1] for p in s["lr"]]                                          # StepLR: halves every 3 steps
    assert lrs[0] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1 * 0.5 ** 4) and min(lrs) < max(lrs)
    assert [p[0] for p in s["val/loss"]] == [6, 12] and [p[0] for p in s["train/loss (epoch mean)"]] == [6, 12]
    assert s["val/top1"][0][1] == pytest.approx(50.5)                      # the epoch mean Lightning logged
    first_epoch = np.mean([p[1] for p in s["train/loss"][:6]])
    assert s["train/loss (epoch mean)"][0][1] == pytest.approx(first_epoch)
    assert "val/skipped_images" not in s
    image = Image.open(tmp_path / "run" / "curves.png")
    assert image.format == "PNG" and image.size[0] > 500
    assert not glob.glob(str(tmp_path / "run" / ".*.partial"))             # written through a temporary file


def test_curves_refresh_at_each_validation_and_resume_from_state(tmp_path):
    curves = TrainingCurves(str(tmp_path), filename="c.png")
    trainer = _trainer(tmp_path, [curves], max_epochs=1, limit_train_batches=4, limit_val_batches=1,
                       val_check_interval=2)
    trainer.fit(TinyRegression(), _loader(), _loader(8, seed=1))
    assert [p[0] for p in curves.series["val/loss"]] == [2, 4]
    state = curves.state_dict()
    torch.save(state, tmp_path / "state.pt")                               # plain data: a weights_only load
    restored = TrainingCurves(str(tmp_path))
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert restored.series == curves.series and restored.epochs_done == 1


def test_curves_thin_long_runs_to_bounded_points(tmp_path):
    curves = TrainingCurves(str(tmp_path), max_points=5, every_validation=False, every_n_steps=1)
    trainer = _trainer(tmp_path, [curves], max_epochs=1, limit_train_batches=10, limit_val_batches=0)
    trainer.fit(TinyRegression(), _loader())
    steps = [p[0] for p in curves.series["train/loss"]]
    assert curves.stride == 2 and steps == [2, 4, 6, 8, 10] and len(curves.series["lr"]) == 5


def test_curves_record_on_logging_steps_with_epoch_means_over_every_step(tmp_path):
    """Recorded points follow the trainer's log_every_n_steps (reading a GPU loss waits for the GPU); the epoch
    mean is still that of every step's loss, summed where the loss lives."""
    curves = TrainingCurves(str(tmp_path), every_validation=False)
    module = TinyRegression()
    losses = []
    training_step = module.training_step
    module.training_step = lambda batch, batch_idx: losses.append(float(out := training_step(batch, batch_idx))) or out
    trainer = _trainer(tmp_path, [curves], max_epochs=1, limit_train_batches=10, limit_val_batches=0,
                       log_every_n_steps=3)
    trainer.fit(module, _loader())
    assert [p[0] for p in curves.series["train/loss"]] == [3, 6, 9]
    assert [p[0] for p in curves.series["lr"]] == [3, 6, 9]
    assert [p[1] for p in curves.series["train/loss"]] == pytest.approx([losses[2], losses[5], losses[8]])
    (epoch_mean,) = curves.series["train/loss (epoch mean)"]
    assert epoch_mean == [10, pytest.approx(np.mean(losses))]
    with pytest.raises(ValueError, match="every_n_steps"):
        TrainingCurves(str(tmp_path), every_n_steps=0)


def test_metric_panels_group_by_kind():
    names = ["train/loss", "train/loss (epoch mean)", "lr", "val/loss", "val_ema/loss", "val/top1", "val_ema/top1",
             "val/top5", "val/mse", "val/copy_mse", "val/rollout_mse", "val/psnr", "val/rollout_psnr", "val/mse_ratio"]
    assert metric_panels(names) == {
        "loss": ["train/loss", "train/loss (epoch mean)", "val/loss", "val_ema/loss"], "learning rate": ["lr"],
        "top1": ["val/top1", "val_ema/top1"], "top5": ["val/top5"], "mse": ["val/mse", "val/copy_mse", "val/rollout_mse"],
        "psnr": ["val/psnr", "val/rollout_psnr"], "ratio": ["val/mse_ratio"]}


def test_draw_curves_panels_lines_and_scales(tmp_path):
    steps = np.arange(1, 101)
    series = {"train/loss": [[int(s), float(2.0 / s)] for s in steps], "lr": [[int(s), 1e-3 * 0.95 ** s] for s in steps],
              "val/top1": [[50, 40.0], [100, 90.0]], "val/loss": [[50, 0.5], [100, 0.2]]}
    fig = draw_curves(series, title="run")
    visible = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(visible) == {"loss", "learning rate", "top1 (%)"}
    loss = visible["loss"]
    labels = [line.get_label() for line in loss.get_lines()]
    assert "train/loss (smoothed)" in labels and "val/loss" in labels and loss.get_yscale() == "log"  # 2.0 .. 0.02
    assert visible["top1 (%)"].get_yscale() == "linear"
    np.testing.assert_allclose(visible["top1 (%)"].get_lines()[0].get_ydata(), [40.0, 90.0])
    lr_line = visible["learning rate"].get_lines()[0]
    np.testing.assert_allclose(lr_line.get_ydata(), [v for _, v in series["lr"]])  # drawn as it is, not smoothed
    path = plot_curves(series, str(tmp_path / "sub" / "curves.png"))
    assert Image.open(path).size == tuple(figure_to_array(fig).shape[1::-1])


def test_smoothing_follows_a_constant_and_a_trend():
    np.testing.assert_allclose(smoothed(np.full(50, 3.0)), 3.0)
    ramp = smoothed(np.arange(200, dtype=float))
    assert np.all(np.diff(ramp) > 0) and ramp[-1] < 199


def test_save_figure_is_atomic(tmp_path, monkeypatch):
    fig = new_figure(2, 2)
    fig.add_subplot().plot([0, 1], [1, 0])
    target = tmp_path / "a.png"
    target.write_bytes(b"previous")

    def broken(self, f, **kwargs):
        f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(type(fig), "savefig", broken)
    with pytest.raises(OSError):
        save_figure(fig, str(target))
    assert target.read_bytes() == b"previous" and os.listdir(tmp_path) == ["a.png"]  # no leftover, old file whole
    monkeypatch.undo()
    save_figure(fig, str(target))
    assert Image.open(target).format == "PNG"


def test_labelled_grid_titles_predicted_and_true():
    images = torch.rand(5, 1, 8, 8)
    fig = labelled_grid(images, predicted=[1, 2, 3, 4, 0], true=[1, 2, 0, 4, 0], class_names=list("abcde"))
    titles = [(ax.get_title(), ax.title.get_color()) for ax in fig.axes if ax.get_title()]
    assert [t for t, _ in titles] == ["b / b", "c / c", "d / a", "e / e", "a / a"]
    assert titles[2][1] == "tab:red" and titles[0][1] == "tab:green"
    assert "4 of 5 right" in fig.get_suptitle()


def test_frame_strip_rows_and_shape_check():
    true, predicted = torch.rand(2, 6, 1, 8, 8), torch.rand(2, 4, 1, 8, 8)
    fig = frame_strip(true, predicted, context=2)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["clip 0 true", "clip 0 predicted", "clip 1 true",
                                                            "clip 1 predicted"]
    image = ax.get_images()[0].get_array()
    assert image.shape[:2] == (2 + 4 * 10, 2 + 6 * 10)                    # make_grid, padding 2
    # the predicted row holds the context frames, then the prediction
    np.testing.assert_allclose(image[12:20, 2:10, 0], true[0, 0, 0].numpy(), atol=1e-6)      # row 1, frame 0
    np.testing.assert_allclose(image[12:20, 22:30, 0], predicted[0, 0, 0].numpy(), atol=1e-6)  # row 1, frame 2
    with pytest.raises(ValueError, match="predicted"):
        frame_strip(true, predicted[:, :3], context=2)


class _WithSamples(TinyRegression):
    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        return batch[0].sum(1)

    def sample_figures(self, batch, outputs=None):
        self.calls.append((batch[0].shape[0], outputs is not None))
        fig = new_figure(2, 2)
        fig.add_subplot().imshow(batch[0].numpy())
        return {"grid": fig}


def test_sample_images_tensorboard_each_validation_and_png_at_the_end(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    module = _WithSamples()
    module.calls = []
    samples = SampleImages(str(tmp_path / "run"), num_samples=3)
    trainer = _trainer(tmp_path, [samples], limit_train_batches=2, limit_val_batches=2,
                       logger=TensorBoardLogger(str(tmp_path), name="tb"))
    trainer.fit(module, _loader(), _loader(8, seed=1))
    # one figure per validation from the first batch (3 items, its validation outputs), then one at the end
    assert module.calls == [(3, True), (3, True), (3, True)]
    events = EventAccumulator(glob.glob(str(tmp_path / "tb" / "version_0"))[0], size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("val/grid")] == [2, 4]
    assert Image.open(tmp_path / "run" / "grid.png").format == "PNG"


def test_sample_images_without_tensorboard_draw_only_at_the_end(tmp_path):
    module = _WithSamples()
    module.calls = []
    trainer = _trainer(tmp_path, [SampleImages(str(tmp_path), num_samples=2)], limit_train_batches=2,
                       limit_val_batches=1)
    trainer.fit(module, _loader(), _loader(8, seed=1))
    assert module.calls == [(2, True)] and os.path.isfile(tmp_path / "grid.png")


def test_digits_run_writes_curves_predictions_and_tensorboard_images(tmp_path):
    """train.py's default callbacks on a short digits run with the TensorBoard logger."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from namodels.tasks.runner import fit

    GlobalHydra.instance().clear()
    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "experiment=digits", "threads=1", "logger=tensorboard", "callbacks.progress_bar=null",
            "callbacks.model_summary=null", "data.batch_size=16", "trainer.limit_train_batches=3",
            "trainer.limit_val_batches=1", "trainer.max_epochs=2", "task.module.scheduler.warmup_epochs=0",
            f"paths.root_dir={tmp_path}", "export=false"])
    fit(cfg)
    run = cfg.paths.output_dir
    assert Image.open(os.path.join(run, "curves.png")).format == "PNG"
    assert Image.open(os.path.join(run, "predictions.png")).format == "PNG"
    events = EventAccumulator(glob.glob(os.path.join(run, "tensorboard", "version_0"))[0], size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("val/predictions")] == [3, 6]
