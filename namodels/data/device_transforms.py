"""The end of the image pipeline, run on the batch's device: uint8 -> float, mean/std normalisation, random erasing.

The loader workers decode and augment to uint8 images (timm's ``create_transform(normalize=False)``); a float32
batch would be four times the bytes for the workers to collate, for the pin-memory thread to copy and for the
host-to-device transfer: at batch 128 and 224 px that is 77 MB per batch, which caps a one-GPU run below what an
H100 trains NAT-Tiny at (docs/performance.md).  timm's own prefetching loader splits the pipeline the same way.
"""
from __future__ import annotations

from typing import Sequence

import torch
from timm.data.random_erasing import RandomErasing


class DeviceNormalize:
    """``(images / 255 - mean) / std`` for uint8 ``[B, C, H, W]`` batches (the same float32 operations as
    torchvision's ``ToTensor`` + ``Normalize``), then, while training, timm's ``RandomErasing`` on the normalised
    batch (``re_prob`` per image, up to ``re_count`` boxes, ``re_mode`` fill)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], re_prob: float = 0.0, re_mode: str = "pixel",
                 re_count: int = 1):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.re_prob, self.re_mode, self.re_count = float(re_prob), re_mode, int(re_count)
        self._on_device: dict[torch.device, tuple] = {}

    def _for(self, device: torch.device) -> tuple:
        """(mean, std, random erasing) on ``device``, made on first use."""
        if device not in self._on_device:
            erase = None
            if self.re_prob > 0:
                erase = RandomErasing(self.re_prob, mode=self.re_mode, max_count=self.re_count, device=device)
            self._on_device[device] = (self.mean.to(device), self.std.to(device), erase)
        return self._on_device[device]

    def __call__(self, images: torch.Tensor, training: bool) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images: expected a uint8 [B, C, H, W] batch, got {images.dtype} "
                             f"{tuple(images.shape)}")
        mean, std, erase = self._for(images.device)
        out = images.float().div_(255.0).sub_(mean).div_(std)
        if training and erase is not None:
            out = erase(out)
        return out
