"""Facts about the CUDA device a launch runs on, read once per device."""
from __future__ import annotations

import functools

import torch


def multiprocessors(device: torch.device | str | int) -> int:
    """The device's streaming multiprocessors: how many programs that each fill an SM run at once.  A device without
    an index (``"cuda"``) is the current one, looked up on every call, so the count cached is always that device's."""
    device = torch.device(device)
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
