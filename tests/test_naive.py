"""Backend `naive` against the dense-mask oracle, in float64, forward and backward."""
import random

import pytest
import torch

import ops
import ops.naive
from tests.backend_check import check_backend
from tests.oracle import RandomProblem, random_problem


# Every buffer allocated with torch.empty starts as NaN: unwritten output elements fail.
pytestmark = pytest.mark.usefixtures("poison_torch_empty")


@pytest.mark.parametrize("seed", range(300))
def test_random_problems_float64(seed):
    rng = random.Random(1000 + seed)
    problem = random_problem(rng)
    gen = torch.Generator().manual_seed(seed)
    check_backend(problem, "naive", torch.float64, generator=gen, extra_tokens=rng.choice([0, 0, 0, 3]))


def _fixed(spatial, K, s=1, d=1, causal=False, rpb=True, heads=2, heads_kv=2):
    rank = len(spatial)
    per = lambda x: x if isinstance(x, tuple) else (x,) * rank  # noqa: E731
    return RandomProblem(tuple(spatial), per(K), per(s), per(d), per(causal), 2, heads, heads_kv, 5, 6,
                         rpb and not any(per(causal)))


FIXED = {
    "borders_1d": _fixed((13,), 5),
    "even_kernel_2d": _fixed((8, 9), (4, 6)),
    "kernel_equals_length_is_self_attention": _fixed((6, 5), (6, 5)),
    "kernel_one": _fixed((7, 4), 1),
    "blocked_stride_equals_kernel": _fixed((12, 9), 3, s=3),
    "dilation_uneven_groups": _fixed((11,), 3, d=3),
    "causal_time_3d": _fixed((5, 6, 6), (3, 3, 3), causal=(True, False, False), rpb=False),
    "causal_stride": _fixed((17,), 5, s=3, causal=True, rpb=False),
    "mqa": _fixed((9, 9), 3, heads=4, heads_kv=1),
}


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_cases(name):
    check_backend(FIXED[name], "naive", torch.float64, generator=torch.Generator().manual_seed(7))


def test_kernel_equals_length_matches_full_attention():
    q, k, v = (torch.randn(2, 6, 5, 3, 8, dtype=torch.float64) for _ in range(3))
    out = ops.na2d(q, k, v, kernel_size=(6, 5), backend="naive")
    dense = torch.nn.functional.scaled_dot_product_attention(*(t.flatten(1, 2).transpose(1, 2) for t in (q, k, v)))
    torch.testing.assert_close(out, dense.transpose(1, 2).reshape(out.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    problem = _fixed((10, 12), 5, d=2)
    check_backend(problem, "naive", dtype, generator=torch.Generator().manual_seed(3))


def test_gradcheck_float64():
    problem = _fixed((5, 4), 3, s=2, heads=2, heads_kv=1)
    q, k, v, rpb = problem.tensors(generator=torch.Generator().manual_seed(0), requires_grad=True)
    fn = lambda q, k, v, rpb: ops.na2d(q, k, v, 3, stride=2, rpb=rpb, backend="naive", return_lse=True)  # noqa
    assert torch.autograd.gradcheck(fn, (q, k, v, rpb))


def test_chunking_bounds_memory(monkeypatch):
    """Tiny chunk budget: many chunks, same result as one chunk."""
    problem = _fixed((12, 12), 5, d=2)
    q, k, v, rpb = problem.tensors(generator=torch.Generator().manual_seed(1))
    full = ops.na2d(q, k, v, 5, dilation=2, rpb=rpb, backend="naive")
    monkeypatch.setattr(ops.naive, "CHUNK_BYTES", 1)
    chunked = ops.na2d(q, k, v, 5, dilation=2, rpb=rpb, backend="naive")
    torch.testing.assert_close(full, chunked, rtol=0, atol=1e-12)
