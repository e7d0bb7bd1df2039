"""``ops.fused.jvp.forward_tangent`` (the JVP kernel) against forward-mode AD of the dense float64 oracle.

Without CUDA the kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py before Triton is
imported) on small problems: 1-, 2- and 3-D, stride, dilation, causal axes, GQA, RPB with its tangent, Dv != D, head
dims that are not powers of two, non-square spatial shapes, and tangents given for some inputs only (None = zero).
The reference is ``torch.func.jvp`` of ``tests.oracle.oracle_attention`` in float64 at the same (rounded) inputs; one
float64 case is also checked against central finite differences of the oracle.  Tolerances, relative to the largest
reference entry: float32 1e-5 (the kernel has no matmul, so no TF32 on a GPU either), float64 1e-10, bfloat16 2e-2
(t_out is rounded to bfloat16).
Output buffers start as NaN (``poison_torch_empty``), so an unwritten element fails.
"""
import os
import random

import pytest
import torch

pytest.importorskip("triton")

from ops.fused.jvp import forward_tangent  # noqa: E402
from ops.window import NAParams  # noqa: E402
from tests.oracle import oracle_attention, random_problem  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = [pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or interpreter"),
              pytest.mark.usefixtures("poison_torch_empty")]

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
TANGENTS = ("q", "k", "v", "rpb")


def _params(spatial, K, s=1, d=1, c=False):
    tup = lambda x: tuple(x) if isinstance(x, tuple) else (x,) * len(spatial)  # noqa: E731
    return NAParams(tuple(spatial), tup(K), tup(s), tup(d), tuple(bool(x) for x in tup(c)))


