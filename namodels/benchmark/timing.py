"""Timing primitives: precision settings, step timing with CUDA events, batch-size decay on OOM.

:func:`time_steps` is the project's one step timer (the throughput benchmark, the generator's
:func:`~namodels.tasks.generate.images_per_second`): untimed warm-up, then each step timed with CUDA
events on a GPU or ``perf_counter`` on a CPU, synchronised one at a time, garbage collector paused.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from timm.utils import check_batch_size_retry, decay_batch_step

log = logging.getLogger(__name__)

# name -> (autocast dtype or None, TF32 matmuls/convs allowed)
PRECISIONS: dict[str, tuple[torch.dtype | None, bool]] = {
    "fp32": (None, False),            # strict float32: TF32 off for matmuls and cuDNN convs
    "tf32": (None, True),             # float32 weights and activations, TF32 tensor cores
    "fp16": (torch.float16, False),   # autocast float16 (training: GradScaler), float32 weights
    "bf16": (torch.bfloat16, False),  # autocast bfloat16, float32 weights
}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {list(PRECISIONS)}, got {precision!r}")
    return precision


@contextlib.contextmanager
def tf32_mode(enabled: bool):
    """Sets TF32 for CUDA matmuls and cuDNN convolutions, restores the previous flags on exit."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def autocast(precision: str, device: torch.device):
    dtype, _ = PRECISIONS[check_precision(precision)]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def is_oom(err: BaseException) -> bool:
    """Out of memory, and worth retrying with a smaller batch (not an illegal access, which leaves the
    CUDA context unusable, nor a channels-last rank error)."""
    if isinstance(err, torch.OutOfMemoryError):
        return check_batch_size_retry(str(err))
    message = str(err).lower()
    return isinstance(err, RuntimeError) and "out of memory" in message and check_batch_size_retry(message)


def free_memory() -> None:
    """Collects garbage and returns cached CUDA blocks; never raises (the CUDA context may be dead)."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001  (e.g. after an illegal memory access: reported by cuda_context_ok)
            pass


def with_batch_decay(run: Callable[[int], dict], batch_size: int, *, min_batch_size: int = 1):
    """``run(batch_size)``, retried with timm's ``decay_batch_step`` (128, 96, 64, 48, 32, ...) while it
    runs out of memory.  Returns ``(result, batch_size_used)``; re-raises other errors, and the OOM once
    the batch would go below ``min_batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    while True:
        try:
            return run(batch_size), batch_size
        except Exception as err:  # noqa: BLE001  (filtered right below)
            if not is_oom(err):
                raise
            smaller = decay_batch_step(batch_size)
            log.warning("out of memory at batch %d; %s", batch_size,
                        f"retrying at {smaller}" if smaller >= min_batch_size else "giving up")
            del err
            free_memory()
            if smaller < min_batch_size:
                raise
            batch_size = smaller


@dataclass
class TimingSettings:
    """Warm-up steps (untimed; the first includes compilation), timed steps, and caps in seconds of
    wall time on each (``min_iters`` timed steps always run, and every warm-up step up to the first
    past ``warmup_cap_s``; ``warmup=0`` times from the first call, for a call too slow to repeat).

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

    def __post_init__(self):
        if int(self.warmup) < 0:
            raise ValueError(f"warmup: must be >= 0, got {self.warmup}")
        for name in ("iters", "min_iters"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.min_iters > self.iters:
            raise ValueError(f"min_iters: must be <= iters ({self.iters}), got {self.min_iters}")
        for name in ("cap_s", "warmup_cap_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], object], device: torch.device, settings: TimingSettings) -> list[float]:
    """Milliseconds of each timed call of ``step`` (CUDA events on GPU, perf_counter on CPU), after
    warm-up.  Each step is synchronised before the next starts, so the caps can be checked."""
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


def _timed_loop(step, device, settings: TimingSettings) -> list[float]:
    times: list[float] = []
    started = time.perf_counter()
    for i in range(settings.iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        if i + 1 >= settings.min_iters and time.perf_counter() - started > settings.cap_s:
            break
    return times


def gpu_time_ms(step: Callable[[], object], device: torch.device, steps: int = 3) -> float | None:
    """GPU time per call of ``step``: the summed durations of the kernels, copies and fills the CUDA
    profiler records over ``steps`` calls (kernels inside CUDA graphs included), divided by ``steps``.
    Beside the wall-clock step time it tells a host-bound step (wall well above GPU time) from a
    GPU-bound one.  None on devices other than CUDA."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    device_us = sum(e.self_device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return device_us / 1e3 / steps


def median_ms(times: list[float]) -> float:
    return float(statistics.median(times))


@contextlib.contextmanager
def peak_memory(device: torch.device):
    """Yields a dict whose ``'mib'`` holds the peak allocated CUDA memory of the block (None on CPU)."""
    result = {"mib": None}
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield result
    if device.type == "cuda":
        synchronize(device)
        result["mib"] = torch.cuda.max_memory_allocated(device) / 2**20


def cuda_context_ok(device: torch.device) -> bool:
    """False once the CUDA context is unusable (e.g. after an illegal memory access)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False
