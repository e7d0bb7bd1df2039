"""Generators in and out, shared by GAN training (``gan.py``) and sampling (``generate.py``, ``fid.py``):
building StyleNAT generators / discriminators from their keyword arguments, loading a generator from any
checkpoint file, and sample grids (PNG files, TensorBoard images).

Sample grids keep every generated pixel: tiles are the model's images at its resolution, tiled with a
2-pixel border.  Models smaller than ``min_tile`` pixels (the built-in 32x32 run) are shown enlarged by
a whole factor with nearest-neighbour repetition, so each generated pixel becomes a square block and a
4x4 grid of 32x32 samples is 522 pixels wide instead of 138.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import torch
from torch import nn
from torchvision.utils import make_grid, save_image

from namodels.data.images import to_unit_range
from namodels.models.stylenat import StyleNATDiscriminator, StyleNATGenerator, load_official_generator
from namodels.tasks.checkpoints import load_checkpoint_file
from namodels.tasks.models import open_safetensors

__all__ = ["DISPLAY_TILE", "build_generator", "build_discriminator", "load_generator", "grid_image", "save_grid",
           "tile_scale", "write_image"]

# Smallest tile side (pixels) a sample grid shows by default; smaller models are enlarged by a whole factor.
DISPLAY_TILE = 128


# ---------------------------------------------------------------------------------------------
# Building / loading generators
# ---------------------------------------------------------------------------------------------


def build_generator(cfg: Mapping[str, Any] | nn.Module) -> nn.Module:
    """A generator from keyword arguments of :class:`StyleNATGenerator` (or a module, returned as is)."""
    return cfg if isinstance(cfg, nn.Module) else StyleNATGenerator(**dict(cfg))


def build_discriminator(cfg: Mapping[str, Any] | nn.Module) -> nn.Module:
    return cfg if isinstance(cfg, nn.Module) else StyleNATDiscriminator(**dict(cfg))


def load_generator(path: str, which: str = "g_ema", release_cfg: Mapping[str, Any] | None = None,
                   map_location="cpu", w_avg_samples: int = 10000, backend: str | None = None) -> StyleNATGenerator:
    """A generator (eval mode) from a checkpoint file.

    Reads our Lightning checkpoints (configuration from their hyper-parameters), our exported
    ``.safetensors`` (configuration in the metadata) and the released StyleNAT files, which carry no
    configuration: ``release_cfg`` (keyword arguments of :class:`StyleNATGenerator`) describes them,
    default FFHQ-256.  ``which``: ``g_ema`` (default) or ``g``; ``backend`` overrides the NA backend.
    """
    if which not in ("g", "g_ema"):
        raise ValueError(f"which: expected 'g' or 'g_ema', got {which!r}")
    if not os.path.isfile(path):
        raise ValueError(f"ckpt_path: {path!r} does not exist")
    override = {} if backend is None else {"backend": backend}
    if path.endswith(".safetensors"):
        with open_safetensors(path, "ckpt_path") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
        cfg = json.loads(meta.get("generator", "null") or "null")
        if cfg is None:
            raise ValueError(f"ckpt_path: {path!r} carries no generator configuration (not exported by GANTask)")
        gen = build_generator({**dict(cfg), **override})
        gen.load_state_dict(state)
        return gen.eval().requires_grad_(False)
    ckpt = load_checkpoint_file(path, map_location=map_location)  # plain data only: never runs pickled code
    if "state_dict" in ckpt and "hyper_parameters" in ckpt:  # ours (Lightning)
        cfg = ckpt["hyper_parameters"].get("generator")
        if cfg is None:
            raise ValueError(f"ckpt_path: {path!r} stores no generator configuration (not a GAN checkpoint)")
        gen = build_generator({**dict(cfg), **override})
        prefix = "ema.module." if which == "g_ema" else "generator."
        state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
        if not state:
            raise ValueError(f"ckpt_path: {path!r} holds no {prefix}* weights (not a GAN checkpoint?)")
        gen.load_state_dict(state)
    else:
        gen = build_generator({**dict(release_cfg or {"size": 256}), **override})
        load_official_generator(gen, ckpt, which, w_avg_samples=w_avg_samples)
    return gen.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# Sample grids
# ---------------------------------------------------------------------------------------------


def tile_scale(size: int, min_tile: int | None) -> int:
    """The whole factor a ``size``-pixel sample is enlarged by to be at least ``min_tile`` pixels
    (1: shown as it is, also for ``min_tile`` None or 0)."""
    if min_tile is not None and int(min_tile) < 0:
        raise ValueError(f"min_tile: expected >= 0 pixels (0 or None: no enlarging), got {min_tile}")
    return max(1, math.ceil(int(min_tile) / size)) if min_tile else 1


def grid_image(images: torch.Tensor, nrow: int | None = None, min_tile: int | None = None) -> torch.Tensor:
    """Generator outputs ``[N, 3, H, W]`` (about [-1, 1]) as one float image ``[3, H', W']`` in [0, 1]:
    ``nrow`` tiles a row (default ``ceil(sqrt(N))``), 2-pixel borders, each tile enlarged by
    :func:`tile_scale` (nearest: every generated pixel kept as a block)."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images: expected [N, 3, H, W], got {tuple(images.shape)}")
    nrow = nrow or int(math.ceil(math.sqrt(images.shape[0])))
    tiles = to_unit_range(images.detach().cpu())
    factor = tile_scale(min(tiles.shape[-2:]), min_tile)
    if factor > 1:
        tiles = tiles.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)
    return make_grid(tiles, nrow=nrow, padding=2)


def write_image(image: torch.Tensor, path: str) -> str:
    """Writes a float image ``[3, H, W]`` in [0, 1] as PNG (its folder created); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_image(image, path)
    return path


def save_grid(images: torch.Tensor, path: str, nrow: int | None = None, min_tile: int | None = None) -> str:
    """Writes generator outputs ``[N, 3, H, W]`` as one PNG grid (see :func:`grid_image`); returns ``path``."""
    return write_image(grid_image(images, nrow, min_tile), path)
