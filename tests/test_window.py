"""The shared window module against the rules written out independently in tests/oracle.py."""
import random

import pytest
import torch

from ops.functional import make_params
from ops.window import axis_admits, keys_per_query, neighbor_table
from tests.oracle import _axis_keys, dense_mask_and_bias_index, random_axis, random_problem


@pytest.mark.parametrize("seed", range(200))
def test_axis_rules_match_design(seed):
    rng = random.Random(seed)
    L, K, s, d, causal = random_axis(rng)
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    got = axis_admits(i, j, L, K, s, d, causal)
    expected = torch.zeros(L, L, dtype=torch.bool)
    for q in range(L):
        for key in _axis_keys(q, L, K, s, d, causal):
            expected[q, key] = True
    assert torch.equal(got, expected)
    # Python ints take the same code path as tensors.
    q = rng.randrange(L)
    assert [bool(axis_admits(q, key, L, K, s, d, causal)) for key in range(L)] == expected[q].tolist()


@pytest.mark.parametrize("seed", range(60))
def test_neighbor_table_matches_dense_mask(seed):
    p = random_problem(random.Random(seed), max_tokens=64)
    params = make_params(p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    key, valid, rel = neighbor_table(params)
    mask, rel_index = dense_mask_and_bias_index(p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    n = mask.shape[0]
    assert key.shape == valid.shape == rel.shape == (n, params.window_size)
    rebuilt = torch.zeros(n, n, dtype=torch.bool)
    for qi in range(n):
        ks = key[qi][valid[qi]]
        assert len(set(ks.tolist())) == len(ks), "a key appears in two slots"
        rebuilt[qi, ks] = True
        for kj, r in zip(ks.tolist(), rel[qi][valid[qi]].tolist()):
            expected = 0
            for axis, K in enumerate(p.kernel_size):
                expected = expected * (2 * K - 1) + rel_index[(qi, kj)][axis]
            assert r == expected
    assert torch.equal(rebuilt, mask)
    # Chunked construction gives the same rows.
    part = neighbor_table(params, queries=torch.arange(n // 2, n))
    assert torch.equal(part[0], key[n // 2:]) and torch.equal(part[1], valid[n // 2:])


def test_non_causal_windows_are_full_and_slots_row_major():
    params = make_params((9, 7), (3, 5), 1, 1, False)
    key, valid, _ = neighbor_table(params)
    assert bool(valid.all())
    # Query (4, 3): rows 3..5, cols 1..5, row-major slots.
    q = 4 * 7 + 3
    expected = [r * 7 + c for r in range(3, 6) for c in range(1, 6)]
    assert key[q].tolist() == expected


def test_keys_per_query():
    assert keys_per_query(make_params((16, 16), 5, 1, 1, False)) == 25
    # 1-D causal, K=3: queries see 1, 2, 3, 3, ... keys
    assert keys_per_query(make_params((6,), 3, 1, 1, True)) == pytest.approx((1 + 2 + 3 * 4) / 6)
