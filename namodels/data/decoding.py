"""Decoding image files the same way in every dataset: RGB, 8 bits per channel, unreadable files named.

* :func:`open_rgb` decodes a file (path or open binary file) to an 8-bit RGB ``PIL.Image``.  16-bit
  images (PNG ``I;16``, ``I``) are scaled to 8 bits (``value / 257``) instead of being clipped at 255,
  which turns most of a 16-bit picture white.
* :class:`UnreadableImage` is raised for any file that cannot be decoded: truncated or not an image,
  a decompression bomb, a dangling symlink or a vanished file.  Datasets catch it and skip the file,
  reporting its path as :class:`Unreadable`, so counts are of files, not of read attempts.
* Decompression bombs: an image of more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels (Pillow's default: about
  89 million) is refused from its header, before it is decoded (:func:`check_pixels`).  Pillow itself only
  warns there and refuses at twice the limit, so an image of 89 to 179 million pixels would be decoded, with
  its conversion copies up to about 1.3 GB in a loader worker.  The limit is Pillow's setting, read at each
  call: ``PIL.Image.MAX_IMAGE_PIXELS = n`` raises or lowers it, ``None`` lifts it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO, Union

import numpy as np
from PIL import Image

# Modes holding more than 8 bits per sample; their values are scaled to 0..255 (see open_rgb).
WIDE_INTEGER_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
# What PIL (and the file system) raise for a file that cannot be decoded into an image.
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


class UnreadableImage(Exception):
    """A file that cannot be decoded; ``path`` names it."""

    def __init__(self, path: str, reason: BaseException):
        super().__init__(f"{path}: {type(reason).__name__}: {reason}")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class Unreadable:
    """What a dataset returns instead of a sample whose file could not be decoded."""

    path: str


def to_rgb8(image: Image.Image) -> Image.Image:
    """An 8-bit RGB copy of ``image``; 16/32-bit integer images are scaled by 1/257 (65535 -> 255)."""
    if image.mode in WIDE_INTEGER_MODES:
        values = np.asarray(image, dtype=np.float64)
        scaled = np.clip(np.round(values / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(scaled, mode="L").convert("RGB")
    if image.mode == "F":  # float images: taken as [0, 1]
        values = np.asarray(image, dtype=np.float64)
        return Image.fromarray(np.clip(np.round(values * 255), 0, 255).astype(np.uint8), mode="L").convert("RGB")
    return image.convert("RGB")


def check_pixels(size: tuple[int, int], name: str) -> None:
    """Raises :class:`UnreadableImage` (a ``DecompressionBombError``) naming ``name`` when an image of ``size``
    (width, height) has more pixels than ``PIL.Image.MAX_IMAGE_PIXELS`` (no limit when that is None)."""
    limit = Image.MAX_IMAGE_PIXELS
    width, height = size
    if limit is not None and width * height > limit:
        raise UnreadableImage(name, Image.DecompressionBombError(
            f"{width}x{height} image has {width * height} pixels, over the limit of {int(limit)} "
            "(PIL.Image.MAX_IMAGE_PIXELS); not decoded"))


def open_rgb(source: Union[str, os.PathLike, BinaryIO, Image.Image], name: str | None = None) -> Image.Image:
    """Decodes ``source`` (a path, an open binary file or a PIL image) to 8-bit RGB, reading the whole
    file now (so a truncated file fails here); raises :class:`UnreadableImage` naming ``name``/the path."""
    name = name or str(getattr(source, "name", source))
    try:
        if isinstance(source, Image.Image):
            return to_rgb8(source)
        with Image.open(source) as image:  # reads the header only
            check_pixels(image.size, name)
            return to_rgb8(image)
    except DECODE_ERRORS as err:
        raise UnreadableImage(name, err) from err
    finally:
        if hasattr(source, "close") and not isinstance(source, Image.Image):
            source.close()


class UnreadableFiles:
    """The unreadable files a task has met, per split, as sets of paths: a file read every epoch (or by
    several processes) counts once.  ``state()`` / ``load_state()`` carry them through checkpoints."""

    def __init__(self):
        self.by_split: dict[str, set[str]] = {}

    def add(self, split: str, paths) -> list[str]:
        """Records ``paths``; returns those not seen before."""
        seen = self.by_split.setdefault(split, set())
        new = [p for p in paths if p not in seen]
        seen.update(new)
        return new

    def count(self, split: str) -> int:
        return len(self.by_split.get(split, ()))

    def all(self) -> set[str]:
        return set().union(*self.by_split.values())

    def merge_across_processes(self) -> None:
        """Unions the sets of every process (each sees other files under a distributed sampler)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.state())
        for state in gathered:
            self.load_state(state)

    def state(self) -> dict:
        return {split: sorted(paths) for split, paths in self.by_split.items()}

    def load_state(self, state: dict | None) -> None:
        for split, paths in (state or {}).items():
            self.add(split, paths)
