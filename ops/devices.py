"""Facts about the CUDA device a launch runs on, read once per device."""
from __future__ import annotations

import functools

import torch


@functools.cache
def multiprocessors(device: torch.device | int) -> int:
    """The device's streaming multiprocessors: how many programs that each fill an SM run at once."""
    return torch.cuda.get_device_properties(device).multi_processor_count
