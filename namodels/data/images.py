"""Unconditional image data for GAN training and FID: image folders (FFHQ / LSUN layouts) and an
offline default made of random crops of scikit-image's bundled sample photos.

Images are float32 ``[3, R, R]`` in ``[-1, 1]`` (what the generator outputs).

* :class:`ImageFolder`: every image file under ``root`` (recursively, sorted; links followed, each real
  file once: :func:`~namodels.data.files.find_image_files`), so it reads the FFHQ layout
  (``images1024x1024/00000/00000.png`` or a flat ``ffhq256/*.png``) and LSUN exported to files
  (``church_outdoor_train/*.webp``); resized so the short side is ``resolution``, center
  cropped, optionally flipped.  Items are ``(image, skipped)``: an unreadable file (truncated, not an
  image, a decompression bomb, a dangling symlink) is replaced by the next readable one, so batches
  stay full (the discriminator's minibatch-stddev groups need that), and its path is listed in
  ``skipped``; :func:`collate_images` gathers those lists per batch.  16-bit images are scaled to 8 bits.
* :class:`SkimageCrops`: ``length`` random square crops (random size, position and flip) of the
  colour sample images that ship inside scikit-image, resized to ``resolution``; crop ``i`` is a
  pure function of ``(seed, i)`` so every worker, epoch and machine sees the same data.
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache
from typing import Sequence

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, default_collate

from .decoding import UnreadableImage, open_rgb
from .files import find_image_files

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
# Colour photos bundled with scikit-image (no download needed).
SKIMAGE_IMAGES = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")

__all__ = ["ImageFolder", "SkimageCrops", "GANDataModule", "collate_images", "to_unit_range", "IMAGE_EXTENSIONS"]


def to_signed(img: torch.Tensor) -> torch.Tensor:
    """uint8 or [0, 1] float ``[3, H, W]`` -> float32 in [-1, 1]."""
    img = img.float() / 255.0 if img.dtype == torch.uint8 else img.float()
    return img * 2.0 - 1.0


def to_unit_range(img: torch.Tensor) -> torch.Tensor:
    """Generator output (about [-1, 1]) -> [0, 1], clamped."""
    return (img.float().clamp(-1, 1) + 1.0) / 2.0


def resize_center_crop(img: torch.Tensor, resolution: int) -> torch.Tensor:
    """Float ``[3, H, W]``: resize so the short side is ``resolution`` (antialiased bicubic), center crop."""
    _, h, w = img.shape
    scale = resolution / min(h, w)
    nh, nw = max(resolution, round(h * scale)), max(resolution, round(w * scale))
    if (nh, nw) != (h, w):
        img = F.interpolate(img[None], size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)[0]
    top, left = (nh - resolution) // 2, (nw - resolution) // 2
    return img[:, top:top + resolution, left:left + resolution]


class ImageFolder(Dataset):
    """All images under ``root`` (recursive), short side resized to ``resolution``, center cropped.

    Args:
        root: folder (FFHQ: ``.../images1024x1024`` or a folder of pre-resized PNGs; LSUN: a
            folder of exported images).
        resolution: output side.
        hflip: random horizontal flips (deterministic per index and epoch-free: seeded by ``seed``
            and the index, flipped with probability 1/2).
        max_images: use only the first ``max_images`` files (sorted order), e.g. for FID subsets.
    """

    def __init__(self, root: str, resolution: int = 256, hflip: bool = True, max_images: int | None = None,
                 seed: int = 0, extensions: Sequence[str] = IMAGE_EXTENSIONS):
        if not os.path.isdir(root):
            raise ValueError(f"root: image folder {root!r} does not exist")
        exts = tuple(e.lower() for e in extensions)
        files = [f.path for f in find_image_files(root, exts)]  # a link loop adds no file
        if not files:
            raise ValueError(f"root: no images ({', '.join(exts)}) found under {root!r}")
        self.files = files[:max_images] if max_images else files
        self.root, self.resolution, self.hflip, self.seed = root, resolution, hflip, seed

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        """``(image [3, R, R] in [-1, 1], skipped)``: ``skipped`` lists the unreadable files passed over
        (the file at ``index`` and the ones after it) to reach a readable one."""
        skipped = []
        for offset in range(len(self.files)):
            path = self.files[(index + offset) % len(self.files)]
            try:
                arr = np.asarray(open_rgb(path))
            except UnreadableImage as err:
                log.warning("skipping unreadable image %s", err)
                skipped.append(path)
                continue
            img = resize_center_crop(torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255.0, self.resolution)
            flip = torch.rand((), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + index)) < 0.5
            if self.hflip and flip:
                img = img.flip(-1)
            return to_signed(img.clamp(0, 1)), tuple(skipped)
        raise ValueError(f"root: none of the {len(self.files)} images under {self.root!r} is readable")


@lru_cache(maxsize=None)
def _skimage_photos(names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    import skimage.data

    photos = []
    for name in names:
        arr = np.asarray(getattr(skimage.data, name)())
        if arr.ndim == 2:
            arr = np.repeat(arr[..., None], 3, axis=-1)
        photos.append(torch.from_numpy(arr[..., :3].astype(np.float32) / 255.0).permute(2, 0, 1).contiguous())
    return tuple(photos)


class SkimageCrops(Dataset):
    """Random square crops of scikit-image's sample photos (offline built-in data).

    Args:
        resolution: output side.
        length: number of crops (the epoch size).
        min_scale: smallest crop side as a fraction of the photo's short side.
        hflip: random horizontal flips.
        seed: crop ``i`` is a pure function of ``(seed, i)``.
        names: which ``skimage.data`` photos to use.
    """

    def __init__(self, resolution: int = 64, length: int = 10000, min_scale: float = 0.25, hflip: bool = True,
                 seed: int = 0, names: Sequence[str] = SKIMAGE_IMAGES):
        if not 0 < min_scale <= 1:
            raise ValueError(f"min_scale: expected a fraction in (0, 1], got {min_scale}")
        if length < 1:
            raise ValueError(f"length: expected >= 1, got {length}")
        self.resolution, self.length, self.min_scale = resolution, length, min_scale
        self.hflip, self.seed, self.names = hflip, seed, tuple(names)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if not 0 <= index < self.length:
            raise IndexError(index)
        photos = _skimage_photos(self.names)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        photo = photos[int(torch.randint(len(photos), (), generator=gen))]
        _, h, w = photo.shape
        short = min(h, w)
        lo = max(8, int(self.min_scale * short))
        side = int(torch.randint(lo, short + 1, (), generator=gen))
        top = int(torch.randint(0, h - side + 1, (), generator=gen))
        left = int(torch.randint(0, w - side + 1, (), generator=gen))
        crop = photo[:, top:top + side, left:left + side]
        crop = F.interpolate(crop[None], size=(self.resolution,) * 2, mode="bicubic", antialias=True,
                             align_corners=False)[0]
        if self.hflip and torch.rand((), generator=gen) < 0.5:
            crop = crop.flip(-1)
        return to_signed(crop.clamp(0, 1))


def collate_images(batch) -> tuple[torch.Tensor, list[str]]:
    """``(images [B, 3, R, R], skipped paths)`` from items that are images or ``(image, skipped)`` pairs."""
    images, skipped = [], []
    for item in batch:
        image, passed_over = item if isinstance(item, tuple) else (item, ())
        images.append(image)
        skipped.extend(passed_over)
    return default_collate(images), skipped


class GANDataModule(L.LightningDataModule):
    """Real images for GAN training / FID.

    Args:
        source: ``'skimage'`` (built-in, offline) or ``'folder'`` (``root`` required).
        root: image folder for ``source='folder'``.
        resolution: image side (must match the generator).
        batch_size: per-process batch.
        length: epoch size of the skimage source.
        hflip: random horizontal flips (training).
        max_images: cap on the folder's images.
    """

    def __init__(self, source: str = "skimage", root: str | None = None, resolution: int = 64, batch_size: int = 8,
                 num_workers: int = 0, length: int = 10000, hflip: bool = True, max_images: int | None = None,
                 min_scale: float = 0.25, seed: int = 0, pin_memory: bool = True):
        super().__init__()
        if source not in ("skimage", "folder"):
            raise ValueError(f"source: expected 'skimage' or 'folder', got {source!r}")
        if source == "folder" and not root:
            raise ValueError("root: source='folder' needs root=<image folder>")
        self.source, self.root, self.resolution = source, root, resolution
        self.batch_size, self.num_workers, self.length = batch_size, num_workers, length
        self.hflip, self.max_images, self.min_scale, self.seed = hflip, max_images, min_scale, seed
        self.pin_memory = pin_memory
        self.train_set = None

    def make_dataset(self, hflip: bool | None = None, seed: int | None = None) -> Dataset:
        hflip = self.hflip if hflip is None else hflip
        seed = self.seed if seed is None else seed
        if self.source == "folder":
            return ImageFolder(self.root, self.resolution, hflip=hflip, max_images=self.max_images, seed=seed)
        return SkimageCrops(self.resolution, self.length, self.min_scale, hflip=hflip, seed=seed)

    def setup(self, stage: str | None = None):
        if self.train_set is None:
            self.train_set = self.make_dataset()

    def train_dataloader(self):
        self.setup("fit")
        # drop_last: the discriminator's minibatch-stddev groups need full batches.
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers, pin_memory=self.pin_memory and torch.cuda.is_available(),
                          persistent_workers=self.num_workers > 0, collate_fn=collate_images)

    def real_dataloader(self, batch_size: int | None = None):
        """Un-flipped real images in a fixed order (FID reference statistics)."""
        return DataLoader(self.make_dataset(hflip=False), batch_size=batch_size or self.batch_size, shuffle=False,
                          num_workers=self.num_workers, collate_fn=collate_images)
