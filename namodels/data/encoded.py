"""The loader workers' half of the GPU input pipeline: read encoded files, decide nothing that needs pixels.

A worker reads a file's bytes and its header (size, format, mode: PIL parses only the header), and for training
draws the sample's RandomResizedCrop box and interpolation with timm's own ``get_params`` (so the crop distribution
is timm's by construction).  JPEGs in RGB or greyscale travel as bytes and are decoded on the GPU; anything a GPU
JPEG decoder does not take (PNG, GIF, WebP, CMYK or YCCK JPEGs, 16-bit images) is decoded here, on the CPU, through
:func:`~namodels.data.decoding.open_rgb` as the CPU pipeline does, and travels as pixels.  A file that cannot be read
or parsed comes back as :class:`~namodels.data.decoding.Unreadable` and is skipped and counted as in the CPU
pipeline.
"""
from __future__ import annotations

import io
import logging
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torch.utils.data import Dataset

from .decoding import DECODE_ERRORS, Unreadable, UnreadableImage, check_pixels, open_rgb

log = logging.getLogger(__name__)

# What a GPU JPEG decoder takes: baseline or progressive JPEG, 8-bit, three channels or one.
GPU_JPEG_MODES = ("RGB", "L")
INTERPOLATIONS = ("bilinear", "bicubic")


@dataclass
class EncodedSample:
    """One training or validation sample as a worker leaves it.

    ``data`` is the file's bytes (uint8, 1-D) when ``encoded`` is true, else the decoded image (uint8
    ``[3, H, W]``); ``size`` is ``(height, width)``; ``crop`` the RandomResizedCrop box ``(top, left, height,
    width)`` and ``interpolation`` its resampling filter (training only); ``seed`` the sample's seed where the
    sampler hands one over (:class:`~namodels.data.datamodule.EpochSampler`)."""

    data: torch.Tensor
    encoded: bool
    size: tuple[int, int]
    target: int
    path: str
    crop: tuple[int, int, int, int] | None = None
    interpolation: str | None = None
    seed: int | None = None


@dataclass
class EncodedBatch:
    """A collated list of :class:`EncodedSample` (kept as a list: images differ in size) with the targets as one
    tensor and the paths of the files that could not be read.

    The encoded files travel from the worker as one buffer (``buffer``, with each sample's ``(start, stop)`` in
    ``spans``): a tensor per file would cost a shared-memory segment and a file descriptor per image."""

    samples: list[EncodedSample]
    targets: torch.Tensor
    skipped: list[str] = field(default_factory=list)
    buffer: torch.Tensor | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def encoded_data(self) -> list[torch.Tensor]:
        """The bytes of the samples with ``encoded`` set, in order (views of ``buffer``)."""
        if self.buffer is None:
            return [s.data for s in self.samples if s.encoded]
        return [self.buffer[start:stop] for start, stop in self.spans]


def collate_encoded(batch) -> EncodedBatch:
    kept = [s for s in batch if not isinstance(s, Unreadable)]
    skipped = [s.path for s in batch if isinstance(s, Unreadable)]
    targets = torch.tensor([s.target for s in kept], dtype=torch.long)
    files = [s.data for s in kept if s.encoded]
    spans, start = [], 0
    for data in files:
        spans.append((start, start + data.numel()))
        start += data.numel()
    buffer = torch.cat(files) if files else torch.empty(0, dtype=torch.uint8)
    for s in kept:
        if s.encoded:
            s.data = None  # in the buffer now
    return EncodedBatch(kept, targets, skipped, buffer, spans)


class CropSampler:
    """timm's RandomResizedCrop box and interpolation choice, drawn from the worker's ``random`` module (seeded by
    the sample's seed, else per worker and epoch by the data loader) for an image size, without the image's
    pixels."""

    def __init__(self, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation: str = "random"):
        if interpolation != "random" and interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation: expected 'random' or one of {INTERPOLATIONS} on the GPU pipeline, "
                             f"got {interpolation!r}")
        self.scale, self.ratio, self.interpolation = tuple(scale), tuple(ratio), interpolation

    def __call__(self, height: int, width: int) -> tuple[tuple[int, int, int, int], str]:
        # an expanded 0-d tensor stands in for the image: get_params reads only its size
        shape_only = torch.empty((), dtype=torch.uint8).expand(3, height, width)
        box = RandomResizedCropAndInterpolation.get_params(shape_only, self.scale, self.ratio)
        interp = random.choice(INTERPOLATIONS) if self.interpolation == "random" else self.interpolation
        return tuple(int(v) for v in box), interp


class EncodedImages(Dataset):
    """A :class:`~namodels.data.sources.LabeledImages` dataset read as :class:`EncodedSample` items.

    Args:
        images: the split (its timm reader and index list are used; its transform is not).
        crops: a :class:`CropSampler` for training; None for validation (no crop drawn).
    """

    def __init__(self, images, crops: CropSampler | None = None):
        self.images, self.crops = images, crops
        self.classes = images.classes

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | tuple[int, int]):
        """``key``: an index, or ``(index, seed)`` whose seed fixes the sample's crop draw."""
        index, seed = key if isinstance(key, tuple) else (key, None)
        images = self.images
        index = int(index if images.indices is None else images.indices[index])
        name = images.filename(index)
        try:
            source, target = images.reader[index]
            data = source.read() if hasattr(source, "read") else None
            if hasattr(source, "close"):
                source.close()
            sample = self._sample(data, source, name, int(target))
        except UnreadableImage as err:
            log.warning("skipping unreadable image %s", err)
            return Unreadable(name)
        except DECODE_ERRORS as err:  # the header could not be parsed, or the file vanished
            log.warning("skipping unreadable image %s: %s", name, err)
            return Unreadable(name)
        sample.seed = seed
        if self.crops is not None:
            if seed is not None:
                random.seed(seed)  # timm's get_params draws from the module-level generator
            sample.crop, sample.interpolation = self.crops(*sample.size)
        return sample

    @staticmethod
    def _sample(data: bytes | None, source, name: str, target: int) -> EncodedSample:
        if data is None:  # in-memory readers hand over decoded images
            pixels = _chw(open_rgb(source, name))
            return EncodedSample(pixels, False, tuple(pixels.shape[1:]), target, name)
        with Image.open(io.BytesIO(data)) as header:
            width, height = header.size
            gpu = header.format == "JPEG" and header.mode in GPU_JPEG_MODES
        check_pixels((width, height), name)  # a decompression bomb is refused before any decoder sees it
        if gpu:
            return EncodedSample(torch.frombuffer(bytearray(data), dtype=torch.uint8), True, (height, width),
                                 target, name)
        pixels = _chw(open_rgb(io.BytesIO(data), name))
        return EncodedSample(pixels, False, tuple(pixels.shape[1:]), target, name)


def _chw(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()
