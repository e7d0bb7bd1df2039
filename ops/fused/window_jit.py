"""Triton (jit) copies of the window rules in ``ops/window.py``, for use inside kernels.

Every function works on scalars and on integer blocks alike, in dilation-group coordinates
(``i' = i // d``; ``Lg`` = length of the group).  ``tests/test_fused_window_jit.py`` checks them
against ``ops.window.axis_window`` on every query of many axes, so the kernels and every other
backend agree on the semantics.

Besides the forward window (``window_start`` / ``window_stop``) the backward needs the inverse
neighborhood: the queries whose window contains a key.  ``start`` and ``stop`` are monotone
non-decreasing in the query index, so the queries reaching key ``j'`` are the contiguous range
``[first_query_reaching(j'), last_query_reaching(j') + 1)``; both ends are found by bisection on
the same formulas (no second derivation of the rules to keep in sync).
"""
import triton
import triton.language as tl


@triton.jit
def group_length(L, d, g):
    """Positions of dilation group ``g`` on an axis of length ``L`` with dilation ``d``."""
    return L // d + tl.where(g < L % d, 1, 0)


@triton.jit
def window_start(i, Lg, K, s, CAUSAL: tl.constexpr):
    """First admitted key of query ``i`` (group coordinates)."""
    if CAUSAL:
        leader = tl.minimum((i // s) * s + (s - 1), Lg - 1)
        start = tl.maximum(leader - K + 1, 0)
    else:
        leader = tl.minimum((i // s) * s + s // 2, Lg - 1)
        start = tl.minimum(tl.maximum(leader - K // 2, 0), Lg - K)
    return start


@triton.jit
def window_stop(i, start, K, CAUSAL: tl.constexpr):
    """One past the last admitted key of query ``i`` whose window starts at ``start``."""
    if CAUSAL:
        stop = i + 1
    else:
        stop = start + K
    return stop


@triton.jit
def first_query_reaching(j, Lg, K, s, CAUSAL: tl.constexpr, STEPS: tl.constexpr):
    """Smallest query whose window stop is past key ``j`` (``Lg`` if none); ``j`` a scalar.

    Branch-free bisection over ``[0, Lg]`` with ``STEPS >= bit_length(Lg)`` unrolled steps (a
    ``while`` loop here made Triton's software pipeliner fail on the kernel's main loop).
    """
    lo = j * 0
    hi = Lg + j * 0
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        right = window_stop(mid, window_start(mid, Lg, K, s, CAUSAL), K, CAUSAL) <= j
        active = lo < hi
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


@triton.jit
def last_query_reaching(j, Lg, K, s, CAUSAL: tl.constexpr, STEPS: tl.constexpr):
    """Largest query whose window starts at or before key ``j`` (-1 if none); ``j`` a scalar."""
    lo = j * 0
    hi = Lg + j * 0
    for _ in tl.static_range(STEPS):  # first query whose start is past j
        mid = (lo + hi) // 2
        right = window_start(mid, Lg, K, s, CAUSAL) <= j
        active = lo < hi
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo - 1
