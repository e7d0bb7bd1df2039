"""Differentiation beyond first-order reverse mode, through every backend (``ops.autodiff``): a double backward,
forward-mode AD and ``torch.func`` transforms give exactly what the dense-mask oracle (tests/oracle.py, plain
differentiable torch) gives, never a dropped second-order term or tangent; ``gradcheck`` / ``gradgradcheck`` hold in
float64 and ``torch.func.jvp`` matches central finite differences, on every feature (RPB, lse, GQA, additional keys,
causal, stride, dilation, 1-D to 3-D).  Also: ``gemm`` serves several backwards over a retained graph, and the
backends propagate meta tensors' shapes.  ``ops.unfused``'s weight operators stay first order and say so.

``fused`` runs in Triton's interpreter on CPU (TRITON_INTERPRET=1, set before ops is imported; float32 there, so it
is compared with the oracle rather than gradchecked); ``flex`` serves no gradient on CPU.
"""
import os

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


def _exact(run, reference, backend):
    """``run(attend)`` through the backend returns what ``reference(oracle)`` returns (tensors, none of them None)."""
    got = run(_attend(backend))
    want = reference(_attend("oracle"))
    assert len(got) == len(want)
    tol = 1e-9 if _dtype(backend) == torch.float64 else 2e-4
    for g, w in zip(got, want):
        assert g is not None, "a derivative came back None (dropped); the oracle's is not"
        assert w.abs().max() > 0, "the reference is zero: the check could not fail"
        torch.testing.assert_close(g.detach().double().cpu(), w.detach(), rtol=tol, atol=tol)


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

    _exact(lambda attend: second_order(attend, *inputs(lambda t: t)),
           lambda attend: second_order(attend, *inputs(_reference)), backend)


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

    _exact(lambda attend: run(attend, *_qkv_rpb(backend)),
           lambda attend: run(attend, *_qkv_rpb(backend, _reference)), backend)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_gradient_penalty_with_constant_output_gradient(backend):
    """A penalty on dq where the output's gradient is a constant (out.sum()): the incoming gradient requires no
    grad, so once_differentiable let dq through without a graph and the penalty's second-order part vanished from
    q.grad without an error (all three backends)."""
    def run(attend, q, k, v, rpb):
        (dq,) = torch.autograd.grad(attend(q, k, v, rpb).sum(), q, create_graph=True)
        (q.sum() + dq.square().sum()).backward()
        return q.grad, k.grad, rpb.grad

    _exact(lambda attend: run(attend, *_qkv_rpb(backend)),
           lambda attend: run(attend, *_qkv_rpb(backend, _reference)), backend)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_create_graph_without_a_second_derivative_through_the_attention(backend):
    """create_graph=True through an attention call, then a backward of a gradient that does not pass the attention's
    backward: exact."""
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

    _exact(lambda attend: run(attend, _plain(backend, 9), _plain(backend, 10)),
           lambda attend: run(attend, _plain(backend, 9, _reference), _plain(backend, 10, _reference)), backend)


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

    _exact(lambda attend: run(attend, *inputs(lambda t: t)),
           lambda attend: run(attend, *inputs(_reference)), backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_func_vmap(backend):
    """torch.func.vmap: per-element attention (flex raised KeyError: <TransformType.Vmap: 1>; naive / gemm a message
    about autograd.Function's setup_context)."""
    def run(attend, x):
        return (torch.func.vmap(lambda q: attend(q, q, q))(x),)

    def loop(attend, x):
        return (torch.stack([attend(q, q, q) for q in x]),)

    x = _randn(backend, 2, 1, *SPATIAL, 2, 4, seed=13)
    _exact(lambda attend: run(attend, x), lambda attend: loop(attend, _reference(x)), backend)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_func_grad(backend):
    """torch.func.grad: the oracle's gradient."""
    def run(attend, x):
        return (torch.func.grad(lambda q: attend(q, q, q).square().sum())(x),)

    _exact(lambda attend: run(attend, _plain(backend, 14)),
           lambda attend: run(attend, _plain(backend, 14, _reference)), backend)


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


@pytest.mark.parametrize("causal", [False, True])
def test_unfused_operators_second_order_forward_mode_and_vmap(causal):
    """ops.na_qk / na_av (the gemm operators): gradcheck and gradgradcheck (float64), jvp against central finite
    differences, vmap against a loop; with RPB where it is defined, GQA and dilation."""
    gen = torch.Generator().manual_seed(16)
    shape = (1, *SPATIAL)
    q = torch.randn(*shape, 4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(*shape, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(*shape, 2, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    rpb = None if causal else torch.randn(4, 5, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    window = dict(kernel_size=K, dilation=(1, 2), is_causal=(causal, False))

    def attend(q, k, v, *rpb):
        logits = ops.na2d_qk(q, k, rpb=rpb[0] if rpb else None, **window)
        return ops.na2d_av(logits.softmax(-1), v, **window)

    tensors = (q, k, v) if rpb is None else (q, k, v, rpb)
    assert torch.autograd.gradcheck(attend, tensors)
    assert torch.autograd.gradgradcheck(attend, tensors, fast_mode=True)
    tangents = tuple(torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in tensors)
    primal, tangent = torch.func.jvp(attend, tensors, tangents)
    eps = 1e-6
    numeric = (attend(*(t + eps * d for t, d in zip(tensors, tangents)))
               - attend(*(t - eps * d for t, d in zip(tensors, tangents)))) / (2 * eps)
    assert tangent.abs().max() > 0
    torch.testing.assert_close(tangent, numeric, rtol=1e-6, atol=1e-6)
    batch = [torch.stack([t.detach(), t.detach() * 0.5]) for t in (q, k, v)]
    mapped = torch.func.vmap(lambda q, k, v: attend(q, k, v, *tensors[3:]))(*batch)
    looped = torch.stack([attend(*(b[i] for b in batch), *tensors[3:]) for i in range(2)])
    torch.testing.assert_close(mapped, looped, rtol=1e-12, atol=1e-12)


@needs_fused
@pytest.mark.parametrize("packed", [False, True])
def test_fused_registered_ops_give_exact_second_derivatives(packed):
    """The torch.library ops that compiled graphs call: their registered backward formula recomputes under
    create_graph (a double backward equals the oracle's), and their kernels refuse dual inputs reaching them
    directly (forward mode is routed around them by ops.functional)."""
    gen = torch.Generator().manual_seed(17)
    qkv = torch.randn(1, *SPATIAL, 3, 2, 4, generator=gen).to(FUSED_DEVICE).requires_grad_(True)
    window = ([3, 3], [1, 1], [1, 1], [False, False], 0.5)

    def call(qkv):
        if packed:
            return torch.ops.namodels.fused_na_packed_forward(qkv, None, *window)[0]
        return torch.ops.namodels.fused_na_forward(*qkv.unbind(-3), None, *window)[0]

    def oracle(qkv):
        return oracle_attention(*qkv.unbind(-3), SPATIAL, K, (1, 1), (1, 1), NO, scale=0.5)[0]

    def second(attend, qkv):
        (dqkv,) = torch.autograd.grad(attend(qkv).square().sum(), qkv, create_graph=True)
        return torch.autograd.grad(dqkv.tanh().sum(), qkv)[0]

    torch.testing.assert_close(second(call, qkv).double().cpu(), second(oracle, _reference(qkv)), rtol=2e-4,
                               atol=2e-4)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="fused backend: forward-mode AD"):
        call(fwAD.make_dual(qkv.detach(), torch.ones_like(qkv)))


@needs_fused
def test_fused_packed_double_backward():
    """neighborhood_attention_qkvpacked on fused (its own autograd function): a double backward equals the oracle's."""
    gen = torch.Generator().manual_seed(18)
    qkv = torch.randn(1, *SPATIAL, 3, 2, 4, generator=gen).to(FUSED_DEVICE).requires_grad_(True)

    def run(attend, qkv):
        (dqkv,) = torch.autograd.grad(attend(qkv).square().sum(), qkv, create_graph=True)
        dqkv.square().sum().backward()
        return (qkv.grad,)

    got = run(lambda t: ops.neighborhood_attention_qkvpacked(2, t, K, backend="fused"), qkv)
    want = run(lambda t: oracle_attention(*t.unbind(-3), SPATIAL, K, (1, 1), (1, 1), NO)[0], _reference(qkv))
    torch.testing.assert_close(got[0].double().cpu(), want[0], rtol=2e-4, atol=2e-4)


def test_flex_node_first_and_second_order():
    """flex's autograd node (``_Recorded``, CUDA only in use: CPU flex has no backward) checked on its own, with the
    naive plain form standing in for flex_attention: first-order gradients run through the recorded graph (twice
    over a retained graph), a second derivative through the plain-op recompute, both equal to the oracle's."""
    from ops.flex import _Recorded
    from ops.functional import make_params
    from ops.naive import plain_forward

    params = make_params(SPATIAL, K)
    q, k, v, rpb = _qkv_rpb("naive")
    flat = lambda t: t.reshape(1, -1, *t.shape[-2:])  # noqa: E731

    def attend_plain(q, k, v, rpb):
        out, lse = plain_forward(flat(q), flat(k), flat(v), rpb, params, 0.5)
        return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])

    def node(q, k, v, rpb):
        return _Recorded.apply(q, k, v, rpb, params, 0.5, attend_plain)[0]

    def oracle(q, k, v, rpb):
        return oracle_attention(q, k, v, SPATIAL, K, (1, 1), (1, 1), NO, rpb=rpb, scale=0.5)[0]

    def first(attend, tensors):
        out = attend(*tensors)
        return (*torch.autograd.grad(out.square().sum(), tensors, retain_graph=True),
                *torch.autograd.grad(out.sum(), tensors))

    def second(attend, tensors):
        (dq,) = torch.autograd.grad(attend(*tensors).square().sum(), tensors[0], create_graph=True)
        return torch.autograd.grad(dq.sum(), tensors)

    for check in (first, second):
        for g, w in zip(check(node, (q, k, v, rpb)), check(oracle, tuple(map(_reference, (q, k, v, rpb))))):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# every feature: (rank, spatial, kernel, stride, dilation, causal, heads q / kv, rpb, extra keys)
# ---------------------------------------------------------------------------------------------------------------
FEATURES = {
    "rpb": (2, (4, 5), (3, 3), (1, 1), (1, 1), (False, False), (2, 2), True, 0),
    "gqa": (2, (4, 5), (3, 3), (1, 1), (1, 1), (False, False), (4, 2), False, 0),
    "causal": (2, (4, 5), (3, 3), (1, 1), (1, 1), (True, False), (2, 2), False, 0),
    "stride": (2, (5, 5), (3, 3), (2, 1), (1, 1), (False, False), (2, 2), True, 0),
    "dilation": (2, (4, 6), (3, 3), (1, 1), (1, 2), (False, False), (2, 1), True, 0),
    "additional_keys": (2, (4, 4), (3, 3), (1, 1), (1, 1), (False, False), (2, 1), False, 3),
    "1d": (1, (7,), (3,), (1,), (2,), (True,), (2, 2), False, 0),
    "3d": (3, (3, 3, 4), (3, 3, 3), (1, 1, 1), (1, 1, 1), (False, False, False), (2, 2), True, 0),
}


def _feature_inputs(feature, backend, seed):
    rank, spatial, kernel, stride, dilation, causal, (hq, hkv), use_rpb, extra = FEATURES[feature]
    q = _randn(backend, 1, *spatial, hq, 3, seed=seed)
    k = _randn(backend, 1, *spatial, hkv, 3, seed=seed + 1)
    v = _randn(backend, 1, *spatial, hkv, 2, seed=seed + 2)
    rpb = _randn(backend, hq, *[2 * x - 1 for x in kernel], seed=seed + 3) if use_rpb else None
    ek = _randn(backend, 1, extra, hkv, 3, seed=seed + 4) if extra else None
    ev = _randn(backend, 1, extra, hkv, 2, seed=seed + 5) if extra else None
    return [t for t in (q, k, v, rpb, ek, ev) if t is not None]


def _feature_attend(feature, backend):
    """``(*tensors) -> (out, lse)`` of ``_feature_inputs``' tensors, through a backend or the oracle."""
    rank, spatial, kernel, stride, dilation, causal, _, use_rpb, extra = FEATURES[feature]

    def split(tensors):
        q, k, v, *rest = tensors
        rpb = rest.pop(0) if use_rpb else None
        ek, ev = rest if extra else (None, None)
        return q, k, v, rpb, ek, ev

    def attend(*tensors):
        q, k, v, rpb, ek, ev = split(tensors)
        if backend == "oracle":
            return oracle_attention(q, k, v, spatial, kernel, stride, dilation, causal, rpb=rpb, extra_k=ek,
                                    extra_v=ev)
        return ops.neighborhood_attention(rank, q, k, v, kernel, stride, dilation, causal, rpb=rpb,
                                          additional_keys=ek, additional_values=ev, return_lse=True,
                                          backend=backend)

    return attend


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_jvp_on_every_feature(backend, feature):
    """torch.func.jvp of (out, lse) with a tangent on every input equals the oracle's own jvp (fused: its tangent
    kernel, ops/fused/jvp.py); in float64 it also equals central finite differences."""
    primals = _feature_inputs(feature, backend, seed=20)
    tangents = _feature_inputs(feature, backend, seed=40)
    attend = _feature_attend(feature, backend)
    (out, lse), (t_out, t_lse) = torch.func.jvp(attend, tuple(primals), tuple(tangents))
    (_, _), (w_out, w_lse) = torch.func.jvp(_feature_attend(feature, "oracle"), tuple(map(_reference, primals)),
                                            tuple(map(_reference, tangents)))
    tol = 1e-9 if _dtype(backend) == torch.float64 else 2e-4
    assert w_out.abs().max() > 0 and w_lse.abs().max() > 0
    torch.testing.assert_close(t_out.double().cpu(), w_out, rtol=tol, atol=tol)
    torch.testing.assert_close(t_lse.double().cpu(), w_lse, rtol=tol, atol=tol)
    if _dtype(backend) == torch.float64:
        eps = 1e-6
        plus = attend(*(p + eps * t for p, t in zip(primals, tangents)))
        minus = attend(*(p - eps * t for p, t in zip(primals, tangents)))
        for a, b, t in zip(plus, minus, (t_out, t_lse)):
            torch.testing.assert_close((a - b) / (2 * eps), t, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend", ["naive", "gemm"])
def test_gradcheck_and_gradgradcheck_on_every_feature(backend, feature):
    """float64 gradcheck and gradgradcheck of (out, lse) with respect to every input (fast mode: the Jacobians
    against random projections, one numerical and one analytical product each; the full Jacobians are compared by
    ``test_gemm_gradcheck_and_retained_graph`` and the ``slow`` full-mode run of this matrix)."""
    tensors = tuple(t.requires_grad_(True) for t in _feature_inputs(feature, backend, seed=60))
    attend = _feature_attend(feature, backend)
    assert torch.autograd.gradcheck(attend, tensors, fast_mode=True)
    assert torch.autograd.gradgradcheck(attend, tensors, fast_mode=True)


@pytest.mark.slow
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend", ["naive", "gemm"])
def test_full_gradcheck_and_gradgradcheck_on_every_feature(backend, feature):
    tensors = tuple(t.requires_grad_(True) for t in _feature_inputs(feature, backend, seed=60))
    attend = _feature_attend(feature, backend)
    assert torch.autograd.gradcheck(attend, tensors)
    assert torch.autograd.gradgradcheck(attend, tensors)


@needs_fused
@pytest.mark.parametrize("feature", ["rpb", "gqa", "causal"])
def test_fused_second_derivatives_on_every_feature(feature):
    """fused (float32 in the interpreter): the gradient of a gradient norm equals the oracle's."""
    def run(attend, tensors):
        out, lse = attend(*tensors)
        grads = torch.autograd.grad(out.square().sum() + lse.sum(), tensors, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), tensors)

    tensors = [t.requires_grad_(True) for t in _feature_inputs(feature, "fused", seed=80)]
    got = run(_feature_attend(feature, "fused"), tensors)
    want = run(_feature_attend(feature, "oracle"), [_reference(t) for t in tensors])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, rtol=5e-4, atol=5e-4)


def test_calls_under_forward_mode_run_the_reference_and_say_so(caplog):
    """The routing is visible: a debug line on the ops.backends logger names the backend it stood in for."""
    q = _plain("naive", 90)
    with caplog.at_level("DEBUG", logger="ops.backends"):
        torch.func.jvp(lambda q: ops.na2d(q, q, q, K, backend="gemm"), (q,), (q,))
    assert any("reference_attention instead of backend 'gemm'" in r.getMessage() for r in caplog.records)


@needs_fused
def test_fused_forward_mode_runs_the_tangent_kernel(monkeypatch):
    """fused serves forward mode with its tangent kernel (not the reference), through torch.func.jvp, dual tensors
    and the packed entry point, and equals the oracle's tangent."""
    import ops.fused.op as fused_op

    calls = []
    kernel = fused_op.forward_tangent
    monkeypatch.setattr(fused_op, "forward_tangent", lambda *a: calls.append(1) or kernel(*a))
    q, t = _plain("fused", 95), _plain("fused", 96)
    _, got = torch.func.jvp(lambda q: ops.na2d(q, q, q, K, backend="fused"), (q,), (t,))
    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.stack([q, q, q], -3), torch.stack([t, t, t], -3))
        packed = fwAD.unpack_dual(ops.neighborhood_attention_qkvpacked(2, dual, K, backend="fused")).tangent
    assert len(calls) == 2
    _, want = torch.func.jvp(lambda q: _attend("oracle")(q, q, q), (_reference(q),), (_reference(t),))
    for tangent in (got, packed):
        torch.testing.assert_close(tangent.double().cpu(), want, rtol=2e-4, atol=2e-4)


