"""Lightning's ``ThroughputMonitor`` without a device synchronisation after every training batch.

Lightning's monitor synchronises the GPU after each batch so that its clock reads the end of that batch's work.
That also stops the host from queueing the next step while the GPU finishes the last one: a model whose step is
close to bound by its host (NAT's 30 blocks of small kernels, eager or compiled) then loses the overlap in every run
that reports its throughput.  This monitor counts every training batch but synchronises and reads the clock only on
the batches Lightning logs the rates on (its global step a multiple of ``log_every_n_steps``, or the run stopping),
or, with ``every_n_batches``, on every n-th batch of the run; the rates it logs are averages over its window as
before.  Both count from the run's start, not from a restart, so a resumed run (whose first logging step may come
after any number of batches) has a fresh reading whenever Lightning logs, and no logging step finds an empty
window.  Validation, test and predict batches are clocked one by one as in Lightning (the monitor subtracts
validation time from the training clock).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage


class ThroughputMonitor(LightningThroughputMonitor):
    """``lightning.pytorch.callbacks.ThroughputMonitor`` (same arguments) plus ``every_n_batches``: training batches
    between two synchronised clock readings, counted from the run's first batch (None: on the batches Lightning
    logs on, every ``log_every_n_steps`` global steps).  Training rates are logged only on batches that read the
    clock."""

    def __init__(self, batch_size_fn: Callable[[Any], int], length_fn: Optional[Callable[[Any], int]] = None,
                 every_n_batches: int | None = None, **kwargs: Any) -> None:
        super().__init__(batch_size_fn, length_fn, **kwargs)
        if every_n_batches is not None and int(every_n_batches) < 1:
            raise ValueError(f"every_n_batches: must be >= 1 or None, got {every_n_batches!r}")
        self.every_n_batches = every_n_batches
        self.clock_readings = 0  # synchronised readings of the training clock (what the tests count)
        self._read_this_batch = False  # whether the current training batch read the clock (what _compute logs)

    def _reads_clock(self, trainer, iter_num: int) -> bool:
        """Whether the training batch ``iter_num`` (1-based over the whole run, restored on resume) reads the clock.

        Lightning logs on the batches whose global step (``_batches_that_stepped + 1``) is a multiple of
        ``log_every_n_steps``, or when the run stops, and not while gradients accumulate; a count of batches
        since the monitor started would miss those steps after a resume."""
        if self.every_n_batches is not None:
            return iter_num % int(self.every_n_batches) == 0
        return trainer._logger_connector.should_update_logs and not trainer.fit_loop._should_accumulate()

    @torch.inference_mode()  # as Lightning's: a batch_size_fn or length_fn must not record autograd history
    def _update(self, trainer, pl_module, batch: Any, iter_num: int) -> None:
        stage = trainer.state.stage
        if stage != RunningStage.TRAINING:
            super()._update(trainer, pl_module, batch, iter_num)
            return
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        if self.length_fn is not None:
            self._lengths[stage] += self.length_fn(batch)
        self._read_this_batch = self._reads_clock(trainer, iter_num)
        if not self._read_this_batch:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self.clock_readings += 1
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage], batches=self._batches[stage], samples=self._samples[stage],
            lengths=None if self.length_fn is None else self._lengths[stage],
            flops=getattr(pl_module, "flops_per_batch", None),
        )

    def _compute(self, trainer, iter_num: Optional[int] = None) -> None:
        # training rates are logged from a reading of this batch only: an older one would be logged as if current,
        # and there is none at all before the first reading of a (resumed) run
        if trainer.state.stage == RunningStage.TRAINING and not self._read_this_batch:
            return
        super()._compute(trainer, iter_num)
