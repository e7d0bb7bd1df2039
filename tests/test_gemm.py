"""Backend ``gemm`` (PN / NN / IN): tile tables, tiled PyTorch path, Triton kernels, backend vs the oracle.

* tile tables against ops.window (halo covers every window; inverse ranges are exact);
* the three operators against a brute-force gather built from ``neighbor_table`` (float64);
* the backend against the dense-mask oracle, forward, lse and all gradients (float64, CPU);
* the Triton kernels under ``TRITON_INTERPRET=1`` (tiny problems, float64 and float32);
* ``gpu``-marked: the Triton kernels on CUDA (float32 / bfloat16) against the oracle.
"""
import os
import random

import pytest
import torch

import ops  # noqa: E402
import ops.gemm  # noqa: E402
from ops.functional import make_params  # noqa: E402
from ops.gemm import operators, tiles, torch_tiled  # noqa: E402
from ops.window import axis_window, neighbor_table  # noqa: E402
from tests.backend_check import check_backend  # noqa: E402
from tests.oracle import RandomProblem, random_axis, random_problem  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _has_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


needs_interpreter = pytest.mark.skipif(not (INTERPRET and _has_triton()),
                                       reason="Triton kernels are checked on CPU under TRITON_INTERPRET=1")
gpu = pytest.mark.gpu


# Every buffer allocated with torch.empty starts as NaN: unwritten output elements fail.
pytestmark = pytest.mark.usefixtures("poison_torch_empty")


def _params(p):
    return make_params(p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)


def _fixed(spatial, K, s=1, d=1, causal=False, rpb=True, heads=2, heads_kv=2, batch=2):
    rank = len(spatial)
    per = lambda x: x if isinstance(x, tuple) else (x,) * rank  # noqa: E731
    return RandomProblem(tuple(spatial), per(K), per(s), per(d), per(causal), batch, heads, heads_kv, 5, 6,
                         rpb and not any(per(causal)))


FIXED = {
    "borders_1d": _fixed((13,), 5),
    "even_kernel_2d": _fixed((8, 9), (4, 6)),
    "self_attention_kernel_equals_length": _fixed((6, 5), (6, 5)),
    "kernel_one": _fixed((7, 4), 1),
    "blocked_stride_equals_kernel": _fixed((12, 9), 3, s=3),
    "dilation_uneven_groups": _fixed((11, 7), (3, 2), d=(3, 2)),
    "causal_time_3d": _fixed((5, 6, 6), (3, 3, 3), causal=(True, False, False), rpb=False),
    "causal_stride_dilation": _fixed((17,), 5, s=3, d=2, causal=True, rpb=False),
    "mqa": _fixed((9, 9), 3, heads=4, heads_kv=1),
    "long_1d_many_tiles": _fixed((150,), 9, s=2, heads=2, heads_kv=1, batch=1),
}


# --------------------------------------------------------------------------------------------
# Tile tables
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_axis_tables_cover_windows_and_invert_exactly(seed):
    rng = random.Random(seed)
    L, K, s, d, causal = random_axis(rng)
    tile = rng.choice([1, 2, 4, 8])
    i = torch.arange(L)
    g, ig, start, stop = axis_window(i, L, K, s, d, causal)
    start = torch.as_tensor(start).expand(L)
    for grp in tiles.axis_groups(L, K, s, d, causal):  # windows are monotone inside a group
        assert bool((grp.start[1:] >= grp.start[:-1]).all()) and bool((grp.stop[1:] >= grp.stop[:-1]).all())
    seen = torch.zeros(L, dtype=torch.long)
    for row in tiles.axis_query_tiles(L, K, s, d, causal, tile).tolist():
        origin, first, count, h_origin, h_start, h_len = row
        qs = origin + d * torch.arange(count)
        seen[qs] += 1
        assert bool((g[qs] == origin % d).all()) and h_origin == h_start * d + origin % d
        # halo [h_start, h_start + h_len) is exactly the union of the tile's windows
        assert int(start[qs].min()) == h_start and int(stop[qs].max()) == h_start + h_len
    assert bool((seen == 1).all()), "every query is in exactly one tile"
    seen.zero_()
    for row in tiles.axis_key_tiles(L, K, s, d, causal, tile).tolist():
        origin, first, count, r_origin, r_start, r_len = row
        keys_g = first + torch.arange(count)
        seen[origin + d * torch.arange(count)] += 1
        grp = origin % d
        members = (g == grp) & (ig >= 0)
        meets = members & (start <= keys_g.max()) & (stop > keys_g.min())  # brute-force inverse neighborhood
        expected = ig[meets]
        assert r_len == len(expected)
        if r_len:
            assert r_start == int(expected.min()) and r_start + r_len - 1 == int(expected.max())
            assert r_origin == r_start * d + grp
    assert bool((seen == 1).all()), "every key is in exactly one key tile"


