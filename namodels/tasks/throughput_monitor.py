"""Lightning's ``ThroughputMonitor`` without a device synchronisation after every training batch.

Lightning's monitor synchronises the GPU after each batch so that its clock reads the end of that batch's work.
That also stops the host from queueing the next step while the GPU finishes the last one: a model whose step is
close to bound by its host (NAT's 30 blocks of small kernels, eager or compiled) then loses the overlap in every run
that reports its throughput.  This monitor counts every training batch but synchronises and reads the clock only
every ``every_n_batches`` batches (default: the trainer's ``log_every_n_steps``, the steps it logs on anyway); the
rates it logs are averages over its window as before.  Validation, test and predict batches are clocked one by one
as in Lightning (the monitor subtracts validation time from the training clock).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage


class ThroughputMonitor(LightningThroughputMonitor):
    """``lightning.pytorch.callbacks.ThroughputMonitor`` (same arguments) plus ``every_n_batches``: training batches
    between two synchronised clock readings (None: the trainer's ``log_every_n_steps``)."""

    def __init__(self, batch_size_fn: Callable[[Any], int], length_fn: Optional[Callable[[Any], int]] = None,
                 every_n_batches: int | None = None, **kwargs: Any) -> None:
        super().__init__(batch_size_fn, length_fn, **kwargs)
        if every_n_batches is not None and int(every_n_batches) < 1:
            raise ValueError(f"every_n_batches: must be >= 1 or None, got {every_n_batches!r}")
        self.every_n_batches = every_n_batches
        self.clock_readings = 0  # synchronised readings of the training clock (what the tests count)

    def _clock_every(self, trainer) -> int:
        return int(self.every_n_batches or trainer.log_every_n_steps or 1)

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
        if self._batches[stage] % self._clock_every(trainer):
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self.clock_readings += 1
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage], batches=self._batches[stage], samples=self._samples[stage],
            lengths=None if self.length_fn is None else self._lengths[stage],
            flops=getattr(pl_module, "flops_per_batch", None),
        )
