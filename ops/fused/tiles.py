"""Tile shapes for the fused kernels: an exact count of the loops' work over N-D power-of-two boxes.

A kernel has an *outer* tile (one per program: the query tile of the forward and dQ kernels, the
key/value tile of the dK/dV kernel) and an *inner* tile it loops over.  The kernels' loops are
separable per axis: a program's inner tiles are the product of per-axis ranges, so the (query, key)
pairs a kernel computes are the product over the axes of ``sum over outer tiles of (inner tiles
visited) * T * U``.  Each axis is counted exactly, with the kernels' own rules (the same window
formulas, ``ops/window.py``):

* forward / dQ: the query tile ``[q0, q0 + T)`` visits key tiles from ``start(q0)`` to
  ``stop(last)`` in steps of ``U``;
* dK/dV: the key tile ``[k0, k0 + U)`` visits query tiles from the first query reaching ``k0`` to
  the last one reaching ``k0 + U - 1`` in steps of ``T``.

An inner tile needs a mask on an axis unless it lies inside every query's window there; those masks
are the second cost (``MASK_COST``).  A closed form such as ``K + T - 1`` positions per tile is not
enough: it undercounts where clamped windows pile up (an axis shorter than ``2 K``), and there it picks
a dK/dV tile that computes more pairs than the best one (``docs/fused.md``, "Tiling").
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass

from ops.window import axis_window

MIN_DOT = 16  # tl.dot needs every matrix side >= 16

# Cost of masking an inner tile on one axis, relative to computing its pairs: the border masks' share of the 3-D
# forward's time per masked axis of a tile (docs/fused.md, "Tiling").
MASK_COST = 0.1


@dataclass(frozen=True)
class Axis:
    """One axis of a problem, dilation folded in (``Lg`` = positions in the largest group)."""

    Lg: int
    K: int
    s: int
    causal: bool = False


@dataclass(frozen=True)
class AxisLoop:
    """One axis of a kernel's loops: outer tiles, inner tiles visited in all, and how many of those
    need a mask on this axis."""

    programs: int
    iterations: int
    masked: int


def axes_of(params) -> list[Axis]:
    return [Axis(-(-L // d), K, s, bool(c)) for L, K, s, d, c in params.axes()]


def _log2(n: int) -> int:
    return max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=256)
def axis_windows(ax: Axis) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, stop) of every query's window on the axis (group coordinates)."""
    wins = [axis_window(i, ax.Lg, ax.K, ax.s, 1, ax.causal)[2:] for i in range(ax.Lg)]
    return tuple(int(w[0]) for w in wins), tuple(int(w[1]) for w in wins)


def reaching_queries(starts, stops, first_key: int, last_key: int) -> tuple[int, int]:
    """``[lo, hi)``: the queries whose windows (``axis_windows``) hold some key of ``[first_key, last_key]``.  A
    window's start and stop never decrease along an axis, so they are a range: the queries whose windows stop after
    ``first_key`` and start at or before ``last_key``."""
    return bisect.bisect_right(stops, first_key), bisect.bisect_right(starts, last_key)


def _masked(first: int, n: int, step: int, width: int, in_lo: int, in_hi: int) -> int:
    """How many of the tiles ``[first + t * step, + width)``, t < n, stick out of ``[in_lo, in_hi)``."""
    return sum(1 for t in range(n) if first + t * step < in_lo or first + t * step + width > in_hi)