# ---------------------------------------------------------------------------------------------------------------
# whole models: what consistency-model training and gradient penalties do
# ---------------------------------------------------------------------------------------------------------------
def _tiny_dinat(backend):
    import timm

    import namodels  # noqa: F401

    torch.manual_seed(0)
    model = timm.create_model("dinat_mini", embed_dim=8, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2),
                              dilations=((1,), (1,), (2,), (1,)), num_classes=3, backend=backend)
    return model.double().eval()


@pytest.mark.parametrize("backend", ["naive", "gemm"])
def test_model_jvp_and_gradient_penalty(backend):
    """DiNAT: torch.func.jvp of the logits in the input equals central finite differences, and an R1-style penalty
    (the squared input gradient, taken with create_graph=True) has the parameter gradient its finite differences
    along a random parameter direction give."""
    model = _tiny_dinat(backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64, generator=gen)
    dx = torch.randn(x.shape, dtype=torch.float64, generator=gen)
    _, tangent = torch.func.jvp(model, (x,), (dx,))
    eps = 1e-6
    with torch.no_grad():
        numeric = (model(x + eps * dx) - model(x - eps * dx)) / (2 * eps)
    assert tangent.abs().max() > 0
    torch.testing.assert_close(tangent, numeric, rtol=1e-6, atol=1e-7)

    params = [p for p in model.parameters() if p.requires_grad]

    def penalty():
        xi = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(model(xi).square().sum(), xi, create_graph=True)
        return g.square().sum()

    grads = torch.autograd.grad(penalty(), params)
    direction = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]
    analytic = sum((g * u).sum() for g, u in zip(grads, direction))
    with torch.no_grad():
        for p, u in zip(params, direction):
            p.add_(eps * u)
    plus = penalty().item()
    with torch.no_grad():
        for p, u in zip(params, direction):
            p.sub_(2 * eps * u)
    minus = penalty().item()
    assert abs(analytic.item()) > 0
    torch.testing.assert_close(analytic.item(), (plus - minus) / (2 * eps), rtol=1e-5, atol=1e-8)


