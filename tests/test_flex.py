"""Backend `flex` against the dense-mask oracle: float32 forward on CPU, forward+backward on CUDA."""
import random
import warnings

import pytest
import torch

import ops
from tests.backend_check import check_backend
from tests.oracle import random_problem

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("seed", range(300))
def test_random_problems_forward_cpu(seed):
    rng = random.Random(5000 + seed)
    problem = random_problem(rng, max_tokens=64)
    check_backend(problem, "flex", torch.float32, grad=False, generator=torch.Generator().manual_seed(seed),
                  extra_tokens=rng.choice([0, 0, 2]))


def test_backward_on_cpu_is_refused_with_reason():
    q = torch.randn(1, 8, 8, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="backend: 'flex' cannot serve.*no backward on CPU"):
        ops.na2d(q, q, q, 3, backend="flex")
    with torch.no_grad():
        ops.na2d(q, q, q, 3, backend="flex")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("seed", range(60))
def test_random_problems_cuda(seed):
    rng = random.Random(9000 + seed)
    problem = random_problem(rng, max_tokens=256, max_dim=16)
    problem.dim, problem.dim_v = 16, 16  # compiled flex kernels need head dims >= 16
    check_backend(problem, "flex", torch.float32, device="cuda", generator=torch.Generator("cuda").manual_seed(seed),
                  tol=5e-3)


def test_dilation_group_order_makes_the_block_mask_sparse():
    """Tokens in dilation-group order (ops.flex.group_order): every group contiguous, and far fewer
    128x128 blocks to compute than in row-major order (dinat-s1: 409 -> 73 of 625)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ops import flex
    from ops.functional import make_params

    params = make_params((56, 56), 7, 1, 8, False)
    order, inverse = flex.group_order(params, torch.device("cpu"))
    assert torch.equal(order[inverse], torch.arange(params.num_tokens))
    rows, cols = order // 56, order % 56
    group = (rows % 8) * 8 + cols % 8
    assert torch.equal(group, torch.sort(group).values)  # groups are contiguous runs
    n = params.num_tokens

    def computed_blocks(bm):
        return int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())

    row_major = create_block_mask(flex.make_mask_mod(params), None, None, n, n, device="cpu", BLOCK_SIZE=128)
    grouped = flex._block_mask(params, torch.device("cpu"))
    assert computed_blocks(grouped) * 4 < computed_blocks(row_major)
    assert flex.group_order(make_params((8, 8), 3, 1, 1, False), torch.device("cpu")) is None


@pytest.mark.parametrize("seed", range(4))
def test_dilated_rpb_problems_in_group_order(seed):
    """Dilation on every axis with RPB and GQA: the group-order path against the oracle."""
    from tests.oracle import RandomProblem

    rng = random.Random(77 + seed)
    spatial = (rng.randint(6, 11), rng.randint(9, 12))  # K * d <= L on both axes
    problem = RandomProblem(spatial, (3, 3), (1, rng.choice([1, 2])), (2, rng.choice([2, 3])), (False, False), 2, 4,
                            2, 8, 8, True)
    check_backend(problem, "flex", torch.float32, grad=False, generator=torch.Generator().manual_seed(seed))


def test_many_problems_stay_compiled(monkeypatch):
    """Past dynamo's default recompile limit (8 variants of one function) flex would run uncompiled,
    materialising the full score matrix; the backend keeps every NA problem compiled.  Compiled here
    with dynamo's ``eager`` backend (the guard and cache logic is dynamo's, not Inductor's), on 12
    problems, each checked against the oracle."""
    import functools

    from torch.nn.attention.flex_attention import flex_attention

    import ops.flex as flex_backend

    compiled = torch.compile(flex_attention, backend="eager", dynamic=False)
    monkeypatch.setattr(flex_backend, "COMPILE_ON_CPU", True)
    monkeypatch.setattr(flex_backend, "_compiled_flex", functools.lru_cache(maxsize=1)(lambda: compiled))
    torch._dynamo.reset()
    limit_before = torch._dynamo.config.recompile_limit
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex_attention called without torch.compile")
        for side in range(5, 17):  # 12 shapes: 12 compiled variants
            q, k, v = (torch.randn(1, side, 6, 2, 8, generator=torch.Generator().manual_seed(side + i))
                       for i in range(3))
            got = ops.na2d(q, k, v, 3, backend="flex")
            want = ops.na2d(q, k, v, 3, backend="naive")
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch._dynamo.config.recompile_limit == limit_before  # raised for flex's calls only
    torch._dynamo.reset()
