"""The end of the image pipeline, run on the batch's device: uint8 -> float, mean/std normalisation, random erasing.

The loader workers decode and augment to uint8 images (timm's ``create_transform(normalize=False)``); a float32
batch would be four times the bytes for the workers to collate, for the pin-memory thread to copy and for the
host-to-device transfer: at batch 128 and 224 px that is 77 MB per batch, which caps a one-GPU run below the rate
the training step itself reaches (docs/performance.md, "Input pipeline", has both rates).  timm's own prefetching loader splits the pipeline the same way.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import torch
from timm.data.random_erasing import RandomErasing


class BatchRandomErasing(RandomErasing):
    """timm's ``RandomErasing`` on a whole batch in a few kernels.

    timm erases image by image: a Python loop over the batch that launches a fill per erased box, on the training
    process's host thread, every step.  Here the boxes are drawn on the host exactly as timm draws them (the same
    calls to the ``random`` module in the same order, so the same boxes for the same random state), sent to the
    device as one small tensor, and applied to the batch with one mask and one ``where`` per box slot.  The fill
    values (``rand``, ``pixel`` modes) are drawn from the device's generator for the whole batch, so they differ
    from timm's draws but not in distribution.
    """

    def boxes(self, batch: int, height: int, width: int) -> torch.Tensor:
        """``[max_count, batch, 4]`` int32 boxes ``(top, left, height, width)``, height 0 where nothing is
        erased; drawn from ``random`` as timm's ``_erase`` draws them, image by image."""
        out = torch.zeros((self.max_count, batch, 4), dtype=torch.int32)
        start = batch // self.num_splits if self.num_splits > 1 else 0
        area = height * width
        for i in range(start, batch):
            if random.random() > self.probability:
                continue
            count = self.min_count if self.min_count == self.max_count else \
                random.randint(self.min_count, self.max_count)
            for slot in range(count):
                for _ in range(10):
                    target_area = random.uniform(self.min_area, self.max_area) * area / count
                    aspect_ratio = math.exp(random.uniform(*self.log_aspect_ratio))
                    h = int(round(math.sqrt(target_area * aspect_ratio)))
                    w = int(round(math.sqrt(target_area / aspect_ratio)))
                    if w < width and h < height:
                        top, left = random.randint(0, height - h), random.randint(0, width - w)
                        out[slot, i] = torch.tensor((top, left, h, w), dtype=torch.int32)
                        break
        return out

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() != 4:
            return super().__call__(input)
        batch, chan, height, width = input.shape
        boxes = self.boxes(batch, height, width)
        slots = [s for s in range(boxes.shape[0]) if bool(boxes[s, :, 2].any())]
        if not slots:
            return input
        boxes = boxes[slots].to(input.device, non_blocking=True).view(len(slots), batch, 4, 1, 1)
        rows = torch.arange(height, device=input.device).view(height, 1)
        cols = torch.arange(width, device=input.device).view(1, width)
        for box in boxes.unbind(0):  # later boxes cover earlier ones, as in timm
            top, left, h, w = box.unbind(1)  # each [B, 1, 1]
            inside = ((rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)).unsqueeze(1)
            if self.per_pixel:
                fill = torch.empty_like(input).normal_()
            elif self.rand_color:
                fill = torch.empty((batch, chan, 1, 1), dtype=input.dtype, device=input.device).normal_()
            else:
                fill = torch.zeros((), dtype=input.dtype, device=input.device)
            input = torch.where(inside, fill, input)
        return input


class DeviceNormalize:
    """``(images / 255 - mean) / std`` for uint8 ``[B, C, H, W]`` batches (the same float32 operations as
    torchvision's ``ToTensor`` + ``Normalize``), then, while training, timm's random erasing on the normalised
    batch (``re_prob`` per image, up to ``re_count`` boxes, ``re_mode`` fill; :class:`BatchRandomErasing`)."""

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
                erase = BatchRandomErasing(self.re_prob, mode=self.re_mode, max_count=self.re_count, device=device)
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
