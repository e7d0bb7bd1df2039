"""Step timer shared by the project's benchmarks (torch only).

:func:`time_steps` runs ``step`` untimed ``settings.warmup`` times, then times up to ``settings.iters``
samples of ``settings.back_to_back`` calls each (one by default): CUDA events on a CUDA device,
``time.perf_counter`` elsewhere, each sample synchronised before the next starts, Python's garbage
collector paused.  Used by the model throughput
benchmark (through :mod:`namodels.benchmark.timing`), the generator's images-per-second and
``ops.gemm.bench``::

    >>> import torch
    >>> from ops.timing import TimingSettings, median_ms, time_steps
    >>> times = time_steps(lambda: torch.ones(8).sum(), "cpu", TimingSettings(warmup=1, iters=3))
    >>> len(times), median_ms(times) >= 0
    (3, True)

It times whole steps as they run in a workload, caches warm.  ``ops.bench`` times single kernels with
``triton.testing.do_bench`` instead, which clears the L2 cache before every call so that a kernel does
not read the previous call's inputs from L2.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["TimingSettings", "median_ms", "synchronize", "time_steps"]


@dataclass
class TimingSettings:
    """Warm-up steps (untimed; the first includes compilation), timed steps, and caps in seconds of
    wall time on each (``min_iters`` timed steps always run, and every warm-up step up to the first
    past ``warmup_cap_s``; ``warmup=0`` times from the first call, for a call too slow to repeat).

    ``back_to_back``: steps per timed sample, run back to back with one synchronisation after the last, as a
    training loop runs them (the host queues the next step while the device finishes the last); a sample's time is
    divided by it.  1 (the default) times each step alone, host latency included in full.

    ``keep_gc``: leave Python's garbage collector on during the timed steps.  Off by default, as in
    ``timeit``: a full collection in a long benchmark process (many models built and dropped) can
    land inside a step and add milliseconds to whichever row happens to be timed then.
    """

    warmup: int = 3
    iters: int = 20
    min_iters: int = 1
    cap_s: float = 10.0
    warmup_cap_s: float = 30.0
    keep_gc: bool = False
    back_to_back: int = 1

    def __post_init__(self):
        if int(self.warmup) < 0:
            raise ValueError(f"warmup: must be >= 0, got {self.warmup}")
        for name in ("iters", "min_iters", "back_to_back"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.min_iters > self.iters:
            raise ValueError(f"min_iters: must be <= iters ({self.iters}), got {self.min_iters}")
        for name in ("cap_s", "warmup_cap_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


def synchronize(device: torch.device | str) -> None:
    """Waits for the queued work of a CUDA device; nothing on other devices."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], object], device: torch.device | str, settings: TimingSettings) -> list[float]:
    """Milliseconds of each timed call of ``step`` (CUDA events on GPU, perf_counter on CPU), after
    warm-up.  Each step is synchronised before the next starts, so the caps can be checked."""
    device = torch.device(device)
    started = time.perf_counter()
    for _ in range(settings.warmup):
        step()
        synchronize(device)
        if time.perf_counter() - started > settings.warmup_cap_s:
            break
    gc_was_enabled = gc.isenabled()
    if not settings.keep_gc:
        gc.collect()
        gc.disable()
    try:
        return _timed_loop(step, device, settings)
    finally:
        if gc_was_enabled:
            gc.enable()


def _timed_loop(step, device: torch.device, settings: TimingSettings) -> list[float]:
    times: list[float] = []
    steps = settings.back_to_back
    started = time.perf_counter()
    for i in range(settings.iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(steps):
                step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
        if i + 1 >= settings.min_iters and time.perf_counter() - started > settings.cap_s:
            break
    return times


def median_ms(times: list[float]) -> float:
    """Median of :func:`time_steps`' milliseconds, as a float."""
    return float(statistics.median(times))


def cuda_profile():
    """``torch.profiler.profile`` over CUDA activity that detaches CUPTI when it stops.

    Unless ``TEARDOWN_CUPTI=1``, Kineto leaves CUPTI attached after a profile, and every later kernel launch pays for
    its callbacks: a benchmark that profiles one row's GPU time slows the host side of every row timed after it, the
    host-bound ones most (docs/performance.md).  A value already in the environment is kept."""
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA])
