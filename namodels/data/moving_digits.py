"""Moving digits: sklearn's 8x8 digit sprites moving and bouncing on a black canvas (offline, seeded).

Like Moving MNIST, from data that ships with scikit-learn.  Each clip places ``num_digits`` sprites
at random positions with random directions and speeds; they move in straight lines, bounce off the
canvas borders and are rendered with sub-pixel (bilinear) placement; overlapping digits combine by
maximum.  Clip ``i`` of a split is a pure function of ``(seed, split, i)``, so every epoch, worker
and machine sees the same clips.  Train and held-out splits draw their sprites from disjoint sets of
sklearn digit images (80 % / 20 % of a fixed permutation).

Items are ``(clip, label)``: ``clip`` float32 ``[T, 1, H, W]`` in ``[0, 1]`` and ``label`` the class
(0-9) of the first digit (for the classification option).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

SPLITS = {"train": 0, "val": 1, "test": 2}
_SPRITE_SEED = 1234  # fixed: the sprite partition must not change with the clip seed


@lru_cache(maxsize=None)
def _sprites():
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)  # [1797, 8, 8] in [0, 1]
    order = np.random.default_rng(_SPRITE_SEED).permutation(len(images))
    return images[order], digits.target[order].astype(np.int64)


def _split_sprites(split: str, train_fraction: float = 0.8):
    images, labels = _sprites()
    cut = int(round(len(images) * train_fraction))
    return (images[:cut], labels[:cut]) if split == "train" else (images[cut:], labels[cut:])


def _upscale(sprite: np.ndarray, factor: int) -> np.ndarray:
    return np.kron(sprite, np.ones((factor, factor), dtype=sprite.dtype)) if factor > 1 else sprite


def _paste_bilinear(canvas: np.ndarray, sprite: np.ndarray, y: float, x: float) -> None:
    """Max-composites ``sprite`` at fractional top-left ``(y, x)`` (inside the canvas) onto ``canvas``."""
    y0, x0 = int(math.floor(y)), int(math.floor(x))
    fy, fx = y - y0, x - x0
    h, w = sprite.shape
    shifted = np.zeros((h + 1, w + 1), dtype=np.float32)
    shifted[:h, :w] += (1 - fy) * (1 - fx) * sprite
    shifted[:h, 1:] += (1 - fy) * fx * sprite
    shifted[1:, :w] += fy * (1 - fx) * sprite
    shifted[1:, 1:] += fy * fx * sprite
    H, W = canvas.shape
    hh, ww = min(h + 1, H - y0), min(w + 1, W - x0)
    region = canvas[y0:y0 + hh, x0:x0 + ww]
    np.maximum(region, shifted[:hh, :ww], out=region)


class MovingDigits(Dataset):
    """Clips of bouncing sklearn digits.

    Args:
        num_clips: dataset length.
        num_frames: frames per clip (T).
        image_size: square canvas side.
        num_digits: sprites per clip.
        digit_scale: integer upscaling of the 8x8 sprites (nearest).
        speed: (min, max) speed in pixels per frame.
        split: 'train' | 'val' | 'test' (val/test use held-out sprites and other clip seeds).
        seed: base seed.
    """

    def __init__(self, num_clips: int = 1000, num_frames: int = 10, image_size: int = 32, num_digits: int = 2,
                 digit_scale: int = 1, speed: Sequence[float] = (1.0, 3.0), split: str = "train", seed: int = 0):
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {sorted(SPLITS)}, got {split!r}")
        if num_clips < 1 or num_frames < 1 or num_digits < 1 or digit_scale < 1:
            raise ValueError("num_clips: num_clips, num_frames, num_digits and digit_scale must be >= 1")
        if 8 * digit_scale > image_size:
            raise ValueError(f"image_size: {image_size} is smaller than a sprite ({8 * digit_scale})")
        lo, hi = float(speed[0]), float(speed[1])
        if not 0 <= lo <= hi:
            raise ValueError(f"speed: expected 0 <= min <= max, got {tuple(speed)}")
        self.num_clips, self.num_frames, self.image_size = num_clips, num_frames, image_size
        self.num_digits, self.digit_scale, self.speed = num_digits, digit_scale, (lo, hi)
        self.split, self.seed = split, seed
        self.images, self.labels = _split_sprites(split)

    def __len__(self) -> int:
        return self.num_clips

    def trajectories(self, index: int):
        """Sprite indices and per-frame top-left positions ``[num_digits, T, 2]`` of clip ``index``."""
        rng = np.random.default_rng([self.seed, SPLITS[self.split], index])
        size = 8 * self.digit_scale
        limit = float(self.image_size - size)
        which = rng.integers(0, len(self.images), self.num_digits)
        pos = rng.uniform(0, limit, (self.num_digits, 2))
        angle = rng.uniform(0, 2 * math.pi, self.num_digits)
        speed = rng.uniform(*self.speed, self.num_digits)
        vel = np.stack([np.sin(angle), np.cos(angle)], -1) * speed[:, None]
        path = np.empty((self.num_digits, self.num_frames, 2))
        for t in range(self.num_frames):
            path[:, t] = pos
            pos = pos + vel
            # Bounce: reflect the position into [0, limit] and flip the velocity component.
            low, high = pos < 0, pos > limit
            pos = np.where(low, -pos, np.where(high, 2 * limit - pos, pos))
            vel = np.where(low | high, -vel, vel)
            pos = np.clip(pos, 0, limit)
        return which, path

    def __getitem__(self, index: int):
        if not 0 <= index < self.num_clips:
            raise IndexError(f"index {index} out of range for {self.num_clips} clips")
        which, path = self.trajectories(index)
        frames = np.zeros((self.num_frames, self.image_size, self.image_size), dtype=np.float32)
        for d, sprite_index in enumerate(which):
            sprite = _upscale(self.images[sprite_index], self.digit_scale)
            for t in range(self.num_frames):
                _paste_bilinear(frames[t], sprite, *path[d, t])
        clip = torch.from_numpy(np.clip(frames, 0.0, 1.0)).unsqueeze(1)
        return clip, int(self.labels[which[0]])
