"""Differentiation beyond first-order reverse mode, through every backend (``ops.autodiff``): a double backward,
forward-mode AD and ``torch.func`` transforms either give exactly what the dense-mask oracle (tests/oracle.py,
plain differentiable torch) gives, or raise a ``RuntimeError`` naming the backend and what it refuses; never a
silently dropped second-order term or tangent.  Also: ``gemm`` serves several backwards over a retained graph (so
``gradcheck``), and the backends propagate meta tensors' shapes.

The checks take either outcome, so they hold unchanged once a backend implements a mode.  ``fused`` runs in
Triton's interpreter on CPU (TRITON_INTERPRET=1, set before ops is imported); ``flex`` serves no gradient on CPU.
"""
import os
import re

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of triton code
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.autograd.forward_ad as fwAD  # noqa: E402

import ops  # noqa: E402
from tests.oracle import oracle_attention  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FUSED_DEVICE = "cpu" if INTERPRETED else "cuda"


def _has_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


needs_fused = pytest.mark.skipif(not _has_triton() or not (INTERPRETED or torch.cuda.is_available()),
                                 reason="fused needs Triton and CUDA or TRITON_INTERPRET=1")
FUSED = pytest.param("fused", marks=needs_fused)
GRAD_BACKENDS = ["naive", "gemm", FUSED]  # the backends with a backward on CPU
ALL_BACKENDS = [*GRAD_BACKENDS, "flex"]

SPATIAL, K = (4, 6), (3, 3)
NO = (False, False)


def _device(backend):
    return FUSED_DEVICE if backend == "fused" else "cpu"


def _dtype(backend):
    return torch.float32 if backend in ("fused", "flex") else torch.float64


def _randn(backend, *shape, seed, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen, dtype=torch.float64).to(_dtype(backend)).to(_device(backend))
    return t.requires_grad_(requires_grad)


def _attend(backend):
    """``(q, k, v, rpb) -> out`` of the backend, or of the oracle for ``backend="oracle"``."""
    if backend == "oracle":
        return lambda q, k, v, rpb=None: oracle_attention(q, k, v, SPATIAL, K, (1, 1), (1, 1), NO, rpb=rpb)[0]
    return lambda q, k, v, rpb=None: ops.na2d(q, k, v, K, rpb=rpb, backend=backend)


def _reference(t):
    """The oracle's copy of a backend's input: float64 on the CPU, a leaf like the input."""
    if t is None:
        return None
    return t.detach().double().cpu().requires_grad_(t.requires_grad)


def _exact_or_refused(run, reference, backend, refusal):
    """``run(attend)`` through the backend either raises a RuntimeError that names the backend and the refused mode
    (``refusal``, a regular expression), or returns what ``reference(oracle)`` returns (tensors or None)."""
    try:
        got = run(_attend(backend))
    except RuntimeError as err:
        assert re.search(rf"{backend} backend: {refusal}", str(err)), f"unclear refusal: {err}"
        return
    want = reference(_attend("oracle"))
    assert len(got) == len(want)
    tol = 1e-9 if _dtype(backend) == torch.float64 else 2e-4
    for g, w in zip(got, want):
        assert g is not None, "a derivative came back None (dropped); the oracle's is not"
        torch.testing.assert_close(g.detach().double().cpu(), w.detach(), rtol=tol, atol=tol)


DOUBLE = "double backward"
FORWARD = "forward-mode AD"


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_double_backward_through_projections(backend):
    """The reported case: a gradient taken with create_graph=True through q = x @ Wq and an output projection W, then
    a backward of its square (fused gave W.grad None: the attention's second-order terms were dropped)."""
    def inputs(convert):
        return [convert(_randn(backend, *shape, seed=seed, requires_grad=True))
                for seed, shape in ((0, (1, *SPATIAL, 1, 4)), (1, (4, 4)), (2, (4, 4)))]

    def second_order(attend, x, Wq, W):
        o = attend(x @ Wq, x, x)
        (g,) = torch.autograd.grad((o @ W).tanh().sum(), x, create_graph=True)
        g.square().sum().backward()
        return x.grad, Wq.grad, W.grad

    _exact_or_refused(lambda attend: second_order(attend, *inputs(lambda t: t)),
                      lambda attend: second_order(attend, *inputs(_reference)), backend, DOUBLE)