@functools.lru_cache(maxsize=65536)
def axis_loop(ax: Axis, outer: int, inner: int, inverse: bool) -> AxisLoop:
    """The loops of one axis, as the kernels run them (``inverse``: dK/dV, outer tiles are keys)."""
    starts, stops = axis_windows(ax)
    iterations = masked = 0
    for o in range(0, ax.Lg, outer):
        if inverse:  # queries [ql, qh) reach the keys [o, o + outer)
            ql, qh = reaching_queries(starts, stops, o, min(o + outer, ax.Lg) - 1)
            n = -(-max(qh - ql, 0) // inner)
            for t in range(n):
                q0 = ql + t * inner
                last = min(q0 + inner, ax.Lg) - 1
                masked += o < starts[last] or o + outer > stops[q0]
        else:
            last = min(o + outer, ax.Lg) - 1
            n = -(-(stops[last] - starts[o]) // inner)
            masked += _masked(starts[o], n, inner, inner, starts[last], stops[o])
        iterations += n
    return AxisLoop(-(-ax.Lg // outer), iterations, masked)


def max_boxes(axes: list[Axis], outer: tuple, inner: tuple, inverse: bool = False) -> int:
    """The most inner tiles any one program visits (``inverse``: dK/dV, whose outer tiles are keys)."""
    most = 1
    for ax, t, u in zip(axes, outer, inner):
        starts, stops = axis_windows(ax)
        counts = []
        for o in range(0, ax.Lg, t):
            if inverse:
                ql, qh = reaching_queries(starts, stops, o, min(o + t, ax.Lg) - 1)
                counts.append(-(-max(qh - ql, 0) // u))
            else:
                counts.append(-(-(stops[min(o + t, ax.Lg) - 1] - starts[o]) // u))
        most *= max(counts)
    return max(most, 1)


def _loops(axes, outer, inner, inverse):
    return [axis_loop(a, t, u, inverse) for a, t, u in zip(axes, outer, inner)]


def pairs_computed(axes: list[Axis], outer: tuple, inner: tuple, inverse: bool = False) -> int:
    """(query, key) pairs the kernel computes with these tiles (padding and masked pairs included)."""
    return math.prod(lp.iterations for lp in _loops(axes, outer, inner, inverse)) * math.prod(outer) * math.prod(inner)


def tile_cost(axes: list[Axis], outer: tuple, inner: tuple, inverse: bool = False) -> float:
    """Pairs computed, plus ``MASK_COST`` per axis on which an inner tile needs a mask."""
    return pairs_computed(axes, outer, inner, inverse) * (1 + MASK_COST * partial_axes(axes, outer, inner, inverse))


def partial_axes(axes: list[Axis], outer: tuple, inner: tuple, inverse: bool = False) -> float:
    """Axes on which an inner tile needs a mask, on average over the loops' tiles (0 to the rank)."""
    return sum(lp.masked / lp.iterations for lp in _loops(axes, outer, inner, inverse) if lp.iterations)


def loop_length(axes: list[Axis], outer: tuple, inner: tuple, inverse: bool = False) -> float:
    """Inner tiles one program visits, on average."""
    loops = _loops(axes, outer, inner, inverse)
    return math.prod(lp.iterations for lp in loops) / math.prod(lp.programs for lp in loops)


def _splits(total: int, caps: list[int]):
    """All exponent tuples summing to ``total`` with each entry <= its cap (caps relaxed on the
    last axis when the axes are too short to hold ``total``, e.g. tiny problems)."""
    caps = list(caps)
    if sum(caps) < total:
        caps[-1] += total - sum(caps)
    ranges = [range(0, c + 1) for c in caps]
    return [e for e in itertools.product(*ranges) if sum(e) == total]


def choose_tiles(axes: list[Axis], outer_size: int, inner_size: int, inverse: bool = False):
    """Returns (outer_tile, inner_tile): per-axis power-of-two sides with the given products and the
    least ``tile_cost`` (``inverse``: the outer tile holds keys, as in dK/dV)."""
    outer_log, inner_log = _log2(outer_size), _log2(inner_size)
    outer_caps = [_log2(a.Lg) for a in axes]
    best = None
    for eo in _splits(outer_log, outer_caps):
        outer = [1 << e for e in eo]
        # an inner side longer than what one outer tile reaches on that axis only adds padding
        inner_caps = [_log2(min(a.Lg, a.K + max(t - a.s, 0))) for a, t in zip(axes, outer)]
        for ei in _splits(inner_log, inner_caps):
            inner = [1 << e for e in ei]
            cost = tile_cost(axes, outer, inner, inverse)
            # Tie-break: longer runs on the last axis (fewer, longer loops; contiguous tokens).
            rank_key = (cost, tuple(-e for e in reversed(eo)), tuple(-e for e in reversed(ei)))
            if best is None or rank_key < best[0]:
                best = (rank_key, tuple(outer), tuple(inner))
    return best[1], best[2]


def total_size(tokens: int, wanted: int) -> int:
    """Tile size: ``wanted`` but no more than needed for a tiny problem, and at least MIN_DOT."""
    return max(MIN_DOT, min(wanted, 1 << _log2(tokens)))
