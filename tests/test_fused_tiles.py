"""The fused kernels' tile model (ops/fused/tiles.py) against brute force over the window rules."""
import random

import pytest

from ops.fused import tiles
from ops.window import axis_admits


def brute_force_iterations(L, K, s, causal, outer, inner, inverse):
    """The (outer start, inner start) pairs a kernel's loop visits on one axis, derived from
    ``axis_admits`` alone: the inner tiles run from the first to the last position that any
    position of the outer tile interacts with."""
    visits = []
    for o in range(0, L, outer):
        own = range(o, min(o + outer, L))
        if inverse:  # outer = keys: the queries reaching them
            reach = [i for i in range(L) if any(axis_admits(i, j, L, K, s, 1, causal) for j in own)]
        else:
            reach = [j for j in range(L) if any(axis_admits(i, j, L, K, s, 1, causal) for i in own)]
        if reach:
            first, stop = min(reach), max(reach) + 1
            visits += [(o, first + t * inner) for t in range(-(-(stop - first) // inner))]
    return visits


def random_axes(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        L = rng.randint(1, 40)
        K = rng.randint(1, L)
        yield L, K, rng.randint(1, K), rng.random() < 0.3, rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 2, 4, 8, 16])


@pytest.mark.parametrize("inverse", [False, True])
def test_axis_loop_counts_the_kernel_loops(inverse):
    for L, K, s, causal, outer, inner in random_axes(60, seed=int(inverse)):
        visits = brute_force_iterations(L, K, s, causal, outer, inner, inverse)
        loop = tiles.axis_loop(tiles.Axis(L, K, s, causal), outer, inner, inverse)
        assert loop.iterations == len(visits), (L, K, s, causal, outer, inner)
        assert loop.programs == -(-L // outer)
        # every admitted pair is computed by some visit (the loops miss nothing) ...
        covered = set()
        for o, first in visits:
            for a in range(o, min(o + outer, L)):
                for b in range(first, min(first + inner, L)):
                    covered.add((b, a) if inverse else (a, b))
        admitted = {(i, j) for i in range(L) for j in range(L) if axis_admits(i, j, L, K, s, 1, causal)}
        assert admitted <= covered
        # ... and a visit counted as unmasked admits every pair it computes
        unmasked = 0
        for o, first in visits:
            qs = range(first, min(first + inner, L)) if inverse else range(o, min(o + outer, L))
            ks = range(o, o + outer) if inverse else range(first, first + inner)
            unmasked += all(axis_admits(i, j, L, K, s, 1, causal) for i in qs for j in ks)
        assert loop.iterations - loop.masked <= unmasked


def test_exact_model_beats_the_closed_form_on_3d_hunyuan():
    # 30 frames with a window of 18: clamped windows pile up on the short axis.  The closed form picked
    # (2, 4, 8) keys x (1, 4, 32) queries for dK/dV; the exact count picks a tile that computes ~11% fewer
    # pairs (and runs faster: docs/fused.md, "Tiling").
    axes = [tiles.Axis(30, 18, 1), tiles.Axis(48, 24, 1), tiles.Axis(80, 24, 1)]
    old = tiles.pairs_computed(axes, (2, 4, 8), (1, 4, 32), inverse=True)
    outer, inner = tiles.choose_tiles(axes, 64, 128, inverse=True)
    assert tiles.pairs_computed(axes, outer, inner, inverse=True) < 0.92 * old
    assert tiles.pairs_computed(axes, (2, 4, 8), (1, 4, 32), inverse=True) == old  # cached counts stay exact
    tokens = 30 * 48 * 80
    needed = 18 * 24 * 24 * tokens
    assert tiles.pairs_computed(axes, outer, inner, inverse=True) >= needed


def test_choose_tiles_returns_the_requested_sizes():
    axes = [tiles.Axis(7, 7, 1, True), tiles.Axis(56, 7, 1), tiles.Axis(56, 7, 1)]
    for outer_size, inner_size in [(16, 64), (64, 64), (128, 32)]:
        for inverse in (False, True):
            outer, inner = tiles.choose_tiles(axes, outer_size, inner_size, inverse)
            assert len(outer) == len(inner) == 3
            assert outer[0] * outer[1] * outer[2] == outer_size
            assert inner[0] * inner[1] * inner[2] == inner_size


@pytest.mark.parametrize("inverse", [False, True])
def test_max_boxes_is_the_longest_program_loop(inverse):
    """``max_boxes`` (the bias tiles reserved per program) is the most inner tiles any one program visits: the
    product over the axes of each axis' longest loop, by brute force."""
    axes = list(random_axes(40, seed=7 + int(inverse)))
    for first, second in zip(axes[::2], axes[1::2]):
        longest = 1
        for L, K, s, causal, outer, inner in (first, second):
            visits = brute_force_iterations(L, K, s, causal, outer, inner, inverse)
            per_program = [sum(1 for o, _ in visits if o == start) for start in range(0, L, outer)]
            longest *= max(per_program)
        pair = [tiles.Axis(L, K, s, causal) for L, K, s, causal, _, _ in (first, second)]
        got = tiles.max_boxes(pair, (first[4], second[4]), (first[5], second[5]), inverse)
        assert got == max(longest, 1), (first, second)
