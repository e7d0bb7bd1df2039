"""Tile shapes for the fused kernels: a small cost model over N-D power-of-two boxes.

A kernel has an *outer* tile (one per program: the query tile of the forward and dQ kernels, the
key/value tile of the dK/dV kernel) and an *inner* tile it loops over.  For an outer tile of
``T`` positions on an axis with window ``K`` and stride ``s``, the inner positions it reaches span
about ``K + max(T - s, 0)`` (the union of its windows; by symmetry the same count bounds the
queries reaching ``T`` keys).  The inner loop starts at the union's first position, so it visits
``ceil(span / U) * U`` positions, and the outer tiles cover ``ceil(Lg / T) * T`` positions.  The
product of those two factors over the axes is the number of (query, key) pairs the kernel computes,
which the chooser minimizes for given outer and inner tile sizes (rows x columns of the matmuls).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

MIN_DOT = 16  # tl.dot needs every matrix side >= 16


@dataclass(frozen=True)
class Axis:
    """One axis of a problem, dilation folded in (``Lg`` = positions in the largest group)."""

    Lg: int
    K: int
    s: int


def axes_of(params) -> list[Axis]:
    return [Axis(-(-L // d), K, s) for L, K, s, d, _ in params.axes()]


def _log2(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _splits(total: int, caps: list[int]):
    """All exponent tuples summing to ``total`` with each entry <= its cap (caps relaxed on the
    last axis when the axes are too short to hold ``total``, e.g. tiny problems)."""
    caps = list(caps)
    if sum(caps) < total:
        caps[-1] += total - sum(caps)
    ranges = [range(0, c + 1) for c in caps]
    return [e for e in itertools.product(*ranges) if sum(e) == total]


def _axis_cost(ax: Axis, outer: int, inner: int) -> int:
    span = min(ax.Lg, ax.K + max(outer - ax.s, 0))
    return math.ceil(ax.Lg / outer) * outer * math.ceil(span / inner) * inner


def choose_tiles(axes: list[Axis], outer_size: int, inner_size: int):
    """Returns (outer_tile, inner_tile): per-axis power-of-two sides with the given products."""
    outer_log, inner_log = _log2(outer_size), _log2(inner_size)
    outer_caps = [_log2(a.Lg) for a in axes]
    best = None
    for eo in _splits(outer_log, outer_caps):
        outer = [1 << e for e in eo]
        inner_caps = [_log2(min(a.Lg, a.K + max(t - a.s, 0))) for a, t in zip(axes, outer)]
        for ei in _splits(inner_log, inner_caps):
            inner = [1 << e for e in ei]
            cost = math.prod(_axis_cost(a, t, u) for a, t, u in zip(axes, outer, inner))
            # Tie-break: longer runs on the last axis (fewer, longer loops; contiguous tokens).
            rank_key = (cost, tuple(-e for e in reversed(eo)), tuple(-e for e in reversed(ei)))
            if best is None or rank_key < best[0]:
                best = (rank_key, tuple(outer), tuple(inner))
    return best[1], best[2]


def loop_length(axes: list[Axis], outer: tuple, inner: tuple) -> int:
    """Inner tiles one program visits (the cost model's span per axis over the inner tile side)."""
    return math.prod(math.ceil(min(a.Lg, a.K + max(t - a.s, 0)) / u) for a, t, u in zip(axes, outer, inner))


def pairs_computed(axes: list[Axis], outer: tuple, inner: tuple) -> int:
    """The cost model's count of (query, key) pairs (for reports and tests)."""
    return math.prod(_axis_cost(a, t, u) for a, t, u in zip(axes, outer, inner))


def total_size(tokens: int, wanted: int) -> int:
    """Tile size: ``wanted`` but no more than needed for a tiny problem, and at least MIN_DOT."""
    return max(MIN_DOT, min(wanted, 1 << _log2(tokens)))