@pytest.mark.gpu
def test_model_forward_mode_on_the_gpu_matches_the_reference_path():
    """On CUDA the block's tape steps aside under forward mode (dual tensors) and the fused tangent kernel serves the
    attention: the model's tangent equals the naive backend's in float32."""
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    model = _tiny_dinat(None).float().cuda()
    gen = torch.Generator().manual_seed(2)
    x, dx = (torch.randn(2, 3, 32, 32, generator=gen).cuda() for _ in range(2))
    tangents = {}
    for backend in ("fused", "naive"):
        with ops.use_backend(backend), fwAD.dual_level():
            tangents[backend] = fwAD.unpack_dual(model(fwAD.make_dual(x, dx))).tangent
    torch.testing.assert_close(tangents["fused"], tangents["naive"], rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gemm", "fused", "naive"])
def test_second_derivatives_on_the_gpu(backend):
    """On CUDA the recompute runs the gemm operators' Triton kernels: a gradient of a gradient (float32, RPB, GQA,
    dilation) equals the oracle's."""
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    gen = torch.Generator().manual_seed(21)
    spatial, kernel, dilation = (12, 10), (3, 5), (2, 1)
    tensors = [torch.randn(*shape, generator=gen).cuda().requires_grad_(True)
               for shape in ((2, *spatial, 4, 32), (2, *spatial, 2, 32), (2, *spatial, 2, 32), (4, 5, 9))]

    def run(attend, tensors):
        q, k, v, rpb = tensors
        out = attend(q, k, v, rpb)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, rpb), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v, rpb))

    got = run(lambda q, k, v, rpb: ops.na2d(q, k, v, kernel, dilation=dilation, rpb=rpb, backend=backend), tensors)
    want = run(lambda q, k, v, rpb: oracle_attention(q, k, v, spatial, kernel, (1, 1), dilation, NO, rpb=rpb)[0],
               [_reference(t) for t in tensors])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, rtol=2e-3, atol=2e-3)