def _qkv_rpb(backend, convert=lambda t: t):
    q, k, v = (convert(_randn(backend, 1, *SPATIAL, 2, 4, seed=s, requires_grad=True)) for s in (3, 4, 5))
    rpb = convert(_randn(backend, 2, 5, 5, seed=6, requires_grad=True))
    return q, k, v, rpb


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_grad_of_a_gradient(backend):
    """torch.autograd.grad of dq with respect to the attention's own inputs (naive / gemm said "appears to not have
    been used in the graph"; fused had dq without a graph)."""
    def run(attend, q, k, v, rpb):
        (dq,) = torch.autograd.grad(attend(q, k, v, rpb).square().sum(), q, create_graph=True)
        return torch.autograd.grad(dq.sum(), (q, k, v, rpb))

    _exact_or_refused(lambda attend: run(attend, *_qkv_rpb(backend)),
                      lambda attend: run(attend, *_qkv_rpb(backend, _reference)), backend, DOUBLE)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_gradient_penalty_with_constant_output_gradient(backend):
    """A penalty on dq where the output's gradient is a constant (out.sum()): the incoming gradient requires no
    grad, so once_differentiable let dq through without a graph and the penalty's second-order part vanished from
    q.grad without an error (all three backends)."""
    def run(attend, q, k, v, rpb):
        (dq,) = torch.autograd.grad(attend(q, k, v, rpb).sum(), q, create_graph=True)
        (q.sum() + dq.square().sum()).backward()
        return q.grad, k.grad, rpb.grad

    _exact_or_refused(lambda attend: run(attend, *_qkv_rpb(backend)),
                      lambda attend: run(attend, *_qkv_rpb(backend, _reference)), backend, DOUBLE)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_create_graph_without_a_second_derivative_through_the_attention(backend):
    """create_graph=True through an attention call, then a backward of a gradient that does not pass the attention's
    backward: exact (the refusal fires only where a second derivative would flow through an attention call)."""
    def run(attend, x, s):
        loss = attend(x, x, x).sum() + (x * s).square().sum()
        _, gs = torch.autograd.grad(loss, (x, s), create_graph=True)
        gs.square().sum().backward()
        return x.grad, s.grad

    def inputs(convert):
        return (convert(_randn(backend, 1, *SPATIAL, 1, 4, seed=7, requires_grad=True)),
                convert(_randn(backend, 1, *SPATIAL, 1, 4, seed=8, requires_grad=True)))

    got = run(_attend(backend), *inputs(lambda t: t))
    want = run(_attend("oracle"), *inputs(_reference))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, rtol=1e-6, atol=1e-6)


def _plain(backend, seed, convert=lambda t: t):
    return convert(_randn(backend, 1, *SPATIAL, 2, 4, seed=seed))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_func_jvp(backend):
    """torch.func.jvp (fused gave a zero tangent; flex raised KeyError: <TransformType.Jvp: 3>)."""
    def run(attend, q, t):
        return torch.func.jvp(lambda q: attend(q, q, q), (q,), (t,))

    _exact_or_refused(lambda attend: run(attend, _plain(backend, 9), _plain(backend, 10)),
                      lambda attend: run(attend, _plain(backend, 9, _reference), _plain(backend, 10, _reference)),
                      backend, FORWARD)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_ad_dual_tensors(backend, requires_grad):
    """torch.autograd.forward_ad dual inputs (fused lost the tangent: the output was no dual tensor)."""
    if requires_grad and backend == "flex":
        pytest.skip("flex serves no gradient on CPU")

    def run(attend, q, t):
        with fwAD.dual_level():
            out = attend(*(fwAD.make_dual(q, t) for _ in range(3)))
            primal, tangent = fwAD.unpack_dual(out)
            return primal, tangent

    def inputs(convert):
        return _plain(backend, 11, convert).requires_grad_(requires_grad), _plain(backend, 12, convert)

    _exact_or_refused(lambda attend: run(attend, *inputs(lambda t: t)),
                      lambda attend: run(attend, *inputs(_reference)), backend, FORWARD)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_func_vmap(backend):
    """torch.func.vmap: per-element attention or a clear refusal (flex raised KeyError: <TransformType.Vmap: 1>;
    naive / gemm a message about autograd.Function's setup_context)."""
    def run(attend, x):
        return (torch.func.vmap(lambda q: attend(q, q, q))(x),)

    def loop(attend, x):
        return (torch.stack([attend(q, q, q) for q in x]),)

    x = _randn(backend, 2, 1, *SPATIAL, 2, 4, seed=13)
    _exact_or_refused(lambda attend: run(attend, x), lambda attend: loop(attend, _reference(x)), backend,
                      "torch.func.vmap")


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_func_grad(backend):
    """torch.func.grad: the oracle's gradient or a clear refusal."""
    def run(attend, x):
        return (torch.func.grad(lambda q: attend(q, q, q).square().sum())(x),)

    _exact_or_refused(lambda attend: run(attend, _plain(backend, 14)),
                      lambda attend: run(attend, _plain(backend, 14, _reference)), backend, "torch.func.grad")


