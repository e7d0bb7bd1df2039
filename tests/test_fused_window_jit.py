"""The jit window formulas of the fused backend against ops/window.py (the single source of the rules).

Runs the Triton functions through the interpreter on CPU (no GPU in CI).  Also pins the property the
fused backward relies on: inside a dilation group, the queries whose window contains a key form one
contiguous range (the inverse neighborhood), checked by brute force with ops.window.
"""
import os
import random

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ops.fused import window_jit as wj  # noqa: E402
from ops.window import axis_admits, axis_window  # noqa: E402

pytestmark = pytest.mark.skipif(
    not os.environ.get("TRITON_INTERPRET") == "1", reason="window_jit tests run under TRITON_INTERPRET=1"
)


@triton.jit
def _window_kernel(out_ptr, L, K, s, d, CAUSAL: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # One program per axis position p: p's window as a query, p's inverse neighborhood as a key.
    p = tl.program_id(0)
    g = p % d
    Lg = wj.group_length(L, d, g)
    ip = p // d
    start = wj.window_start(ip, Lg, K, s, CAUSAL)
    stop = wj.window_stop(ip, start, K, CAUSAL)
    first = wj.first_query_reaching(ip, Lg, K, s, CAUSAL, STEPS)
    last = wj.last_query_reaching(ip, Lg, K, s, CAUSAL, STEPS)
    # Vector form too (the kernels evaluate the window of a whole row block at once).
    offs = tl.arange(0, BLOCK)
    vec_start = wj.window_start(offs, Lg, K, s, CAUSAL)
    vec_ok = tl.sum(tl.where((offs < Lg) & (offs == ip), vec_start, 0), 0)
    vals = tl.where(offs == 0, Lg, 0) + tl.where(offs == 1, start, 0) + tl.where(offs == 2, stop, 0)
    vals += tl.where(offs == 3, first, 0) + tl.where(offs == 4, last, 0) + tl.where(offs == 5, vec_ok, 0)
    tl.store(out_ptr + p * 8 + offs, vals, mask=offs < 8)


def _axes(seed, count):
    rng = random.Random(seed)
    cases = [(1, 1, 1, 1, False), (7, 7, 7, 1, False), (7, 7, 1, 1, True), (13, 3, 2, 4, False), (10, 3, 3, 3, True)]
    while len(cases) < count:
        L = rng.randint(1, 40)
        d = rng.randint(1, max(1, min(5, L)))
        K = rng.randint(1, L // d)
        cases.append((L, K, rng.randint(1, K), d, rng.random() < 0.4))
    return cases


@pytest.mark.parametrize("L,K,s,d,causal", _axes(0, 24))
def test_jit_window_matches_window_py(L, K, s, d, causal):
    out = torch.full((L, 8), -7, dtype=torch.int32)
    _window_kernel[(L,)](out, L, K, s, d, CAUSAL=causal, BLOCK=64, STEPS=(-(-L // d)).bit_length())
    i = torch.arange(L)
    g, i_g, start, stop = axis_window(i, L, K, s, d, causal)
    Lg = L // d + (g < L % d).long()
    assert torch.equal(out[:, 0].long(), Lg)
    assert torch.equal(out[:, 1].long(), start)
    assert torch.equal(out[:, 2].long(), stop)
    assert torch.equal(out[:, 5].long(), start)
    # Inverse neighborhood of key p (group coordinate i_g): brute force over every query.
    admits = axis_admits(i[:, None], i[None, :], L, K, s, d, causal)  # [query, key]
    for key in range(L):
        queries = admits[:, key].nonzero().flatten()
        group_queries = queries // d  # all in key's group
        lo, hi = int(out[key, 3]), int(out[key, 4]) + 1
        assert group_queries.tolist() == list(range(lo, hi)), (key, queries.tolist(), lo, hi)


@pytest.mark.parametrize("seed", range(3))
def test_inverse_neighborhood_is_contiguous(seed):
    """Within a dilation group, the queries reaching a key form one contiguous run (pure ops.window)."""
    for L, K, s, d, causal in _axes(100 + seed, 60):
        i = torch.arange(L)
        admits = axis_admits(i[:, None], i[None, :], L, K, s, d, causal)
        for key in range(L):
            q = (admits[:, key].nonzero().flatten() // d).tolist()
            assert q == list(range(q[0], q[-1] + 1)) if q else True
            assert q, f"key {key} reached by no query (L={L}, K={K}, s={s}, d={d}, causal={causal})"
