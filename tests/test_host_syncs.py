"""A training step of the classification recipe never waits for the device.

A GPU step is only fast while the host queues the next step's kernels during the current one; one ``.item()``,
``bool(tensor)`` or ``if tensor.any()`` per step stops the host there until the GPU has caught up, and a step close
to bound by its host (NAT's many small kernels, or a CUDA graph replay) then costs host time plus GPU time.  Those
reads all go through ``aten._local_scalar_dense``, which a dispatch mode sees on CPU as well, so this test counts them
per batch (training and validation) in a run with the recipe's pieces: mixup, clipping with the fused AdamW, step
logging, the progress bar, the learning-rate monitor, the throughput monitor and the training curves.  On a CUDA
machine (``pytest -m gpu tests/test_host_syncs.py``) the same run goes through CUDA's sync debug mode, which also
catches copies to the host.
"""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from namodels.tasks.runner import fit
from tests.test_clipping import fused_adamw  # noqa: F401  (the fixture)
from tests.test_train import compose_cfg

SCALAR_READS = (torch.ops.aten._local_scalar_dense.default,)


class CountScalarReads(TorchDispatchMode):
    """Counts host reads of tensor values by the phase a callback sets (``None``: not counted)."""

    def __init__(self):
        super().__init__()
        self.phase = None
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALAR_READS and self.phase is not None:
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
        return func(*args, **(kwargs or {}))


COUNTER = CountScalarReads()