def test_kernel_tile_shape_powers_of_two_within_groups():
    p3 = tiles.pad_to_3d(make_params((56, 56), 7, 1, 8, False))
    assert tiles.kernel_tile_shape(p3) == (1, 8, 8)  # groups of 7: no 16-wide tile
    p3 = tiles.pad_to_3d(make_params((300,), 7))
    assert tiles.kernel_tile_shape(p3) == (1, 1, 64)
    p3 = tiles.pad_to_3d(make_params((3, 2), (3, 1)))
    shape = tiles.kernel_tile_shape(p3)
    assert shape[0] == 1 and shape[1] * shape[2] >= 16


# --------------------------------------------------------------------------------------------
# Operators against a brute-force gather (float64)
# --------------------------------------------------------------------------------------------


def _brute(params, heads_kv, a=None, b=None, w=None, v=None, x=None):
    """PN / NN / IN by gathering every slot's key (float64, small problems only)."""
    key, valid, _ = neighbor_table(params)
    heads = (a if a is not None else w).shape[2]
    hk = torch.arange(heads) // (heads // heads_kv)
    out = {}
    if a is not None:
        out["pn"] = torch.einsum("bnhd,bnwhd->bnhw", a, b[:, key][:, :, :, hk]).masked_fill(
            ~valid[None, :, None, :], float("-inf"))
    if w is not None:
        wm = w.masked_fill(~valid[None, :, None, :], 0.0)
        out["nn"] = torch.einsum("bnhw,bnwhd->bnhd", wm, v[:, key][:, :, :, hk])
        contrib = torch.einsum("bnhw,bnhd->bnwhd", wm, x)
        acc = torch.zeros(x.shape[0], x.shape[1], heads_kv, x.shape[-1], dtype=x.dtype)
        for h in range(heads):
            acc[:, :, hk[h]].index_add_(1, key.reshape(-1), contrib[:, :, :, h].reshape(x.shape[0], -1, x.shape[-1]))
        out["in"] = acc
    return out


def _operator_case(p, impl, gen, dtype=torch.float64, tol=1e-10):
    params = _params(p)
    B, N, W = p.batch, params.num_tokens, params.window_size
    r = lambda *s: torch.randn(*s, dtype=dtype, generator=gen)  # noqa: E731
    a, b = r(B, N, p.heads, p.dim), r(B, N, p.heads_kv, p.dim)
    w, v, x = r(B, N, p.heads, W), r(B, N, p.heads_kv, p.dim_v), r(B, N, p.heads, p.dim_v)
    ref = _brute(params, p.heads_kv, a.double(), b.double(), w.double(), v.double(), x.double())
    got_pn = impl.pn(a, b, params)
    assert torch.equal(torch.isinf(got_pn), torch.isinf(ref["pn"]))
    fin = torch.isfinite(ref["pn"])
    assert (got_pn.double()[fin] - ref["pn"][fin]).abs().max() <= tol
    assert (impl.nn(w, v, params).double() - ref["nn"]).abs().max() <= tol
    assert (impl.inn(w, x, params, p.heads_kv).double() - ref["in"]).abs().max() <= tol
    # lse mode and the dS epilogue against their definitions
    lse, delta = r(B, N, p.heads), r(B, N, p.heads)
    prob = torch.exp(w - lse[..., None])
    assert (impl.nn(w, v, params, lse=lse) - impl.nn(prob, v, params)).abs().max() <= tol * 10
    assert (impl.inn(w, x, params, p.heads_kv, lse=lse) - impl.inn(prob, x, params, p.heads_kv)).abs().max() <= tol * 10
    dp = impl.pn(x, v, params, fill=0.0)
    expected = (prob * (dp - delta[..., None])).masked_fill(~torch.isfinite(got_pn), 0.0)
    assert (impl.pn(x, v, params, ds=(w, lse, delta)) - expected).abs().max() <= tol * 10


@pytest.mark.parametrize("seed", range(30))
def test_torch_path_operators_match_brute_force(seed):
    p = random_problem(random.Random(300 + seed), max_tokens=64)
    _operator_case(p, torch_tiled, torch.Generator().manual_seed(seed))


def test_torch_path_chunking_bounds_memory(monkeypatch):
    """A tiny chunk budget (one tile per chunk) gives the same results."""
    monkeypatch.setattr(torch_tiled, "CHUNK_BYTES", 1)
    _operator_case(FIXED["dilation_uneven_groups"], torch_tiled, torch.Generator().manual_seed(3))
    check_backend(FIXED["mqa"], "gemm", torch.float64, generator=torch.Generator().manual_seed(4))


# --------------------------------------------------------------------------------------------
# Backend against the oracle (CPU, float64: the tiled PyTorch path)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(60))
def test_backend_random_problems_float64(seed):
    rng = random.Random(2000 + seed)
    problem = random_problem(rng)
    check_backend(problem, "gemm", torch.float64, generator=torch.Generator().manual_seed(seed),
                  extra_tokens=rng.choice([0, 0, 0, 3]))