def test_gemm_gradcheck_and_retained_graph():
    """gemm writes dS over its saved logits; a second backward over the retained graph recomputes them (it raised
    before), so gradcheck holds (float64) and repeated backwards agree bitwise."""
    gen = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, 3, 4, 1, 2, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    rpb = torch.randn(1, 5, 5, dtype=torch.float64, generator=gen, requires_grad=True)

    def attend(q, k, v, rpb):
        out, lse = ops.na2d(q, k, v, 3, rpb=rpb, return_lse=True, backend="gemm")
        return out, lse

    assert torch.autograd.gradcheck(attend, (q, k, v, rpb))
    causal = lambda q, k, v: ops.na2d(q, k, v, 3, is_causal=(True, False), backend="gemm")  # noqa: E731
    assert torch.autograd.gradcheck(causal, (q, k, v))
    out, lse = attend(q, k, v, rpb)
    loss = (out * out.detach()).sum() + lse.sum()
    first = torch.autograd.grad(loss, (q, k, v, rpb), retain_graph=True)
    second = torch.autograd.grad(loss, (q, k, v, rpb), retain_graph=True)
    loss.backward()
    for a, b, c in zip(first, second, (q.grad, k.grad, v.grad, rpb.grad)):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_meta_tensors_propagate_shapes(backend):
    """Meta tensors (no data): output, lse and gradient shapes (gemm called .item() on them; fused copied out of
    them)."""
    q = torch.empty(2, *SPATIAL, 4, 8, device="meta", dtype=_dtype(backend), requires_grad=True)
    kv = torch.empty(2, *SPATIAL, 2, 8, device="meta", dtype=_dtype(backend), requires_grad=True)
    out, lse = ops.na2d(q, kv, kv, K, return_lse=True, backend=backend)
    assert out.device.type == "meta" and out.shape == (2, *SPATIAL, 4, 8) and lse.shape == (2, *SPATIAL, 4)
    dq, dkv = torch.autograd.grad(out.sum() + lse.sum(), (q, kv))
    assert dq.shape == q.shape and dkv.shape == kv.shape and dq.device.type == "meta"


def test_unfused_operators_refuse_double_backward_and_forward_ad():
    """ops.na_qk / na_av (the gemm operators): a gradient of their gradients, and dual inputs, raise naming them."""
    gen = torch.Generator().manual_seed(16)
    q, k = (torch.randn(1, *SPATIAL, 2, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    (dq,) = torch.autograd.grad(ops.na2d_qk(q, k, K).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"na_qk / na_av \(gemm operators\): double backward"):
        torch.autograd.grad(dq.sum(), k)
    attn = torch.randn(1, *SPATIAL, 2, 9, dtype=torch.float64, generator=gen, requires_grad=True)
    (dattn,) = torch.autograd.grad(ops.na2d_av(attn, k, K).square().sum(), attn, create_graph=True)
    with pytest.raises(RuntimeError, match=r"na_qk / na_av \(gemm operators\): double backward"):
        dattn.sum().backward()
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=r"na_qk / na_av \(gemm operators\): forward-mode AD"):
        ops.na2d_qk(fwAD.make_dual(q.detach(), torch.ones_like(q)), k.detach(), K)


@needs_fused
@pytest.mark.parametrize("packed", [False, True])
def test_fused_registered_ops_are_first_order(packed):
    """The torch.library ops that compiled graphs call: their registered backward formula refuses a double backward,
    and their kernels refuse dual inputs (the op itself has no tangent rule)."""
    gen = torch.Generator().manual_seed(17)
    qkv = torch.randn(1, *SPATIAL, 3, 2, 4, generator=gen).to(FUSED_DEVICE).requires_grad_(True)
    window = ([3, 3], [1, 1], [1, 1], [False, False], 0.5)

    def call(qkv):
        if packed:
            return torch.ops.namodels.fused_na_packed_forward(qkv, None, *window)[0]
        return torch.ops.namodels.fused_na_forward(*qkv.unbind(-3), None, *window)[0]

    (dqkv,) = torch.autograd.grad(call(qkv).square().sum(), qkv, create_graph=True)
    with pytest.raises(RuntimeError, match="fused backend: double backward"):
        torch.autograd.grad(dqkv.sum(), qkv)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="fused backend: forward-mode AD"):
        call(fwAD.make_dual(qkv.detach(), torch.ones_like(qkv)))


@needs_fused
def test_fused_packed_double_backward_is_refused():
    """neighborhood_attention_qkvpacked on fused (its own autograd function) refuses a double backward."""
    gen = torch.Generator().manual_seed(18)
    qkv = torch.randn(1, *SPATIAL, 3, 2, 4, generator=gen).to(FUSED_DEVICE).requires_grad_(True)
    out = ops.neighborhood_attention_qkvpacked(2, qkv, K, backend="fused")
    (dqkv,) = torch.autograd.grad(out.square().sum(), qkv, create_graph=True)
    with pytest.raises(RuntimeError, match="fused backend: double backward"):
        dqkv.square().sum().backward()


def test_flex_gradients_are_first_order():
    """flex's inputs pass a first-order guard wherever a backward can follow (CUDA; CPU flex has no backward, so
    the guard is checked here on its own): first-order gradients pass unchanged, a second derivative raises."""
    from ops.flex import _first_order

    gen = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(3, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    gq, gk, gv, rpb = _first_order(q, k, v, None)
    assert rpb is None
    loss = (gq * gk * gv).sum()
    grads = torch.autograd.grad(loss, (q, k, v), create_graph=True)
    torch.testing.assert_close(grads[0], (k * v).detach())
    with pytest.raises(RuntimeError, match="flex backend: double backward"):
        torch.autograd.grad(grads[0].sum(), k)