def _problem(p: NAParams, batch, heads, heads_kv, dim, dim_v, rpb, dtype, seed):
    """Primals and tangents (all given), in ``dtype`` on the test device."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen).to(dtype).to(DEVICE)  # noqa: E731
    shape = (batch, *p.spatial)
    prim = {"q": mk(*shape, heads, dim), "k": mk(*shape, heads_kv, dim), "v": mk(*shape, heads_kv, dim_v),
            "rpb": mk(heads, *p.rpb_shape) if rpb else None}
    tan = {n: None if x is None else mk(*x.shape) for n, x in prim.items()}
    return prim, tan


def _oracle(p: NAParams, scale):
    def f(q, k, v, rpb=None):
        return oracle_attention(q, k, v, p.spatial, p.kernel_size, p.stride, p.dilation, p.is_causal, rpb=rpb,
                                scale=scale)
    return f


def _reference(p, prim, tan, given, scale):
    """(out, lse, t_out, t_lse) of the oracle in float64 on the CPU, tangents outside ``given`` zero."""
    names = [n for n in TANGENTS if prim[n] is not None]
    primals = tuple(prim[n].detach().double().cpu() for n in names)
    tangents = tuple(tan[n].double().cpu() if n in given else torch.zeros_like(x) for n, x in zip(names, primals))
    (out, lse), (t_out, t_lse) = torch.func.jvp(_oracle(p, scale), primals, tangents)
    return out, lse, t_out, t_lse


def _call(p, prim, tan, given, out, lse, scale):
    dtype = prim["q"].dtype
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    t = {n: tan[n] if n in given else None for n in TANGENTS}
    return forward_tangent(prim["q"], prim["k"], prim["v"], prim["rpb"], t["q"], t["k"], t["v"], t["rpb"],
                           out.to(dtype).to(DEVICE), lse.to(lse_dtype).to(DEVICE), p, scale)


def _rel_err(got, ref):
    got = got.double().cpu()
    assert torch.isfinite(got).all(), "non-finite values (unwritten output?)"
    return ((got - ref).abs().max() / ref.abs().max()).item()


def check(p, batch=1, heads=2, heads_kv=1, dim=5, dim_v=3, rpb=False, given=TANGENTS, dtype=torch.float32, seed=0,
          scale=None):
    scale = dim ** -0.5 if scale is None else scale
    prim, tan = _problem(p, batch, heads, heads_kv, dim, dim_v, rpb, dtype, seed)
    out, lse, ref_out, ref_lse = _reference(p, prim, tan, given, scale)
    t_out, t_lse = _call(p, prim, tan, given, out, lse, scale)
    assert t_out.shape == out.shape and t_out.dtype == dtype and t_out.device.type == DEVICE
    assert t_lse.shape == lse.shape and t_lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert ref_out.abs().max() > 0 and t_out.abs().max() > 0, "zero tangent: the test would pass on anything"
    err_out, err_lse = _rel_err(t_out, ref_out), _rel_err(t_lse, ref_lse) if ref_lse.abs().max() > 0 else 0.0
    assert err_out < TOL[dtype], f"t_out: relative error {err_out:.2e}"
    assert err_lse < TOL[dtype], f"t_lse: relative error {err_lse:.2e}"
    moves_logits = any(n in given and prim[n] is not None for n in ("q", "k", "rpb"))
    assert (t_lse.abs().max() > 0) == moves_logits  # exactly zero when only tv is given
    return t_out, t_lse


# ------------------------------------------------------------------------------------------------
# Window rules
# ------------------------------------------------------------------------------------------------
def test_1d_stride_dilation_rpb():
    check(_params((17,), 5, s=2, d=2), heads=2, heads_kv=2, rpb=True)


def test_1d_causal_gqa_two_row_blocks():
    """70 queries: two programs per head at these head dims, the second one partly past the end."""
    check(_params((70,), 4, s=3, d=2, c=True), heads=4, heads_kv=2, dim=6, dim_v=7)


def test_2d_nonsquare_causal_axis_gqa():
    check(_params((5, 7), (3, 4), s=(1, 2), d=(1, 1), c=(False, True)), heads=3, heads_kv=1, dim=7, dim_v=5)
    check(_params((7, 5), (4, 3), s=(3, 1), d=(1, 1), c=(True, False)), heads=2, heads_kv=1, dim=7, dim_v=5)


def test_2d_dilation_rpb():
    check(_params((6, 9), (3, 3), s=(2, 1), d=(2, 3)), rpb=True, dim=3, dim_v=6, batch=2, heads=2, heads_kv=1)


def test_3d_causal_stride():
    check(_params((3, 4, 5), (2, 3, 3), s=(1, 2, 3), c=(True, False, False)), dim=4, dim_v=4)
    check(_params((4, 5, 3), (3, 3, 2), s=(2, 2, 1), d=(1, 1, 1), c=(False, True, True)), dim=4, dim_v=4)


def test_3d_dilation_rpb():
    check(_params((4, 3, 5), (2, 3, 2), d=(2, 1, 2), s=(1, 3, 2)), rpb=True, heads=2, heads_kv=2, dim=3, dim_v=2)


def test_kernel_covers_axis():
    """K == L (every query sees every key) and K == 1 on another axis."""
    check(_params((4, 6), (4, 1)), rpb=True)


@pytest.mark.parametrize("rank,seed", [(1, 11), (2, 26), (3, 13)])  # (3, 13): K = 1 on every axis
def test_random_problem(rank, seed):
    """Random problems of tests/oracle.py: any K from 1 to L, stride, dilation, causal flags, GQA and RPB."""
    rp = random_problem(random.Random(seed), rank=rank, max_tokens=48, max_dim=8)
    p = NAParams(rp.spatial, rp.kernel_size, rp.stride, rp.dilation, rp.causal)
    check(p, batch=rp.batch, heads=rp.heads, heads_kv=rp.heads_kv, dim=rp.dim, dim_v=rp.dim_v, rpb=rp.use_rpb,
          seed=seed)


# ------------------------------------------------------------------------------------------------
# Partial tangents, float64, finite differences
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given", [("q",), ("k",), ("v",), ("rpb",), ("k", "rpb"), ("q", "v")],
                         ids=lambda g: "+".join(g))
def test_some_tangents_none(given):
    check(_params((5, 6), (3, 3), s=(1, 2), d=(1, 2)), rpb=True, heads=2, heads_kv=1, given=given, seed=1)


def test_all_tangents_none_is_zero():
    p = _params((9,), 3)
    prim, _ = _problem(p, 1, 2, 1, 4, 4, True, torch.float32, 2)
    out, lse = _oracle(p, 0.5)(*(prim[n].double().cpu() for n in TANGENTS))
    t_out, t_lse = _call(p, prim, {n: None for n in TANGENTS}, (), out, lse, 0.5)
    assert (t_out == 0).all() and (t_lse == 0).all()


def test_float64_exact():
    check(_params((6, 5), (3, 2), s=(2, 1), d=(2, 1), c=(False, True)), heads=2, heads_kv=1, dtype=torch.float64,
          scale=0.37)


def test_float64_finite_differences():
    """Central differences of the oracle along the tangent, independent of torch's forward-mode rules."""
    p = _params((7,), 3, s=2, d=2)
    prim, tan = _problem(p, 1, 2, 1, 4, 3, True, torch.float64, 4)
    f = _oracle(p, 0.5)
    x = [prim[n].cpu() for n in TANGENTS]
    dx = [tan[n].cpu() for n in TANGENTS]
    eps = 1e-6
    plus = f(*(a + eps * b for a, b in zip(x, dx)))
    minus = f(*(a - eps * b for a, b in zip(x, dx)))
    fd_out, fd_lse = ((a - b) / (2 * eps) for a, b in zip(plus, minus))
    out, lse = f(*x)
    t_out, t_lse = _call(p, prim, tan, TANGENTS, out, lse, 0.5)
    assert fd_out.abs().max() > 0 and t_out.abs().max() > 0
    assert _rel_err(t_out, fd_out) < 1e-7
    assert _rel_err(t_lse, fd_lse) < 1e-7


