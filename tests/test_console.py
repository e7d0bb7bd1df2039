"""What the console shows: no Lightning advertisements, no empty FLOP counts, no "Epoch 0/-2", no false sync_dist
warnings, no runpy warning for ``python -m namodels.benchmark.throughput``; the run folder and metrics stay."""
import logging
import os
import subprocess
import sys
import types

import pytest
from namodels.tasks.console import ModelSummary, ProgressBar, drop_lightning_tips

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_lightning_tips_are_dropped_and_other_messages_kept(caplog):
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    drop_lightning_tips()
    drop_lightning_tips()  # idempotent
    with caplog.at_level(logging.INFO):
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        rank_zero_info("💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels]")
        rank_zero_info("GPU available: False, used: False")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["GPU available: False, used: False"]


SUMMARY = [(" ", ["0"]), ("Name", ["model"]), ("Type", ["TinyNAT"]), ("Params", ["108 K"]), ("Mode", ["train"]),
           ("FLOPs", ["0"])]


@pytest.mark.parametrize("flops, shown", [(0, False), (123456, True)])
def test_model_summary_shows_flops_only_when_counted(capsys, flops, shown):
    ModelSummary.summarize(SUMMARY, 108_000, 108_000, 0.436, {"train": 89, "eval": 0}, total_flops=flops)
    out = capsys.readouterr().out
    assert "TinyNAT" in out and "Total params" in out and "108 K" in out
    assert ("FLOPs" in out) is shown


@pytest.mark.parametrize("max_epochs, expected", [(15, "Epoch 3/14"), (-1, "Epoch 3"), (None, "Epoch 3")])
def test_progress_bar_description_has_no_negative_total(max_epochs, expected):
    bar = ProgressBar()
    bar._trainer = types.SimpleNamespace(max_epochs=max_epochs)
    assert bar._get_train_description(3).strip() == expected


@pytest.mark.parametrize("experiment", ["video_moving_digits"])  # (classification: test_ddp_on_cpu_with_two_processes)
def test_ddp_epoch_metrics_raise_no_sync_dist_warning(tmp_path, experiment):
    """Two CPU processes (DDP, gloo): Lightning warns about every epoch-level value logged without sync_dist;
    the tasks' epoch values are synchronised (torchmetrics, merged counts) and declared so."""
    cmd = [sys.executable, "train.py", f"experiment={experiment}", "trainer=ddp_cpu", "trainer.fast_dev_run=true",
           "threads=1", "logger=csv", "callbacks.progress_bar=null", "callbacks.model_summary=null", "export=false",
           f"paths.root_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    assert "sync_dist" not in console, [line for line in console.splitlines() if "sync_dist" in line]


def test_train_console_is_quiet_and_keeps_what_matters(tmp_path):
    """A short train.py with the default callbacks (progress bar, model summary) and loggers."""
    cmd = [sys.executable, "train.py", "threads=1", f"paths.root_dir={tmp_path}", "trainer.max_epochs=2",
           "trainer.limit_train_batches=3", "trainer.limit_val_batches=2", "data.batch_size=16",
           "task.module.scheduler.warmup_epochs=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    for noise in ("💡", "litlogger", "litmodels", "Total FLOPs", "FLOPs", "/-2", "sync_dist"):
        assert noise not in console, noise
    run_folder = os.path.join(str(tmp_path), "logs", "classification", "nat_digits-digits", "version_0")
    for kept in (f"output: {run_folder}", "Trainable params", "Epoch 1/1", "final val/top1",
                 "best val/top1", f"last checkpoint: {run_folder}"):
        assert kept in console, kept


def test_benchmark_module_runs_without_runpy_warning():
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "namodels.benchmark.throughput",
                           "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "RuntimeWarning" not in proc.stderr, proc.stderr[-2000:]
    import namodels.benchmark as bench

    assert callable(bench.measure_throughput) and bench.TimingSettings is not None  # lazy names still resolve


class _TinyRegression:
    """A one-layer LightningModule on random data, built inside the test (Lightning imported lazily)."""

    @staticmethod
    def build():
        import lightning.pytorch as pl
        import torch

        class Tiny(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = torch.nn.functional.mse_loss(self.layer(x), y)
                self.log("train/loss_step", loss, on_step=True, on_epoch=False)  # as the tasks log it
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        data = torch.utils.data.TensorDataset(torch.randn(50, 4), torch.randn(50, 1))
        return Tiny(), torch.utils.data.DataLoader(data, batch_size=2)


def test_throughput_and_progress_bar_read_the_device_every_n_batches(tmp_path, monkeypatch):
    """The throughput monitor synchronises and reads its clock every log_every_n_steps training batches (25 batches,
    every 5: 5 readings) yet counts every sample; the progress bar reads the logged metrics (a GPU wait for a loss
    logged as a device tensor) on those batches and at the epoch's end only, and still shows the step loss, which
    is logged without prog_bar (Lightning would turn it into a number after every batch)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from namodels.tasks.throughput_monitor import ThroughputMonitor

    model, loader = _TinyRegression.build()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], window_size=3)
    bar = ProgressBar()
    reads = []
    get_metrics = ProgressBar.get_metrics
    monkeypatch.setattr(ProgressBar, "get_metrics", lambda self, *a: reads.append(1) or get_metrics(self, *a))
    trainer = pl.Trainer(max_epochs=1, log_every_n_steps=5, callbacks=[monitor, bar], logger=CSVLogger(tmp_path),
                         enable_checkpointing=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(model, loader)
    assert monitor.clock_readings == 5
    assert monitor._samples[pl.trainer.states.RunningStage.TRAINING] == 50
    logged = trainer.logged_metrics
    assert logged["train/samples"] == 50 and logged["train/batches"] == 25  # the last reading saw every batch
    assert logged["train/device/samples_per_sec"] > 0
    assert 5 <= len(reads) <= 8  # every 5th batch and the epoch's end (not 25)
    assert "train/loss_step" in bar.get_metrics(trainer, model)
    with pytest.raises(ValueError, match="every_n_batches"):
        ThroughputMonitor(batch_size_fn=len, every_n_batches=0)
    with pytest.raises(ValueError, match="metrics_every_n_batches"):
        ProgressBar(metrics_every_n_batches=0)
    with pytest.raises(ValueError, match="step_metrics"):
        ProgressBar(step_metrics="train/loss_step")
