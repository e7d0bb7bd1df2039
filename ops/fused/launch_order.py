"""The order in which a launch runs its tiles, chosen so that the tiles in flight at once share L2.

A Hopper kernel's program fills an SM's shared memory, so about one program per SM runs at a time, and the hardware
starts them in launch order (grid axis 0 first; a persistent program takes every ``programs``-th position). The
tiles in flight at once are therefore a run of consecutive positions, and the boxes their spans cover come from L2
only while what the run reads fits in it. In row-major order a run of 3-D tiles spans every frame and row of the
volume in its columns, which L2 does not hold, and the 3-D kernels read HBM several times over (``docs/fused.md``,
"Launch order").

``block_order`` visits the tiles in blocks of ``(b0, b1, b2)`` tiles (blocks in row-major order, tiles inside a
block in row-major order) and picks the block shape whose runs of ``at_once`` consecutive tiles have the smallest
summed bounding box of their spans, so that a run covers a compact part of the volume instead of a slab.
"""
from __future__ import annotations

import functools
import itertools

import torch


def _candidates(n: int) -> list[int]:
    """Block sides tried on an axis of ``n`` tiles: powers of two below ``n``, the divisors of ``n``, and ``n``."""
    sides = {d for d in range(1, n + 1) if n % d == 0}
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
    coords = (order // (counts[1] * counts[2]), (order // counts[2]) % counts[1], order % counts[2])
    pad = -len(order) % at_once  # the last run, short, repeats its last tile
    volume = torch.ones(-(-len(order) // at_once), dtype=torch.int64)
    for axis in range(3):
        lo, hi = (torch.cat([x, x[-1:].expand(pad)]).view(-1, at_once) for x in spans[axis, coords[axis]].unbind(-1))
        volume *= (hi.amax(1) - lo.amin(1)).clamp(min=0)
    return int(volume.sum())


def block_order(counts: tuple, spans: torch.Tensor, at_once: int) -> torch.Tensor:
    """The launch order (``blocked``) of a grid of ``counts`` tiles (per axis, leading dummy axes 1) whose block shape
    has the smallest ``run_volume``; row-major order (one block of the whole grid) wins ties."""
    spans = spans[..., :2].cpu()
    block = _best_block(tuple(counts), tuple(spans.flatten().tolist()), tuple(spans.shape), at_once)
    return blocked(counts, block).to(torch.int32)


@functools.lru_cache(maxsize=64)
def _best_block(counts: tuple, flat_spans: tuple, shape: tuple, at_once: int) -> tuple:
    """``block_order``'s block shape (cached: the forward, dQ and dK/dV plans of a problem ask for the same search,
    which tries about a hundred shapes on a 3-D grid)."""
    spans = torch.tensor(flat_spans, dtype=torch.int64).view(shape)
    best, best_volume = counts, run_volume(blocked(counts, counts), counts, spans, at_once)
    for block in itertools.product(*(_candidates(n) for n in counts)):
        volume = run_volume(blocked(counts, block), counts, spans, at_once)
        if volume < best_volume:
            best, best_volume = block, volume
    return best
