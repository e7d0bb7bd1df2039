"""The order in which a launch runs its tiles, chosen so that the tiles in flight at once share L2.

A Hopper kernel's program fills an SM's shared memory, so about one program per SM runs at a time, and the hardware
starts them in launch order (grid axis 0 first; a persistent program takes every ``programs``-th position). The
tiles in flight at once are therefore a run of consecutive positions, and every box their spans cover is read by
all of them within a short time: L2 serves those reads while the spans of one run fit in it. In row-major tile order
a run of 132 3-D query tiles spans whole slabs of the key volume (3d-hunyuan-s16x8x8: every frame of one stride
group's window, all rows and columns, 35 MB of K and V per head), which L2 does not hold, and the forward read 10.2
GB from HBM for 2.1 GB of Q, K and V; 2d-flux-s16's run spans about half that and read 1.35 GB for 1.2.

``block_order`` visits the tiles in blocks of ``(b0, b1, b2)`` tiles (blocks in row-major order, tiles inside a
block in row-major order) and picks the block shape whose runs of ``at_once`` consecutive tiles have the smallest
summed bounding box of their spans: tiles that share a window (a stride group) come together, and a run covers a
compact part of the volume instead of a slab.
"""
from __future__ import annotations

import itertools

import torch


def _candidates(n: int) -> list[int]:
    """Block sides tried on an axis of ``n`` tiles: powers of two below ``n``, and ``n``."""
    sides = {n}
    side = 1
    while side < n:
        sides.add(side)
        side *= 2
    return sorted(sides)


def blocked(counts: tuple, block: tuple) -> torch.Tensor:
    """The flat (row-major) indices of a grid of ``counts`` tiles, visited in blocks of ``block`` tiles."""
    coords = torch.stack(torch.meshgrid(*(torch.arange(n) for n in counts), indexing="ij"), -1).reshape(-1, 3)
    outer = coords // torch.tensor(block)
    inner = coords % torch.tensor(block)
    blocks = [-(-n // b) for n, b in zip(counts, block)]
    key = ((outer[:, 0] * blocks[1] + outer[:, 1]) * blocks[2] + outer[:, 2]) * (block[0] * block[1] * block[2])
    key = key + (inner[:, 0] * block[1] + inner[:, 1]) * block[2] + inner[:, 2]
    flat = (coords[:, 0] * counts[1] + coords[:, 1]) * counts[2] + coords[:, 2]
    return flat[torch.argsort(key)]


def run_volume(order: torch.Tensor, counts: tuple, spans: torch.Tensor, at_once: int) -> int:
    """The summed bounding-box volume of the spans of each run of ``at_once`` consecutive tiles of ``order``;
    ``spans[axis, tile]`` = ``(lo, hi)`` of the tile on that axis (rows past ``counts`` unused)."""
    coords = torch.stack([order // (counts[1] * counts[2]), (order // counts[2]) % counts[1], order % counts[2]])
    pad = -len(order) % at_once
    total = 0
    extent = None
    for axis in range(3):
        lo = spans[axis, coords[axis], 0]
        hi = spans[axis, coords[axis], 1]
        lo = torch.cat([lo, lo[-1:].expand(pad)]).view(-1, at_once).amin(1)
        hi = torch.cat([hi, hi[-1:].expand(pad)]).view(-1, at_once).amax(1)
        side = (hi - lo).clamp(min=0).to(torch.int64)
        extent = side if extent is None else extent * side
    total = int(extent.sum())
    return total


def block_order(counts: tuple, spans: torch.Tensor, at_once: int) -> torch.Tensor:
    """The launch order (``blocked``) of a grid of ``counts`` tiles (per axis, leading dummy axes 1) whose block shape
    has the smallest ``run_volume``; row-major order (one block of the whole grid) wins ties."""
    spans = spans[..., :2].cpu()
    best = blocked(counts, counts)
    best_volume = run_volume(best, counts, spans, at_once)
    for block in itertools.product(*(_candidates(n) for n in counts)):
        order = blocked(counts, block)
        volume = run_volume(order, counts, spans, at_once)
        if volume < best_volume:
            best, best_volume = order, volume
    return best.to(torch.int32)