def test_shared_shift_of_the_logits():
    """A bias tangent equal on every slot moves every logit alike: t_lse is that shift and t_out is zero.  Summed as
    E[tS v] - E[tS] E[v], float32 would leave about 1e4 * 6e-8 of cancellation; the kernel's sums relative to slot 0's
    tS leave none."""
    p = _params((6, 5), (3, 3))
    prim, tan = _problem(p, 1, 2, 1, 4, 3, True, torch.float32, 5)
    shift = torch.tensor([1e4, -3e4]).view(2, 1, 1)
    tan["rpb"] = torch.ones_like(prim["rpb"]) * shift.to(DEVICE)
    out, lse = _oracle(p, 0.5)(*(prim[n].double().cpu() for n in TANGENTS))
    t_out, t_lse = _call(p, prim, tan, ("rpb",), out, lse, 0.5)
    assert t_out.abs().max() < 1e-6
    assert torch.equal(t_lse.cpu(), shift.view(1, 1, 1, 2).expand(1, 6, 5, 2))


def test_strided_inputs_and_lse_from_elsewhere():
    """Non-contiguous q / k / v / tangents (views of packed tensors), and a strided lse a little off (as one rounded
    coarsely, or summed in another order, would be): the kernel normalises its weights itself."""
    p = _params((5, 6), (3, 3), s=(2, 1))
    gen = torch.Generator().manual_seed(6)
    # [primal / tangent, B, *spatial, q / k / v, H, D]
    packed = torch.randn(2, 1, 5, 6, 3, 2, 8, dtype=torch.float64, generator=gen)
    (q, k, v), (tq, tk, tv) = (x.unbind(-3) for x in packed.float().to(DEVICE).unbind(0))
    v = v[..., :5]
    tv = tv[..., :5]
    prim, tan = {"q": q, "k": k, "v": v, "rpb": None}, {"q": tq, "k": tk, "v": tv, "rpb": None}
    out, lse, ref_out, ref_lse = _reference(p, prim, tan, TANGENTS, 0.3)
    lse = (lse + 1e-2 * torch.rand(lse.shape, dtype=lse.dtype, generator=gen)).float().to(DEVICE)
    lse = lse.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not lse.is_contiguous()
    t_out, t_lse = _call(p, prim, tan, TANGENTS, out, lse, 0.3)
    assert _rel_err(t_out, ref_out) < TOL[torch.float32]
    assert _rel_err(t_lse, ref_lse) < TOL[torch.float32]


# ------------------------------------------------------------------------------------------------
# Argument checks
# ------------------------------------------------------------------------------------------------
def test_argument_errors():
    p = _params((6, 5), (3, 3))
    prim, tan = _problem(p, 1, 2, 1, 4, 3, True, torch.float32, 7)
    q, k, v, rpb = (prim[n] for n in TANGENTS)
    out = torch.zeros(1, 6, 5, 2, 3, device=DEVICE)
    lse = torch.zeros(1, 6, 5, 2, device=DEVICE)

    def call(**over):
        a = dict(q=q, k=k, v=v, rpb=rpb, tq=tan["q"], tk=tan["k"], tv=tan["v"], trpb=tan["rpb"], out=out, lse=lse,
                 params=p, scale=0.5)
        a.update(over)
        return forward_tangent(**a)

    cases = [
        (dict(tq=tan["q"][..., :3]), "tq: expected shape"),
        (dict(tk=tan["k"][:, :5]), "tk: expected shape"),
        (dict(tv=tan["v"][..., :2]), "tv: expected shape"),
        (dict(trpb=tan["rpb"][:, :3]), "trpb: expected shape"),
        (dict(rpb=None), "trpb: given without rpb"),
        (dict(rpb=rpb[:1]), "rpb: expected shape"),
        (dict(k=torch.randn(1, 6, 5, 2, 3, device=DEVICE)), "k: expected shape"),
        (dict(k=torch.randn(1, 6, 5, 3, 4, device=DEVICE), tk=None), "k: key/value heads (3) must divide"),
        (dict(v=v.double(), tv=None), "v: dtype"),
        (dict(out=out[..., :2]), "out: expected shape"),
        (dict(lse=lse[..., 0]), "lse: expected shape"),
        (dict(lse=None), "lse: expected the primal lse"),
        (dict(q=q[:, :5], tq=None), "q: spatial shape"),
        (dict(q=q.int(), tq=None), "q: dtype"),
        (dict(params=_params((6, 5), (3, 3), c=(True, False))), "rpb: not defined on causal axes"),
        (dict(params=(6, 5)), "params: expected"),
        (dict(scale=float("nan")), "scale: expected a finite number"),
    ]
    for over, message in cases:
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            call(**over)


# ------------------------------------------------------------------------------------------------
# GPU (compiled kernel; pytest -m gpu tests/test_fused_jvp.py on a CUDA machine)
# ------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA (compiled kernel)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu(dtype):
    """Larger problems than the interpreter affords: head dims 64 / 80 / 128, long windows, every feature."""
    check(_params((40, 36), (13, 9), s=(2, 1), d=(1, 2)), heads=4, heads_kv=2, dim=64, dim_v=80, rpb=True,
          batch=2, dtype=dtype)
    check(_params((8, 12, 10), (3, 5, 4), s=(2, 1, 3), d=(1, 2, 1), c=(True, False, False)), heads=4, heads_kv=1,
          dim=128, dim_v=128, dtype=dtype)
    check(_params((300,), 33, s=4, d=3, c=True), heads=2, heads_kv=2, dim=96, dim_v=32, dtype=dtype,
          given=("k", "v"))
