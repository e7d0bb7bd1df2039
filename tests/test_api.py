"""Argument checking, backend selection, modules and the additional-keys merge."""
import logging
import random

import pytest
import torch

import ops
from tests.backend_check import check_backend
from tests.oracle import oracle_attention, random_problem


def qkv(shape=(2, 8, 8, 2, 4), **kw):
    return (torch.randn(*shape, **kw) for _ in range(3))


ERROR_CASES = {
    "kernel_size zero": (dict(kernel_size=0), "kernel_size"),
    "kernel_size too large": (dict(kernel_size=9), "kernel_size"),
    "kernel times dilation too large": (dict(kernel_size=3, dilation=3), "kernel_size"),
    "kernel_size wrong arity": (dict(kernel_size=(3, 3, 3)), "kernel_size"),
    "kernel_size float": (dict(kernel_size=3.0), "kernel_size"),
    "stride zero": (dict(kernel_size=3, stride=0), "stride"),
    "stride above kernel": (dict(kernel_size=3, stride=4), "stride"),
    "dilation zero": (dict(kernel_size=3, dilation=0), "dilation"),
    "is_causal not bool": (dict(kernel_size=3, is_causal=(True, 2)), "is_causal"),
    "rpb wrong shape": (dict(kernel_size=3, rpb=torch.zeros(2, 3, 3)), "rpb"),
    "rpb with causal axis": (dict(kernel_size=3, is_causal=(True, False), rpb=torch.zeros(2, 5, 5)), "rpb"),
    "unknown backend": (dict(kernel_size=3, backend="cudnn"), "backend"),
    "scale nan": (dict(kernel_size=3, scale=float("nan")), "scale"),
    "extra keys without values": (dict(kernel_size=3, additional_keys=torch.zeros(2, 3, 2, 4)), "additional_keys"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_bad_arguments_raise_value_error_naming_them(case):
    kwargs, name = ERROR_CASES[case]
    q, k, v = qkv()
    with pytest.raises(ValueError, match=name):
        ops.na2d(q, k, v, **kwargs)


def test_tensor_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="query"):
        ops.na2d(q[0], k, v, 3)
    with pytest.raises(ValueError, match="query"):
        ops.na1d(q, k, v, 3)
    with pytest.raises(ValueError, match="dtype"):
        ops.na2d(q, k.double(), v, 3)
    with pytest.raises(ValueError, match="dtype"):
        ops.na2d(*(t.to(torch.int32) for t in (q, k, v)), 3)
    with pytest.raises(ValueError, match="spatial shape"):
        ops.na2d(q, k[:, :7], v, 3)
    with pytest.raises(ValueError, match="head dim"):
        ops.na2d(q, k[..., :3], v, 3)
    with pytest.raises(ValueError, match="heads"):
        ops.na2d(torch.randn(2, 8, 8, 3, 4), k, v, 3)
    with pytest.raises(ValueError, match="heads"):
        ops.na2d(q, k, v[..., :1, :], 3)
    with pytest.raises(ValueError, match="additional_values"):
        ops.na2d(q, k, v, 3, additional_keys=torch.randn(2, 3, 2, 4), additional_values=torch.randn(2, 3, 2, 5))


def test_error_names_the_axis():
    q, k, v = qkv((1, 10, 4, 1, 4))
    with pytest.raises(ValueError, match="axis 1"):
        ops.na2d(q, k, v, kernel_size=(3, 5))


@pytest.mark.parametrize("rank, call", [
    (2, lambda q: ops.na2d(q, q, q, kernel_size=7)),
    (2, lambda q: ops.na2d_qk(q, q, kernel_size=7)),
    (1, lambda q: ops.na1d(q, q, q, kernel_size=5)),
    (3, lambda q: ops.na3d(q, q, q, kernel_size=(3, 5, 5), is_causal=(True, False, False))),
])
def test_heads_first_tensors_name_the_heads_last_layout(rank, call):
    """[B, heads, *spatial, D] (SDPA's layout) fails the window check on the heads axis: the error names the
    layout the ops take and how to get there, and the moved tensors then work."""
    q = torch.randn(1, 2, *([4] if rank == 3 else []), *([16] * min(rank, 2)), 8)
    with pytest.raises(ValueError, match=r"kernel_size: axis 0.*heads-last.*heads-first.*movedim\(1, -2\)"):
        call(q)
    call(q.movedim(1, -2))


def test_window_larger_than_the_map_gives_no_layout_hint():
    q, k, v = qkv()  # heads-last, 8x8 map: read heads-first the window would not fit either
    with pytest.raises(ValueError, match="kernel_size") as err:
        ops.na2d(q, k, v, kernel_size=9)
    assert "heads-first" not in str(err.value)


def test_module_rejects_bad_config():
    with pytest.raises(ValueError, match="rel_pos_bias"):
        ops.NeighborhoodAttention3D(16, 2, 3, is_causal=(True, False, False), rel_pos_bias=True)
    with pytest.raises(ValueError, match="num_heads"):
        ops.NeighborhoodAttention2D(10, 3, 3)
    with pytest.raises(ValueError, match="stride"):
        ops.NeighborhoodAttention1D(8, 2, 3, stride=5)


def test_backend_selection_context_and_log(caplog):
    q, k, v = qkv()
    with ops.use_backend("naive"):
        assert ops.current_backend() == "naive"
        a = ops.na2d(q, k, v, 3)
    assert ops.current_backend() is None
    b = ops.na2d(q, k, v, 3, backend="naive")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="backend"):
        with ops.use_backend("nope"):
            pass
    with caplog.at_level(logging.DEBUG, logger="ops.backends"):
        ops.na2d(q.requires_grad_(), k, v, 3)
    # On CPU the fused backend is never chosen automatically (at most Triton's interpreter could run
    # it); gemm, next in PREFERENCE, serves, and the log says why fused was passed over.
    if not torch.cuda.is_available():
        assert "rejected" in caplog.text and "fused" in caplog.text and "'gemm' chosen" in caplog.text


