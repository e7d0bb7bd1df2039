"""Unfused API ``ops.na*_qk`` / ``ops.na*_av``: the attention weights themselves, against the oracle.

The expected slot order is rebuilt here from ``tests.oracle`` (per-axis admitted keys in ascending
order, row-major over axes, empty causal slots last), independently of ``ops.window``.
"""
import itertools
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels must be created in interpreter mode: before triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ops  # noqa: E402
from ops.gemm import operators  # noqa: E402
from tests.oracle import (  # noqa: E402
    RandomProblem, _axis_keys, dense_mask_and_bias_index, oracle_attention, random_problem,
)


# Every buffer allocated with torch.empty starts as NaN: unwritten output elements fail.
pytestmark = pytest.mark.usefixtures("poison_torch_empty")


def oracle_slots(p: RandomProblem) -> torch.Tensor:
    """[N, W] flat key index of every window slot (-1: empty causal slot), from the oracle's rules."""
    per_axis = []
    for L, K, s, d, c in zip(p.spatial, p.kernel_size, p.stride, p.dilation, p.causal):
        rows = []
        for i in range(L):
            keys = sorted(_axis_keys(i, L, K, s, d, c))
            rows.append(keys + [None] * (K - len(keys)))
        per_axis.append(rows)
    table = []
    for qc in itertools.product(*[range(L) for L in p.spatial]):
        slots = []
        for kc in itertools.product(*[per_axis[a][qc[a]] for a in range(len(p.spatial))]):
            if any(x is None for x in kc):
                slots.append(-1)
                continue
            flat = 0
            for x, L in zip(kc, p.spatial):
                flat = flat * L + x
            slots.append(flat)
        table.append(slots)
    return torch.tensor(table)


