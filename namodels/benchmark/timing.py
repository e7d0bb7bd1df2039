"""Timing primitives: precision settings, step timing with CUDA events, batch-size decay on OOM.

The step timer itself (:class:`TimingSettings`, :func:`time_steps`, :func:`synchronize`,
:func:`median_ms`) lives in :mod:`ops.timing` and is re-exported here, so the throughput benchmark, the
generator's :func:`~namodels.tasks.generate.images_per_second` and ``ops.gemm.bench`` all time with one
function: untimed warm-up, then each step timed with CUDA events on a GPU or ``perf_counter`` on a CPU,
synchronised one at a time, garbage collector paused.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from typing import Callable

import torch
from timm.utils import check_batch_size_retry, decay_batch_step

from ops.timing import TimingSettings, cuda_profile, median_ms, synchronize, time_steps

log = logging.getLogger(__name__)

__all__ = [
    "PRECISIONS", "TimingSettings", "autocast", "check_precision", "cuda_context_ok", "free_memory", "gpu_time_ms",
    "is_oom", "median_ms", "peak_memory", "synchronize", "tf32_mode", "time_steps", "with_batch_decay",
]

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


def gpu_time_ms(step: Callable[[], object], device: torch.device, steps: int = 3) -> float | None:
    """GPU time per call of ``step``: the summed durations of the kernels, copies and fills the CUDA
    profiler records over ``steps`` calls (kernels inside CUDA graphs included), divided by ``steps``.
    Beside the wall-clock step time it tells a host-bound step (wall well above GPU time) from a
    GPU-bound one.  None on devices other than CUDA."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType

    synchronize(device)
    with cuda_profile() as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    device_us = sum(e.self_device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return device_us / 1e3 / steps


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