@pytest.mark.parametrize("name", sorted(FIXED))
def test_backend_fixed_cases(name):
    check_backend(FIXED[name], "gemm", torch.float64, generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_lower_precision_cpu(dtype):
    check_backend(FIXED["even_kernel_2d"], "gemm", dtype, generator=torch.Generator().manual_seed(5))


def test_backend_is_selected_and_reports_memory(monkeypatch):
    p = FIXED["borders_1d"]
    q, k, v, _ = p.tensors(torch.float32)
    with ops.use_backend("gemm"):
        assert torch.allclose(ops.na1d(q, k, v, 5), ops.na1d(q, k, v, 5, backend="naive"), atol=1e-5)
    monkeypatch.setattr(ops.gemm, "_free_bytes", lambda device: 16)
    with pytest.raises(ValueError, match="attention weights need"):
        ops.na1d(q, k, v, 5, backend="gemm")


# --------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (tiny problems)
# --------------------------------------------------------------------------------------------

INTERPRETER_CASES = {
    "1d_causal_stride_dilation": _fixed((17,), 5, s=3, d=2, causal=True, rpb=False, batch=1),
    "2d_dilation_rpb_gqa": _fixed((7, 9), (3, 4), s=(1, 2), d=(2, 1), heads=2, heads_kv=1, batch=1),
    "3d_causal_time": _fixed((4, 5, 4), (2, 3, 3), causal=(True, False, False), rpb=False, heads=1, heads_kv=1,
                             batch=1),
}


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setattr(operators, "IMPL", "triton")
    from ops.gemm import triton_kernels  # torch.empty is poisoned (pytestmark above)

    yield triton_kernels


@needs_interpreter
@pytest.mark.parametrize("name", sorted(INTERPRETER_CASES))
def test_triton_operators_interpreted(name, force_triton):
    _operator_case(INTERPRETER_CASES[name], force_triton, torch.Generator().manual_seed(21))


@needs_interpreter
@pytest.mark.parametrize("name", sorted(INTERPRETER_CASES))
def test_triton_backend_interpreted_float64(name, force_triton):
    check_backend(INTERPRETER_CASES[name], "gemm", torch.float64, generator=torch.Generator().manual_seed(22))


@needs_interpreter
@pytest.mark.parametrize("seed", range(6))
def test_triton_backend_interpreted_random(seed, force_triton):
    rng = random.Random(4000 + seed)
    problem = random_problem(rng, max_tokens=24, max_dim=6)
    problem.batch = 1
    check_backend(problem, "gemm", torch.float64, generator=torch.Generator().manual_seed(seed))


@needs_interpreter
def test_triton_backend_interpreted_float32_rpb(force_triton):
    check_backend(_fixed((6, 6), 3, heads=2, heads_kv=2, batch=1), "gemm", torch.float32,
                  generator=torch.Generator().manual_seed(23))


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@cuda_only
@pytest.mark.parametrize("seed", range(6))
def test_gpu_backend_random_problems_float32(seed):
    rng = random.Random(7000 + seed)
    problem = random_problem(rng, max_tokens=96, max_dim=16)  # one BLOCK_D: fewer kernel compilations
    assert operators.uses_triton(torch.empty(1, device="cuda"), problem.dim, problem.dim_v)
    # float32 GEMMs run as 3xTF32: close to, but not exactly, float32 arithmetic.
    check_backend(problem, "gemm", torch.float32, device="cuda", tol=1e-3,
                  generator=torch.Generator(device="cuda").manual_seed(seed))


@gpu
@cuda_only
@pytest.mark.parametrize("name", sorted(FIXED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_backend_fixed_cases(name, dtype):
    check_backend(FIXED[name], "gemm", dtype, device="cuda", tol=1e-3 if dtype == torch.float32 else None,
                  generator=torch.Generator(device="cuda").manual_seed(31))


@gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_matches_naive_on_nat_sized_problem(dtype):
    """A NAT stage-1-like problem (many tiles, large head dim) against the naive backend on the GPU."""
    torch.manual_seed(0)
    shape = (2, 28, 28, 4, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    rpb = torch.randn(4, 13, 13, device="cuda", dtype=dtype, requires_grad=True)
    grads = {}
    outs = {}
    for backend in ("gemm", "naive"):
        out = ops.na2d(q, k, v, 7, dilation=(2, 3), rpb=rpb, backend=backend)
        outs[backend] = out.float()
        grads[backend] = [g.float() for g in torch.autograd.grad(out.float().square().sum(), (q, k, v, rpb))]
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(outs["gemm"], outs["naive"]) < tol
    for g, ref in zip(grads["gemm"], grads["naive"]):
        assert rel(g, ref) < 2 * tol


def test_second_backward_through_same_call_recomputes_the_logits():
    """dS overwrites the saved float32 logits: a second backward over the retained graph recomputes them (never
    reuses dS), so it gives the first one's gradients bitwise."""
    q, k, v = (torch.randn(1, 9, 2, 4, requires_grad=True) for _ in range(3))
    out = ops.na1d(q, k, v, 3, backend="gemm")
    first = torch.autograd.grad((out * out.detach()).sum(), (q, k, v), retain_graph=True)
    second = torch.autograd.grad((out * out.detach()).sum(), (q, k, v))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