def dense_logits(p, q, k, rpb):
    """Oracle logits [B, H, N, N] (no scale), -inf outside the neighborhood, float64."""
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    N = q[0, ..., 0, 0].numel()
    mask, rel = dense_mask_and_bias_index(p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    kf = k.double().reshape(B, N, p.heads_kv, D).repeat_interleave(H // p.heads_kv, dim=2)
    logits = torch.einsum("bnhd,bmhd->bhnm", q.double().reshape(B, N, H, D), kf)
    if rpb is not None:
        for (qi, kj), idx in rel.items():
            logits[:, :, qi, kj] += rpb.double()[(slice(None), *idx)]
    return logits.masked_fill(~mask, float("-inf"))


def _inputs(p, gen, dtype=torch.float64, device="cpu"):
    q, k, v, rpb = p.tensors(dtype=dtype, device=device, generator=gen)
    return q, k, v, rpb


@pytest.mark.parametrize("seed", range(30))
def test_weights_are_the_oracle_attention_matrix_restricted_to_the_window(seed):
    p = random_problem(random.Random(600 + seed), max_tokens=64)
    rank = len(p.spatial)
    q, k, v, rpb = _inputs(p, torch.Generator().manual_seed(seed))
    logits = ops.na_qk(rank, q, k, **p.kwargs(), rpb=rpb)
    B, H = p.batch, p.heads
    N = logits[0, ..., 0, 0].numel()
    W = logits.shape[-1]
    assert logits.shape == (*q.shape[:-1], W) and W == torch.tensor(p.kernel_size).prod()
    slots = oracle_slots(p)  # [N, W]
    dense = dense_logits(p, q, k, rpb)  # [B, H, N, N]
    flat = logits.reshape(B, N, H, W).permute(0, 2, 1, 3)  # [B, H, N, W]
    empty = slots < 0
    expected = torch.gather(dense, -1, slots.clamp(min=0).expand(B, H, N, W)).masked_fill(empty, float("-inf"))
    assert torch.equal(torch.isinf(flat), empty.expand_as(flat)), "empty slots must be exactly the -inf ones"
    assert (flat[~empty.expand_as(flat)] - expected[~empty.expand_as(flat)]).abs().max() <= 1e-10
    # softmax over the window == the oracle's attention matrix at those keys, and holds all its mass
    attn = torch.softmax(flat, dim=-1)
    p_dense = torch.softmax(dense, dim=-1)
    picked = torch.gather(p_dense, -1, slots.clamp(min=0).expand(B, H, N, W)).masked_fill(empty, 0.0)
    assert (attn - picked).abs().max() <= 1e-12
    assert (picked.sum(-1) - 1).abs().max() <= 1e-12


@pytest.mark.parametrize("seed", range(20))
def test_av_applies_weights_to_the_window_values(seed):
    p = random_problem(random.Random(700 + seed), max_tokens=64)
    rank = len(p.spatial)
    gen = torch.Generator().manual_seed(seed)
    _, _, v, _ = _inputs(p, gen)
    W = int(torch.tensor(p.kernel_size).prod())
    attn = torch.randn(*v.shape[:-2], p.heads, W, dtype=torch.float64, generator=gen)
    out = ops.na_av(rank, attn, v, **p.kwargs())
    B, N = p.batch, v[0, ..., 0, 0].numel()
    slots = oracle_slots(p)
    vf = v.reshape(B, N, p.heads_kv, -1).repeat_interleave(p.heads // p.heads_kv, dim=2)
    gathered = vf[:, slots.clamp(min=0)]  # [B, N, W, H, Dv]
    weights = attn.reshape(B, N, p.heads, W).masked_fill((slots < 0)[None, :, None, :], 0.0)
    expected = torch.einsum("bnhw,bnwhd->bnhd", weights, gathered)
    assert out.shape == (*attn.shape[:-1], p.dim_v)
    assert (out.reshape(B, N, p.heads, -1) - expected).abs().max() <= 1e-10


@pytest.mark.parametrize("seed", range(25))
def test_qk_softmax_av_matches_oracle_forward_and_backward(seed):
    rng = random.Random(800 + seed)
    p = random_problem(rng)
    rank = len(p.spatial)
    q, k, v, rpb = p.tensors(generator=torch.Generator().manual_seed(seed), requires_grad=True)
    scale = p.dim ** -0.5
    attn = torch.softmax(ops.na_qk(rank, q * scale, k, **p.kwargs(), rpb=rpb), dim=-1)
    out = ops.na_av(rank, attn, v, **p.kwargs())
    inputs = [t for t in (q, k, v, rpb) if t is not None]
    ref_in = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref_out, _ = oracle_attention(*ref_in[:3], p.spatial, p.kernel_size, p.stride, p.dilation, p.causal,
                                  ref_in[3] if rpb is not None else None)
    assert (out - ref_out).abs().max() <= 1e-10
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad((out * g).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), ref_in)
    for got, ref in zip(grads, ref_grads):
        assert (got - ref).abs().max() <= 1e-9 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("case", [
    dict(spatial=(7,), K=3, s=2, d=2, causal=True, heads=(2, 1)),
    dict(spatial=(4, 5), K=(2, 3), s=(1, 2), d=(2, 1), causal=False, heads=(2, 2), rpb=True),
    dict(spatial=(3, 4, 3), K=(2, 2, 3), s=1, d=1, causal=(True, False, False), heads=(1, 1)),
])
def test_gradcheck(case):
    rank = len(case["spatial"])
    hq, hkv = case["heads"]
    gen = torch.Generator().manual_seed(3)
    shape = (1, *case["spatial"])
    kw = dict(kernel_size=case["K"], stride=case["s"], dilation=case["d"], is_causal=case["causal"])
    q = torch.randn(*shape, hq, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(*shape, hkv, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(*shape, hkv, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    K = case["K"] if isinstance(case["K"], tuple) else (case["K"],) * rank
    rpb = None
    if case.get("rpb"):
        rpb = torch.randn(hq, *[2 * x - 1 for x in K], dtype=torch.float64, generator=gen, requires_grad=True)
    empty = torch.isinf(ops.na_qk(rank, q, k, **kw))

    def qk(q, k, *maybe_rpb):
        return ops.na_qk(rank, q, k, **kw, rpb=maybe_rpb[0] if maybe_rpb else None).masked_fill(empty, 0.0)

    assert torch.autograd.gradcheck(qk, (q, k) + ((rpb,) if rpb is not None else ()), fast_mode=True)
    attn = torch.randn(empty.shape, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, v: ops.na_av(rank, a, v, **kw), (attn, v), fast_mode=True)
    # no gradient flows into empty causal slots
    (g,) = torch.autograd.grad(ops.na_av(rank, attn, v, **kw).sum(), attn)
    assert bool((g[empty] == 0).all())


def test_wrappers_and_lower_precision():
    gen = torch.Generator().manual_seed(0)
    for rank, fn_qk, fn_av in ((1, ops.na1d_qk, ops.na1d_av), (2, ops.na2d_qk, ops.na2d_av),
                               (3, ops.na3d_qk, ops.na3d_av)):
        spatial = (6,) * rank
        q, k, v = (torch.randn(2, *spatial, 2, 8, generator=gen) for _ in range(3))
        logits = fn_qk(q * 8 ** -0.5, k, 3, dilation=2)
        out = fn_av(torch.softmax(logits, -1), v, 3, dilation=2)
        ref = ops.neighborhood_attention(rank, q, k, v, 3, dilation=2, backend="naive")
        assert torch.allclose(out, ref, atol=1e-5)
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        lb = fn_qk(qb * 8 ** -0.5, kb, 3, dilation=2)
        assert lb.dtype == torch.bfloat16
        ob = fn_av(torch.softmax(lb.float(), -1).bfloat16(), vb, 3, dilation=2)
        assert ob.dtype == torch.bfloat16 and (ob.float() - ref).abs().max() < 5e-2


def test_module_attention_dropout_path_uses_weights():
    """NeighborhoodAttention2D's attention-dropout path (na_qk -> softmax -> na_av) equals its fused path."""
    torch.manual_seed(0)
    m = ops.NeighborhoodAttention2D(16, 2, 5, dilation=2, rel_pos_bias=True)
    with torch.no_grad():
        m.rpb.normal_()
    x = torch.randn(2, 12, 11, 16)
    q, k, v = m.qkv(x).reshape(2, 12, 11, 3, 2, 8).unbind(-3)
    via_weights = m._forward_with_weights(q, k, v)
    direct = ops.na2d(q, k, v, 5, dilation=2, rpb=m.rpb, backend="naive")
    assert torch.allclose(via_weights, direct, atol=1e-5)
    m.attn_drop.p = 0.5
    m.train()
    y = m(x)
    y.sum().backward()
    assert y.shape == x.shape and m.rpb.grad is not None and torch.isfinite(m.rpb.grad).all()


def test_docstring_example():
    from ops.functional import make_params
    from ops.window import neighbor_table

    q = k = v = torch.randn(1, 32, 32, 2, 16)
    logits = ops.na2d_qk(q * 16 ** -0.5, k, kernel_size=7, dilation=2)
    attn = logits.softmax(dim=-1)
    out = ops.na2d_av(attn, v, kernel_size=7, dilation=2)
    assert torch.allclose(out, ops.na2d(q, k, v, 7, dilation=2, backend="naive"), atol=1e-5)
    params = make_params((32, 32), 7, 1, 2, False)
    keys, valid, _ = neighbor_table(params, queries=torch.tensor([5 * 32 + 20]))
    heat = torch.zeros(32 * 32)
    heat[keys[0][valid[0]]] = attn[0, 5, 20, 0][valid[0]]
    heat = heat.reshape(32, 32)
    assert abs(heat.sum().item() - 1) < 1e-5 and int((heat > 0).sum()) == 49
    assert heat[5, 20] > 0 and heat[5, 21] == 0  # dilation 2: only every other pixel


@pytest.mark.parametrize("call, match", [
    (lambda q, k, a, v: ops.na2d_av(a[..., :-1], v, 3), "attn"),
    (lambda q, k, a, v: ops.na2d_qk(q[..., :3, :], k, 3), "heads"),
    (lambda q, k, a, v: ops.na2d_qk(q, k, 5, dilation=2), "kernel_size"),
    (lambda q, k, a, v: ops.na2d_qk(q, k, 3, stride=4), "stride"),
    (lambda q, k, a, v: ops.na2d_qk(q, k.double(), 3), "dtype"),
    (lambda q, k, a, v: ops.na2d_qk(q, k[..., :2], 3), "head dim"),
    (lambda q, k, a, v: ops.na2d_qk(q, k, 3, is_causal=True, rpb=torch.zeros(4, 5, 5)), "rpb"),
    (lambda q, k, a, v: ops.na2d_qk(q, k, 3, rpb=torch.zeros(4, 3, 3)), "rpb"),
    (lambda q, k, a, v: ops.na2d_qk(q[0], k[0], 3), "query"),
    (lambda q, k, a, v: ops.na2d_av(a, v[:, :4], 3), "spatial shape"),
    (lambda q, k, a, v: ops.na2d_qk(q, k, (3, 3, 3)), "kernel_size"),
])
def test_bad_arguments_raise_value_error_naming_them(call, match):
    q = torch.randn(1, 6, 6, 4, 8)
    k = torch.randn(1, 6, 6, 2, 8)
    a = torch.randn(1, 6, 6, 4, 9)
    v = torch.randn(1, 6, 6, 2, 5)
    with pytest.raises(ValueError, match=match):
        call(q, k, a, v)


def _has_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _has_triton(), reason="Triton kernels are checked on CPU under TRITON_INTERPRET=1")
def test_unfused_through_interpreted_triton_kernels(monkeypatch):
    p = RandomProblem((5, 6), (3, 3), (1, 2), (1, 2), (False, False), 1, 2, 1, 4, 3, True)
    q, k, v, rpb = p.tensors(generator=torch.Generator().manual_seed(1), requires_grad=True)
    results = {}
    for impl in ("torch", "triton"):
        monkeypatch.setattr(operators, "IMPL", impl)
        attn = torch.softmax(ops.na2d_qk(q, k, **p.kwargs(), rpb=rpb), -1)
        out = ops.na2d_av(attn, v, **p.kwargs())
        results[impl] = [out, attn] + list(torch.autograd.grad(out.square().sum(), (q, k, v, rpb)))
    for a, b in zip(results["torch"], results["triton"]):
        assert (a - b).abs().max() <= 1e-10


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_unfused_matches_oracle(seed, dtype):
    rng = random.Random(900 + seed)
    p = random_problem(rng, max_dim=16)
    rank = len(p.spatial)
    q, k, v, rpb = p.tensors(dtype=dtype, device="cuda", generator=torch.Generator("cuda").manual_seed(seed),
                             requires_grad=True)
    scale = p.dim ** -0.5
    logits = ops.na_qk(rank, q * scale, k, **p.kwargs(), rpb=rpb)
    assert logits.is_cuda and logits.dtype == dtype
    attn = torch.softmax(logits.float(), dim=-1).to(dtype)
    out = ops.na_av(rank, attn, v, **p.kwargs())
    inputs = [t for t in (q, k, v, rpb) if t is not None]
    ref_in = [t.detach().cpu().double().requires_grad_(True) for t in inputs]
    ref_out, _ = oracle_attention(*ref_in[:3], p.spatial, p.kernel_size, p.stride, p.dilation, p.causal,
                                  ref_in[3] if rpb is not None else None)
    tol = 2e-3 if dtype == torch.float32 else 6e-2
    assert (out.detach().cpu().double() - ref_out).abs().max() <= tol
    g = torch.randn(out.shape, dtype=dtype, device="cuda")
    grads = torch.autograd.grad((out.float() * g.float()).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_out * g.cpu().double()).sum(), ref_in)
    for got, ref in zip(grads, ref_grads):
        assert (got.cpu().double() - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())


def test_example_script_writes_png(tmp_path, monkeypatch):
    import runpy
    import sys
    from pathlib import Path

    out = tmp_path / "weights.png"
    script = Path(__file__).resolve().parents[1] / "examples" / "attention_weights.py"
    monkeypatch.setattr(sys, "argv", ["attention_weights.py", "--random", "--size", "32", "--query", "5", "7",
                                      "--kernel-size", "7", "--out", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_torch_compile_runs_gemm_and_unfused_eagerly():
    """torch.compile (not fullgraph) falls back to eager around the gemm backend and na_qk/na_av."""
    torch.manual_seed(0)
    m = ops.NeighborhoodAttention2D(16, 2, 5, dilation=2, rel_pos_bias=True, backend="gemm")
    x = torch.randn(2, 12, 11, 16)
    y = torch.compile(m, backend="eager")(x)
    y.sum().backward()
    assert torch.allclose(y, m(x), atol=1e-6) and m.rpb.grad is not None
    m.attn_drop.p = 0.3
    m.train()
    assert torch.compile(m, backend="eager")(x).shape == x.shape