class BatchPhases(pl.Callback):
    """Puts ``COUNTER``'s phase on ``("train", batch index)`` from a training batch's start to the next one's (what
    Lightning does after the callbacks' batch-end hooks counts too) and on ``("val", batch index)`` over a
    validation batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        COUNTER.phase = ("train", batch_idx)

    def on_train_epoch_end(self, trainer, pl_module):
        COUNTER.phase = None

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        COUNTER.phase = ("val", batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        COUNTER.phase = None


def _fit_counting_reads(cfg) -> dict:
    """``fit(cfg)`` with ``COUNTER`` counting host reads per batch (the config adds ``BatchPhases``)."""
    COUNTER.counts.clear()
    with COUNTER:
        return fit(cfg)


def _assert_reads_only_on_logging_batches(steps: int, log_every: int) -> None:
    """Batches that end a logging window (and the epoch's last) may read the logged values; no other may."""
    logging_batches = {("train", i) for i in range(steps) if (i + 1) % log_every == 0} | {("train", steps - 1)}
    reads = {phase: n for phase, n in COUNTER.counts.items() if phase not in logging_batches}
    assert reads == {}, f"tensor values read on the host during batches ((stage, batch): reads): {reads}"


def test_recipe_steps_read_no_tensor_values(tmp_path, fused_adamw):
    steps, log_every, val_batches = 8, 4, 3
    cfg = compose_cfg("train", [
        "experiment=digits", "threads=1", "logger=csv", f"paths.root_dir={tmp_path}", "export=false",
        "callbacks.model_checkpoint=null", "callbacks.last_checkpoint=null", "callbacks.model_summary=null",
        "callbacks.samples=null", "data.batch_size=16", "data.val_batch_size=16",
        f"trainer.limit_train_batches={steps}", f"trainer.limit_val_batches={val_batches}", "trainer.max_epochs=1",
        f"trainer.log_every_n_steps={log_every}",
        "data.num_workers=1",  # worker processes: the loader's own reads of CPU tensors are not the step's
        "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=1.0", "task.module.scheduler.warmup_epochs=0",
        "task.module.mixup.mixup_alpha=0.8", "task.module.mixup.cutmix_alpha=1.0", "model.drop_path_rate=0.1",
        # the oracle backend: the CPU's own (tiled GEMM) branches on values, which costs nothing on a CPU
        "model.backend=naive",
        "+callbacks.phases._target_=tests.test_host_syncs.BatchPhases"])
    summary = _fit_counting_reads(cfg)
    assert summary["global_step"] == steps
    _assert_reads_only_on_logging_batches(steps, log_every)
    assert "val/top1" in summary["metrics"]


class NoSyncOnQuietBatches(pl.Callback):
    """CUDA's sync debug mode set to raise over the training batches that neither end a logging window nor precede
    one (the learning-rate monitor reads at the start of a logging batch, before this callback's own hook runs),
    and over every batch but the first."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        def logging(i):
            return (i + 1) % trainer.log_every_n_steps == 0 or i + 1 >= trainer.num_training_batches

        quiet = batch_idx > 0 and not logging(batch_idx) and not logging(batch_idx + 1)
        torch.cuda.set_sync_debug_mode("error" if quiet else "default")
        self.quiet_batches = getattr(self, "quiet_batches", 0) + bool(quiet)

    def on_train_epoch_end(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer, pl_module, exception):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recipe_steps_do_not_synchronise_the_gpu(tmp_path):
    """The GPU recipe's combination (bf16-mixed, fused AdamW with clipping, mixup, the fused NA kernels, eager) with
    CUDA's own detector of synchronising calls, which also sees what a CPU run cannot (copies to the host)."""
    steps = 14
    cfg = compose_cfg("train", [
        "experiment=digits", "trainer=gpu", "logger=csv", f"paths.root_dir={tmp_path}", "export=false",
        "callbacks.model_checkpoint=null", "callbacks.last_checkpoint=null", "callbacks.model_summary=null",
        "callbacks.samples=null", "data.batch_size=16", f"trainer.limit_train_batches={steps}",
        "trainer.limit_val_batches=0", "trainer.max_epochs=1", "trainer.log_every_n_steps=6",
        "trainer.gradient_clip_val=1.0", "task.module.scheduler.warmup_epochs=0", "task.module.mixup.mixup_alpha=0.8",
        "task.module.mixup.cutmix_alpha=1.0", "model.drop_path_rate=0.1", "model.backend=fused",
        "+callbacks.no_sync._target_=tests.test_host_syncs.NoSyncOnQuietBatches"])
    watcher = NoSyncOnQuietBatches()
    try:
        with pytest.MonkeyPatch.context() as patch:  # the run's callbacks get this instance
            patch.setattr(f"{__name__}.NoSyncOnQuietBatches", lambda: watcher)
            summary = fit(cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert summary["global_step"] == steps
    assert watcher.quiet_batches == 7  # batches 1-3 and 6-9 (logging ends batches 5, 11 and the last)


def test_gan_steps_read_no_tensor_values(tmp_path, fused_adamw):
    """The GAN task's steps (D, lazy R1, G, EMA, progress counted in kimg) read nothing on the host either, with the
    fused Adam it takes on CUDA."""
    steps, log_every = 7, 3
    cfg = compose_cfg("train", [
        "experiment=stylenat_skimage", "threads=1", "logger=csv", f"paths.root_dir={tmp_path}", "export=false",
        "callbacks.model_checkpoint=null", "data.batch_size=4", "data.num_workers=1",
        f"trainer.limit_train_batches={steps}",
        "trainer.max_epochs=1", f"trainer.log_every_n_steps={log_every}", "task.module.sample_every_n_steps=0",
        "task.module.r1_interval=2", "task.module.d_clip=1.0", "model.backend=naive",
        "+callbacks.phases._target_=tests.test_host_syncs.BatchPhases"])
    summary = _fit_counting_reads(cfg)
    assert summary["global_step"] >= 2 * steps
    _assert_reads_only_on_logging_batches(steps, log_every)


def test_video_steps_read_no_tensor_values(tmp_path, fused_adamw):
    """The video task's training steps (next-frame loss, clipping, the fused AdamW it takes on CUDA) read nothing on
    the host outside logging batches either."""
    steps, log_every = 7, 3
    cfg = compose_cfg("train", [
        "experiment=video_moving_digits", "logger=csv", f"paths.root_dir={tmp_path}", "export=false",
        "callbacks.model_checkpoint=null", "callbacks.model_summary=null", "data.num_workers=1",
        f"trainer.max_steps={steps}", "trainer.val_check_interval=1000", "trainer.limit_val_batches=0",
        f"trainer.log_every_n_steps={log_every}", "model.backend=naive",
        "+callbacks.phases._target_=tests.test_host_syncs.BatchPhases"])
    summary = _fit_counting_reads(cfg)
    assert summary["global_step"] == steps
    _assert_reads_only_on_logging_batches(steps, log_every)
    assert COUNTER.counts  # the logging batches' reads: the counter saw the run
