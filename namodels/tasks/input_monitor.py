"""Says when a training run is input-bound: the share of its time the training loop spends waiting for batches.

The host queues a step's GPU work and comes back for the next batch long before the GPU has finished, so the time
between the end of one training batch and the moment the loader hands over the next is the time spent waiting for
input; while the input pipeline keeps up it is close to nothing.  The hand-over is stamped by a data module that
sets ``batch_fetched_at`` (:class:`~namodels.data.datamodule.ClassificationDataModule` does, in
``on_before_batch_transfer``): the transfer and device transforms after it are the step's work, not input waits,
and they can block the host on a full launch queue.  Without the stamp the whole gap counts.  Every ``every_n_batches`` batches this callback logs that share
(``train/input_wait``) and, the first time in an epoch it passes ``threshold``, warns with the pipeline and the
worker count, the two settings that change it.
"""
from __future__ import annotations

import logging
import time

from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)


class InputWaitMonitor(Callback):
    def __init__(self, threshold: float = 0.1, every_n_batches: int = 50):
        if not 0 < float(threshold) < 1:
            raise ValueError(f"threshold: expected a fraction in (0, 1), got {threshold!r}")
        if int(every_n_batches) < 1:
            raise ValueError(f"every_n_batches: expected an integer >= 1, got {every_n_batches!r}")
        self.threshold, self.every_n_batches = float(threshold), int(every_n_batches)
        self._last_end: float | None = None
        self._window_start = self._waited = 0.0
        self._batches = 0
        self._warned_epoch = -1
        self.last_fraction: float | None = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._last_end, self._batches, self._waited = None, 0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last_end is None:  # the epoch's first batch: worker start-up is not a steady-state wait
            self._window_start = now
            return
        fetched = getattr(getattr(trainer, "datamodule", None), "batch_fetched_at", None)
        handed_over = fetched if isinstance(fetched, float) and self._last_end <= fetched <= now else now
        self._waited += handed_over - self._last_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._last_end = now
        self._batches += 1
        if self._batches % self.every_n_batches:
            return
        fraction = self._waited / max(now - self._window_start, 1e-9)
        self.last_fraction = fraction
        pl_module.log("train/input_wait", fraction, on_step=True, on_epoch=False, batch_size=1)
        if fraction > self.threshold and self._warned_epoch != trainer.current_epoch:
            self._warned_epoch = trainer.current_epoch
            log.warning("input-bound: training waited for its input %.0f%% of the last %d batches (%s); %s",
                        100 * fraction, self.every_n_batches, *_describe(trainer))
        self._window_start, self._waited = now, 0.0


def _describe(trainer) -> tuple[str, str]:
    """``(the data settings that change the wait, which of them to raise)``."""
    dm = getattr(trainer, "datamodule", None)
    cfg = getattr(dm, "cfg", None)
    advice = "the GPU input pipeline (data.pipeline=gpu) or more loader workers (data.num_workers) would feed it faster"
    if not isinstance(cfg, dict):
        return "no data module settings", advice
    pipeline = dm.pipeline() if hasattr(dm, "pipeline") else "cpu"
    if pipeline == "gpu":
        gpu = cfg.get("gpu") or {}
        settings = f"data.pipeline resolved to gpu, data.gpu.launcher={gpu.get('launcher')}, " \
                   f"data.gpu.workers={gpu.get('workers')}"
        if gpu.get("launcher") == "workers":
            return settings, "more GPU loader processes (data.gpu.workers) would feed it faster"
        return settings, ("more file-reading loader workers (data.gpu.workers) or more batches prepared ahead "
                          "(data.gpu.prefetch) would feed it faster")
    return f"data.pipeline resolved to {pipeline}, data.num_workers={cfg.get('num_workers', 0)}", advice