@pytest.mark.parametrize("seed", range(20))
def test_automatic_backend_matches_oracle(seed):
    rng = random.Random(300 + seed)
    check_backend(random_problem(rng), None, torch.float32, generator=torch.Generator().manual_seed(seed), tol=2e-4)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_module_matches_oracle(rank):
    torch.manual_seed(rank)
    spatial = {1: (11,), 2: (7, 6), 3: (4, 5, 5)}[rank]
    cls = {1: ops.NeighborhoodAttention1D, 2: ops.NeighborhoodAttention2D, 3: ops.NeighborhoodAttention3D}[rank]
    m = cls(dim=12, num_heads=3, kernel_size=3, dilation=1, rel_pos_bias=True).double()
    assert set(n.split(".")[0] for n, _ in m.named_parameters()) == {"qkv", "rpb", "proj"}
    x = torch.randn(2, *spatial, 12, dtype=torch.float64)
    y = m(x)
    q, k, v = m.qkv(x).reshape(2, *spatial, 3, 3, 4).unbind(-3)
    ref, _ = oracle_attention(q, k, v, spatial, (3,) * rank, (1,) * rank, (1,) * rank, (False,) * rank, m.rpb)
    torch.testing.assert_close(y, m.proj(ref.reshape(2, *spatial, 12)))
    y.sum().backward()
    assert m.rpb.grad is not None and m.rpb.grad.abs().sum() > 0


def test_repeated_calls_are_still_checked():
    """Validated arguments are cached by signature; a call that differs in anything checked is checked
    again (types too: ``True`` is not an int kernel size), and the backend is still chosen per call."""
    from ops import functional

    q = torch.randn(1, 9, 9, 2, 8)
    rpb = torch.randn(2, 5, 5)
    functional._VALIDATED.clear()
    first = ops.na2d(q, q, q, 3, rpb=rpb, backend="naive")
    again = ops.na2d(q, q, q, 3, rpb=rpb, backend="naive")
    torch.testing.assert_close(first, again)
    assert len(functional._VALIDATED) == 1
    with pytest.raises(ValueError, match="kernel_size"):
        ops.na2d(q, q, q, True, backend="naive")
    with pytest.raises(ValueError, match="rpb"):
        ops.na2d(q, q, q, 3, rpb=torch.randn(2, 7, 7), backend="naive")
    with pytest.raises(ValueError, match="rpb"):
        ops.na2d(q, q, q, 3, rpb=rpb.to(torch.int64), backend="naive")
    with pytest.raises(ValueError, match="dtype"):
        ops.na2d(q, q.double(), q, 3, backend="naive")
    with pytest.raises(ValueError, match="kernel_size"):
        ops.na2d(q, q, q, [3, 11], backend="naive")
    with pytest.raises(ValueError, match="backend"):
        ops.na2d(q, q, q, 3, rpb=rpb, backend="no-such-backend")
    with ops.use_backend("gemm"):  # same signature, another backend: chosen per call
        torch.testing.assert_close(ops.na2d(q, q, q, 3, rpb=rpb), first, rtol=1e-5, atol=1e-5)
