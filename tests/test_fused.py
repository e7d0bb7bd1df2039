"""Backend ``fused`` (Triton) against the dense float64 oracle, forward and backward.

Without CUDA the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py before
Triton is imported), on small problems: every window rule (1/2/3-D, stride, dilation, causal per
axis, RPB, GQA, odd sizes, several tile shapes so that masked and unmasked tiles both occur).
Tolerances: interpreter float32 is exact float32 math (1e-5 relative to the output scale); on the
GPU float32 matmuls follow torch's setting (3xTF32 at the default "highest", TF32 at "high"), and the
tolerance (5e-3) is TF32's, so the tests hold under either; bfloat16 / float16 inputs 3e-2 / 1e-2.
Every output buffer of the kernels is poisoned with NaN first (so an unwritten element fails).
"""
import dataclasses
import json
import math
import os
import random

import pytest
import torch

pytest.importorskip("triton")

import ops  # noqa: E402
from ops.backends import Problem  # noqa: E402
from ops.fused import BACKEND, autotune, decide, launch  # noqa: E402
from ops.fused.autotune import Config  # noqa: E402
from ops.window import NAParams  # noqa: E402
from tests.oracle import RandomProblem, oracle_attention, random_problem  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or interpreter")

# GPU float32 matmuls in TF32 (torch's "high"; 10-bit mantissa): the error grows with the reduction length; a
# 21x23 window at head dim 64 / 256 measured 3.1e-3 / 3.3e-3 on an H100, hence 5e-3 (at the default "highest" they
# run in 3xTF32, ~1e-6: tests/test_ops_safety.py).
TOL = {torch.float32: 1e-5 if INTERPRETED else 5e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# Tests of the TMA paths: a GPU copies only 16-bit values in bulk; the interpreter takes any dtype (exact in float32).
TMA_DTYPE = torch.float32 if INTERPRETED else torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_launch_plans():
    """Each test starts without cached launch plans, so its first call of a problem takes the full
    path (tile choice, int64 decision) under whatever the test patched."""
    decide._PLANS.clear()
    yield
    decide._PLANS.clear()


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every buffer the kernels write starts as NaN."""
    monkeypatch.setattr(launch, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                     device=device))


def _rel_err(got, ref):
    got = got.double().cpu()
    ref = ref.double().cpu()
    assert torch.isfinite(got).all(), "non-finite values (unwritten output?)"
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _run(p: RandomProblem, dtype, grads=False, seed=0, extra=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, rpb = p.tensors(dtype=dtype, device=DEVICE, generator=gen, requires_grad=grads)
    if rpb is not None:  # the module keeps rpb in float32 whatever the activations are
        rpb = rpb.detach().float().requires_grad_(grads)
    ek = ev = None
    if extra:
        ek = torch.randn(p.batch, extra, p.heads_kv, p.dim, dtype=dtype, device=DEVICE, generator=gen)
        ev = torch.randn(p.batch, extra, p.heads_kv, p.dim_v, dtype=dtype, device=DEVICE, generator=gen)
    out, lse = ops.neighborhood_attention(len(p.spatial), q, k, v, **p.kwargs(), rpb=rpb, additional_keys=ek,
                                          additional_values=ev, return_lse=True, backend="fused")
    ref_in = [t.detach().double().cpu().requires_grad_(grads) if t is not None else None for t in (q, k, v, rpb)]
    ref_out, ref_lse = oracle_attention(*ref_in[:3], p.spatial, p.kernel_size, p.stride, p.dilation, p.causal,
                                        rpb=ref_in[3], extra_k=None if ek is None else ek.double().cpu(),
                                        extra_v=None if ev is None else ev.double().cpu())
    tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert _rel_err(out, ref_out) < tol
    assert _rel_err(lse, ref_lse) < tol
    if not grads:
        return
    d_out = torch.randn(out.shape, dtype=dtype, device=DEVICE, generator=gen)
    d_lse = torch.randn(lse.shape, dtype=torch.float32, device=DEVICE, generator=gen)
    inputs = [t for t in (q, k, v, rpb) if t is not None]
    got = torch.autograd.grad((out.float() * d_out.float()).sum() + (lse * d_lse).sum(), inputs)
    ref_inputs = [t for t in ref_in if t is not None]
    ref = torch.autograd.grad((ref_out * d_out.double().cpu()).sum() + (ref_lse * d_lse.double().cpu()).sum(),
                              ref_inputs)
    for name, g, r in zip("q k v rpb".split(), got, ref):
        assert g.dtype == (torch.float32 if name == "rpb" else dtype)
        err = _rel_err(g, r)
        assert err < 4 * tol, f"d{name}: relative error {err:.2e}"


def _problems(seed, count, max_tokens, max_dim):
    rng = random.Random(seed)
    return [random_problem(rng, rank=1 + i % 3, max_tokens=max_tokens, max_dim=max_dim) for i in range(count)]


@pytest.mark.parametrize("p", _problems(1, 9, 72, 24), ids=lambda p: f"{p.spatial}-K{p.kernel_size}")
def test_forward_random(p):
    _run(p, torch.float32)


@pytest.mark.parametrize("p", _problems(2, 6, 40, 20), ids=lambda p: f"{p.spatial}-K{p.kernel_size}")
def test_backward_random(p):
    _run(p, torch.float32, grads=True, seed=3)


def _fixed(spatial, K, s=1, d=1, c=False, heads=2, heads_kv=1, dim=16, dim_v=16, rpb=False, batch=1):
    rank = len(spatial)
    tup = lambda x: x if isinstance(x, tuple) else (x,) * rank  # noqa: E731
    return RandomProblem(spatial, tup(K), tup(s), tup(d), tup(c), batch, heads, heads_kv, dim, dim_v, rpb)


# Small tiles on larger axes: unmasked (interior) tiles, masked border tiles and multi-tile loops
# in every kernel, plus the dilation / stride / causal / RPB / GQA paths.
TILED = [
    _fixed((96,), 40, dim=32, dim_v=16, heads=1),
    _fixed((60,), 21, s=7, d=2, c=True, heads=2, heads_kv=1),
    _fixed((12, 10), (7, 3), rpb=True, dim=24, heads=1),
    _fixed((4, 6, 8), (3, 3, 4), s=(2, 1, 3), d=(1, 2, 1), c=(True, False, False)),  # GQA: 2 query heads, 1 kv
]
TILED_SLOW = [
    _fixed((20, 18), (9, 7), rpb=True, dim=24),
    _fixed((19, 21), (5, 9), s=(5, 2), d=(2, 1), c=(True, False)),
    _fixed((6, 10, 8), (3, 5, 4), rpb=True, heads=2, heads_kv=2),
    _fixed((8, 7, 9), (4, 3, 3), s=(2, 1, 3), d=(1, 2, 2), c=(True, False, False), batch=2),
]


def _assert_tma_used(expected: bool):
    """Every cached forward / backward launch took (or skipped) the TMA loads."""
    assert decide.plans("forward") and decide.plans("backward")
    assert all(plan.launch.meta["TMA"] == expected for plan in decide.plans("forward"))
    assert all(plan.dq.meta["TMA"] == expected and plan.dkdv.meta["TMA"] == expected
               for plan in decide.plans("backward"))


@pytest.mark.parametrize("tma", [False, True], ids=["pointer-loads", "tma-loads"])
@pytest.mark.parametrize("p", TILED + [pytest.param(p, marks=pytest.mark.slow) for p in TILED_SLOW],
                         ids=lambda p: f"{p.spatial}-K{p.kernel_size}")
@pytest.mark.parametrize("query_rows", [False, True], ids=["dkdv-key-rows", "dkdv-query-rows"])
def test_small_tiles_forward_backward(p, tma, query_rows, monkeypatch):
    """Both ways of loading the looped-over tiles: pointer tensors, and TMA descriptors per dilation
    group (whose out-of-bounds zero fill replaces the masks; GQA heads as the descriptor's first axis);
    and both matmul orientations of dK/dV (keys or queries as the rows)."""
    monkeypatch.setattr(decide, "DKDV_QUERY_ROWS_FROM", 1 if query_rows else 1 << 30)
    small = Config(16, 16, 4, 1, tma)
    with autotune.forced(fwd=small, dq=small, dkdv=small, drpb=Config(16, 1, 4, 1)):
        _run(p, torch.float32, grads=True, seed=5)
    _assert_tma_used(tma and INTERPRETED)  # compiled, float32 takes pointer loads (TMA is for 16-bit inputs)
    assert all(plan.dkdv.meta["QUERY_ROWS"] == query_rows for plan in decide.plans("backward"))


# RPB problems with several boxes per program: masked and unmasked boxes, dilation groups of two lengths, GQA, 3-D.
RPB_CASES = [
    _fixed((12, 10), (7, 3), rpb=True, dim=24, heads=1),
    _fixed((11, 8), (5, 3), d=(2, 1), rpb=True),  # GQA: 2 query heads, 1 kv
    pytest.param(_fixed((4, 6, 8), (3, 3, 5), d=(1, 2, 1), rpb=True, heads=4, heads_kv=2, batch=2),
                 marks=pytest.mark.slow),
]
RPB_PATHS = [(True, False), (True, True), (False, False)]


@pytest.mark.parametrize("bias_tiles, query_rows", RPB_PATHS, ids=["tiles-key-rows", "tiles-query-rows", "gather"])
@pytest.mark.parametrize("p", RPB_CASES, ids=lambda p: f"{p.spatial}-K{p.kernel_size}-d{p.dilation}")
def test_rpb_from_bias_tiles_and_by_gather(p, bias_tiles, query_rows, monkeypatch):
    """RPB enters the scores either as precomputed per-box tiles that also carry the window mask (``BIAS_TILES``,
    forward, dQ and both dK/dV orientations) or gathered per element; both match the oracle, forward and backward,
    and the plans record which path they took."""
    monkeypatch.setattr(decide, "BIAS_TILES", bias_tiles)
    monkeypatch.setattr(decide, "DKDV_QUERY_ROWS_FROM", 1 if query_rows else 1 << 30)
    small = Config(16, 16, 4, 1)
    with autotune.forced(fwd=small, dq=small, dkdv=small):
        _run(p, torch.float32, grads=True, seed=2)
    forward_plans, backward_plans = list(decide.plans("forward")), list(decide.plans("backward"))
    assert forward_plans and backward_plans
    for plan in forward_plans:
        assert plan.launch.meta["BIAS_TILES"] == bias_tiles == (plan.bias_tiles is not None)
    for plan in backward_plans:
        assert plan.dq.meta["BIAS_TILES"] == plan.dkdv.meta["BIAS_TILES"] == bias_tiles
        assert (plan.dq_bias_tiles is not None) == (plan.dkdv_bias_tiles is not None) == bias_tiles
        assert plan.dkdv.meta["QUERY_ROWS"] == query_rows


def test_bias_tiles_capped_by_size(monkeypatch):
    """A launch whose bias tiles would pass ``BIAS_TILE_ELEMENTS`` gathers the bias per element instead, per kernel:
    here the forward keeps its tiles while dQ and dK/dV (larger tiles) go without, and dRPB then comes from dQ's
    window-layout dS; every result against the oracle."""
    p = _fixed((12, 10), (7, 3), rpb=True, dim=24, heads=1)
    small, large = Config(16, 16, 4, 1), Config(32, 32, 4, 1)
    with autotune.forced(fwd=small, dq=large, dkdv=large):
        _run(p, torch.float32, grads=True, seed=4)
        (forward_plan,), (backward_plan,) = decide.plans("forward"), decide.plans("backward")
        forward_size = forward_plan.bias_tiles[1]
        assert backward_plan.dq_bias_tiles[1] > forward_size and backward_plan.dkdv_bias_tiles[1] > forward_size
        decide._PLANS.clear()
        monkeypatch.setattr(decide, "BIAS_TILE_ELEMENTS", forward_size)
        _run(p, torch.float32, grads=True, seed=4)
    (forward_plan,), (backward_plan,) = decide.plans("forward"), decide.plans("backward")
    assert forward_plan.launch.meta["BIAS_TILES"] and forward_plan.bias_tiles is not None
    assert not backward_plan.dq.meta["BIAS_TILES"] and not backward_plan.dkdv.meta["BIAS_TILES"]
    assert backward_plan.dq_bias_tiles is None and backward_plan.dkdv_bias_tiles is None
    assert not backward_plan.ds_tiles and backward_plan.ds_window is not None
    assert backward_plan.dq.meta["STORE_DS"] and not backward_plan.dq.meta["DS_BOXES"]


def test_bias_tiles_of_16_bit_inputs_saturate():
    """16-bit inputs get float16 bias tiles; an RPB value past float16's range saturates there rather than
    becoming an infinity (which would turn the softmax into NaN): a huge bias on the query's own position still
    puts all its weight on its own value, as the oracle does."""
    p = _fixed((6, 7), (3, 3), rpb=True, heads=2, heads_kv=2)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, rpb = p.tensors(dtype=torch.bfloat16, device=DEVICE, generator=gen)
    rpb = rpb.detach().float()
    rpb[:, 2, 2] = 1e6  # offset (0, 0): the query's own key
    out = ops.neighborhood_attention(2, q, k, v, **p.kwargs(), rpb=rpb, backend="fused")
    plan, = decide.plans("forward")
    assert plan.bias_tiles[2] == torch.float16
    assert torch.isfinite(out).all()
    assert torch.equal(out.cpu(), v.cpu())



def test_inference_writes_bias_tiles_on_every_call(monkeypatch):
    """Eager inference writes an rpb's bias tiles on every call: an rpb changed in place, and one changed through
    ``.data`` (which leaves its version counter alone, as a self-distillation teacher's EMA update may), are both
    followed; every output against the oracle."""
    p = _fixed((6, 7), (3, 5), rpb=True, heads=2, heads_kv=2)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v, rpb = p.tensors(dtype=torch.float32, device=DEVICE, generator=gen)
    rpb = rpb.detach().float()
    written = []
    generate = launch._bias_tiles
    monkeypatch.setattr(launch, "_bias_tiles", lambda *a: written.append(1) or generate(*a))

    def check(bias):
        with torch.no_grad():
            out = ops.neighborhood_attention(2, q, k, v, **p.kwargs(), rpb=bias, backend="fused")
        ref, _ = oracle_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), p.spatial, p.kernel_size,
                                  p.stride, p.dilation, p.causal, rpb=bias.double().cpu())
        assert _rel_err(out, ref) < TOL[torch.float32]

    check(rpb)
    check(rpb)
    with torch.no_grad():
        rpb.mul_(-3.0)
    check(rpb)
    rpb.data.add_(1.0)
    check(rpb)
    assert len(written) == 4
    other_size = _fixed((9, 7), (3, 5), rpb=True, heads=2, heads_kv=2)  # the same rpb on another input size
    q2, k2, v2, _ = other_size.tensors(dtype=torch.float32, device=DEVICE, generator=gen)
    with torch.no_grad():
        out = ops.neighborhood_attention(2, q2, k2, v2, **other_size.kwargs(), rpb=rpb, backend="fused")
    ref, _ = oracle_attention(q2.double().cpu(), k2.double().cpu(), v2.double().cpu(), other_size.spatial,
                              other_size.kernel_size, other_size.stride, other_size.dilation, other_size.causal,
                              rpb=rpb.double().cpu())
    assert _rel_err(out, ref) < TOL[torch.float32] and len(written) == 5
    check(rpb)
    assert len(written) == 6  # one table kept per rpb: the last size's


HOST_DESC_CASES = [
    (_fixed((6, 9), (3, 5), c=(True, False), dim=32, dim_v=16, heads=4, heads_kv=2, batch=2), True),  # GQA, 2 batches
    (_fixed((6, 9), (3, 5), d=(2, 1), dim=32, heads=2), False),  # dilation
    (_fixed((6, 9), (3, 5), dim=24, heads=2), False),  # head dim not a power of 2
]


@pytest.mark.parametrize("p, host", HOST_DESC_CASES, ids=["host", "dilated", "dim24"])
def test_forward_kv_descriptors_built_on_the_host(p, host):
    """With TMA on, the forward's K/V descriptors come from the host where the layout allows it (one descriptor
    per tensor over [B, L0, L1, L2, heads * D]) and from each program otherwise; a repeated call takes its plan,
    which rebuilds the host descriptors for the new tensors."""
    tma = Config(16, 16, 4, 1, True)
    with autotune.forced(fwd=tma, dq=tma, dkdv=tma):
        for seed in (0, 1):  # the second call of the problem goes through decide._PLANS
            _run(p, TMA_DTYPE, seed=seed)
    plans = list(decide.plans("forward"))
    assert len(plans) == 1 and plans[0].launch.meta["TMA"]  # bfloat16 on the GPU, any dtype interpreted
    assert plans[0].launch.meta["HOST_DESC"] == host
    assert (plans[0].host_desc_layouts is not None) == host


@pytest.mark.parametrize("query_rows", [False, True], ids=["dkdv-key-rows", "dkdv-query-rows"])
@pytest.mark.parametrize("p, host", HOST_DESC_CASES, ids=["host", "dilated", "dim24"])
def test_backward_descriptors_built_on_the_host(p, host, query_rows, monkeypatch):
    """``BACKWARD_HOST_DESCRIPTORS`` on: with TMA, dQ reads K/V and dK/dV reads Q/dO (and, with queries as the
    matmul rows, its own K/V tile) through descriptors built on the host where the layout allows it (the forward's
    rule), through per-program ones otherwise; gradients match the oracle on the first call and through the
    backward plan, which rebuilds the descriptors for the new tensors."""
    monkeypatch.setattr(decide, "BACKWARD_HOST_DESCRIPTORS", True)
    monkeypatch.setattr(decide, "DKDV_QUERY_ROWS_FROM", 1 if query_rows else 1 << 30)
    tma = Config(16, 16, 4, 1, True)
    with autotune.forced(fwd=tma, dq=tma, dkdv=tma):
        for seed in (0, 1):  # the second call of the problem goes through decide._PLANS
            _run(p, TMA_DTYPE, grads=True, seed=seed)
    plans = list(decide.plans("backward"))
    assert len(plans) == 1 and plans[0].dq.meta["TMA"] and plans[0].dkdv.meta["TMA"]
    assert plans[0].dq.meta["HOST_DESC"] == host == plans[0].dkdv.meta["HOST_DESC"]
    assert (plans[0].dq_layouts is not None) == host == (plans[0].dkdv_layouts is not None)
    assert plans[0].dkdv.meta["QUERY_ROWS"] == query_rows


def test_backward_host_descriptors_follow_the_switch(monkeypatch):
    """The backward's host-built descriptors are on by default (``decide.BACKWARD_HOST_DESCRIPTORS``, faster on
    short loops); switched off, dQ and dK/dV build their descriptors per program."""
    assert decide.BACKWARD_HOST_DESCRIPTORS
    monkeypatch.setattr(decide, "BACKWARD_HOST_DESCRIPTORS", False)
    tma = Config(16, 16, 4, 1, True)
    with autotune.forced(fwd=tma, dq=tma, dkdv=tma):
        _run(HOST_DESC_CASES[0][0], TMA_DTYPE, grads=True)
    plans = list(decide.plans("backward"))
    assert plans and all(plan.dq.meta["TMA"] and not plan.dq.meta["HOST_DESC"] and not plan.dkdv.meta["HOST_DESC"]
                         and plan.dq_layouts is None and plan.dkdv_layouts is None for plan in plans)


def test_plan_launch_checks_alignment_of_tensors_only():
    """A plan's launch compares pointer alignment with the compiled kernel's; host-built descriptors among the
    arguments are skipped there (they are not pointers)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.zeros(4, 16)
    desc = TensorDescriptor(base, [4, 16], [16, 1], [4, 16])
    assert launch._alignment((base, desc, base[:, 1:])) == (True, False)


def test_register_cap_reaches_the_compiler():
    """A configuration's ``maxnreg`` goes to Triton with the launch (compiled: ptxas caps the registers and
    spills the rest, which must not change the results)."""
    capped = Config(16, 16, 1, 1, maxnreg=64)
    with autotune.forced(fwd=capped, dq=capped, dkdv=capped, drpb=Config(16, 1, 4, 1)):
        _run(_fixed((6, 9), (3, 5), d=(2, 1), rpb=True), torch.float32, grads=True)
    assert decide.plans("forward") and all(plan.launch.meta["maxnreg"] == 64 for plan in decide.plans("forward"))
    assert all(plan.dq.meta["maxnreg"] == 64 == plan.dkdv.meta["maxnreg"] for plan in decide.plans("backward"))


def test_int64_index_path(monkeypatch):
    """The kernels' int64 token-offset variant (used past 2**31 elements per batch element)."""
    monkeypatch.setattr(decide, "needs_int64", lambda *tensors: True)
    _run(_fixed((6, 9), (3, 5), d=(2, 1), rpb=True), torch.float32, grads=True)
    assert decide.plans("forward") and all(plan.launch.meta["IDX64"] for plan in decide.plans("forward"))
    assert decide.plans("backward") and all(plan.dq.meta["IDX64"] and plan.dkdv.meta["IDX64"]
                                    for plan in decide.plans("backward"))


def _record_drpb_paths(monkeypatch) -> list:
    """The names of the dRPB paths the backward takes, in call order: ``reduce_tile_ds`` / ``reduce_window_ds``
    (per call) or ``_drpb_launch`` (the offset pass, planned on a problem's first call)."""
    from ops.fused import rpb_grad

    paths = []
    for module, name in ((rpb_grad, "reduce_tile_ds"), (rpb_grad, "reduce_window_ds"), (decide, "_drpb_launch")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw: paths.append(_name) or
                            _real(*a, **kw))
    return paths


@pytest.mark.parametrize("mode", ["tiles", "window-atomic", "window-stored", "partial-rows", "atomic"])
def test_batch_chunks_and_drpb_modes(monkeypatch, mode):
    """More batch x heads than one grid row holds (launches split by batch) and the five dRPB modes: dQ's dS added
    over the batch by atomics in the bias tiles' layout (the default) or, without bias tiles, in window layout;
    stored per batch element in window layout when deterministic (both up to rpb_grad.WINDOW_BUFFER_BYTES); above
    that the offset pass, with deterministic per-program rows or atomics (above DRPB_PARTIAL_BYTES when determinism
    is off).  Every mode against the oracle."""
    from ops.fused import op, rpb_grad

    monkeypatch.setattr(decide, "MAX_GRID_Y", 4)  # 2 heads: two batch elements per launch
    paths = _record_drpb_paths(monkeypatch)
    deterministic = mode in ("window-stored", "partial-rows")
    monkeypatch.setattr(op, "DRPB_DETERMINISTIC_DEFAULT", deterministic)
    if not mode.startswith("window"):
        monkeypatch.setattr(rpb_grad, "WINDOW_BUFFER_BYTES", 0)
    if mode == "atomic":
        monkeypatch.setattr(decide, "DRPB_PARTIAL_BYTES", 0)
    if mode in ("window-atomic", "atomic"):  # bias tiles would take the tile-layout path
        monkeypatch.setattr(decide, "BIAS_TILES", False)
    _run(_fixed((6, 7), (3, 5), rpb=True, heads=2, heads_kv=1, batch=3), torch.float32, grads=True)
    expected = {"tiles": "reduce_tile_ds", "window-atomic": "reduce_window_ds", "window-stored": "reduce_window_ds"}
    assert paths == [expected.get(mode, "_drpb_launch")]
    if mode.startswith("window"):
        assert _dq_ds_modes() == {(True, not deterministic, False)}
    if mode == "tiles":
        assert _dq_ds_modes() == {(False, True, True)}


def _dq_ds_modes() -> set:
    """(STORE_DS, DS_ATOMIC, DS_BOXES) of every dQ launch plan built so far."""
    return {(plan.dq.meta["STORE_DS"], plan.dq.meta["DS_ATOMIC"], plan.dq.meta["DS_BOXES"])
            for plan in decide.plans("backward")}


def test_drpb_reproducible_when_deterministic():
    """Under torch.use_deterministic_algorithms the window-layout dS is stored per batch element and summed by
    the host: two backward passes give bitwise equal dRPB, which matches the default (atomic) path's."""
    p = _fixed((7, 9), (3, 5), rpb=True, heads=2, batch=4)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v, rpb = p.tensors(dtype=torch.float32, device=DEVICE, generator=gen)
    rpb.requires_grad_(True)

    def drpb():
        rpb.grad = None
        ops.neighborhood_attention(len(p.spatial), q, k, v, **p.kwargs(), rpb=rpb, backend="fused").square().sum() \
            .backward()
        return rpb.grad.clone()

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first, second = drpb(), drpb()
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.equal(first, second)
    assert _dq_ds_modes() == {(True, False, False)}
    torch.testing.assert_close(drpb(), first, rtol=1e-5, atol=1e-5)  # the default: tile-layout atomics
    assert _dq_ds_modes() == {(True, False, False), (False, True, True)}


def test_drpb_after_candidate_runs(monkeypatch):
    """The tuner runs dQ once per candidate before the chosen launch: with dS added by atomics (in tile or window
    layout), each run must start from a zeroed buffer, or dRPB sums every run (checked against the oracle)."""
    real_pick = decide.tile_config

    def pick_after_trials(kernel, q, k, v, params, has_rpb, run=None, *args, **kwargs):
        chosen, source = real_pick(kernel, q, k, v, params, has_rpb, run, *args, **kwargs)
        if run is not None:
            for _ in range(2):  # what timing candidates does
                run(chosen)
        return chosen, source

    monkeypatch.setattr(decide, "tile_config", pick_after_trials)
    _run(_fixed((6, 7), (3, 5), rpb=True, heads=2, batch=2), torch.float32, grads=True)


def test_frozen_rpb_after_trained_rpb_keeps_inputs():
    """A dQ plan built with the dS store must not serve a call without it (frozen RPB): the dS buffer argument is
    then a stand-in, which the kernel would overwrite."""
    p = _fixed((6, 7), (3, 5), rpb=True, heads=2, batch=2)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v, rpb = p.tensors(dtype=torch.float32, device=DEVICE, generator=gen)
    q.requires_grad_(True)
    for trained in (True, False):
        rpb.requires_grad_(trained)
        q_before = q.detach().clone()
        ops.neighborhood_attention(len(p.spatial), q, k, v, **p.kwargs(), rpb=rpb, backend="fused").sum().backward()
        assert torch.equal(q.detach(), q_before)
    assert _dq_ds_modes() == {(False, True, True), (False, True, False)}


@pytest.mark.parametrize("tma", [False, True], ids=["pointer-loads", "tma-loads"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, tma):
    cfg = Config(16, 16, 4, 1, tma)
    with autotune.forced(fwd=cfg, dq=cfg, dkdv=cfg):
        _run(_fixed((8, 10), (5, 3), d=(1, 2), rpb=True, heads=2, heads_kv=1, dim=32, dim_v=32), dtype, grads=True)
    _assert_tma_used(tma)
    # the interpreter runs bfloat16 through float32 copies (``launch._tokens``), which the plans record
    widened = INTERPRETED and dtype == torch.bfloat16
    assert all(plan.as_tokens == widened for plan in decide._PLANS.values())


@pytest.mark.parametrize("p", [_fixed((40,), 21, dim=16, heads=2, heads_kv=2), _fixed((9, 11), (5, 7), rpb=True)],
                         ids=["1d", "2d-rpb"])
def test_forward_large_logits(p):
    """Logits spread over hundreds (queries scaled by 400): the online softmax must follow a row's max as it grows
    from one key tile to the next, or exp2 overflows (a kernel that kept the first tile's max fails here); fp32,
    against the oracle."""
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    q, k, v, rpb = p.tensors(dtype=torch.float32, device=DEVICE, generator=gen)
    q = q * 400.0
    with autotune.forced(fwd=Config(16, 16, 4, 1)):
        out, lse = ops.neighborhood_attention(len(p.spatial), q, k, v, **p.kwargs(), rpb=rpb, return_lse=True,
                                              backend="fused")
    ref_out, ref_lse = oracle_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), p.spatial,
                                        p.kernel_size, p.stride, p.dilation, p.causal,
                                        rpb=None if rpb is None else rpb.double().cpu())
    # logits of ~500 keep ~5 significant digits of p in float32, and ~1 in the GPU's tf32 matmuls (measured 0.04 on
    # an H100); an overflow (the bug this is for) gives inf / NaN, which _rel_err rejects at any tolerance
    tol = 1e-3 if INTERPRETED else 0.1
    assert _rel_err(out, ref_out) < tol
    assert _rel_err(lse, ref_lse) < tol


# The selects on the same problems are a slow test: the default launch rule keeps them on problems whose boxes are
# rarely partial, which the rest of this file exercises (14 of its 139 launch decisions, dK/dV included).
@pytest.mark.parametrize("mask_in_dot", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["select-masks", "mask-in-dot"])
def test_mask_paths(monkeypatch, mask_in_dot):
    """Both ways every kernel masks a key box (a select per partial axis, or the window mask as the score matmul's
    initial value, ``decide.MASK_IN_DOT_FROM``), outputs and gradients against the oracle on boxes partial on one to
    three axes: 1-D / 2-D / 3-D, causal, stride, dilation, GQA, RPB (whose forward keeps the selects), odd sizes, and
    both dK/dV orientations (16-query tiles: keys as rows; 64-query tiles: queries as rows).  RPB without bias tiles,
    which carry the mask themselves (``test_rpb_from_bias_tiles_and_by_gather``)."""
    monkeypatch.setattr(decide, "MASK_IN_DOT_FROM", 0.0 if mask_in_dot else float("inf"))
    monkeypatch.setattr(decide, "BIAS_TILES", False)
    decide._PLANS.clear()
    small = Config(16, 16, 4, 1)
    with autotune.forced(fwd=small, dq=small, dkdv=small):
        _run(_fixed((5, 7, 9), (3, 5, 3), s=(1, 2, 1), d=(1, 1, 2), c=(True, False, False)), torch.float32, grads=True)
        _run(_fixed((9, 13), (5, 3), s=(2, 1), d=(1, 2), c=(False, True)), torch.float32, grads=True)
        _run(_fixed((7, 11), (5, 3), d=(1, 2), rpb=True), torch.float32, grads=True)
        _run(_fixed((37,), (7,), s=(3,), c=(True,)), torch.float32, grads=True)
    with autotune.forced(fwd=small, dq=small, dkdv=Config(16, 64, 4, 1)):
        _run(_fixed((6, 6, 10), (5, 3, 7), heads=4, heads_kv=2, batch=2), torch.float32, grads=True)
    forward = {plan.launch.meta["MASK_IN_DOT"] for plan in decide.plans("forward") if not plan.launch.meta["HAS_RPB"]}
    backward = {plan.dq.meta["MASK_IN_DOT"] for plan in decide.plans("backward")}
    backward |= {plan.dkdv.meta["MASK_IN_DOT"] for plan in decide.plans("backward")}
    rows = {plan.dkdv.meta["QUERY_ROWS"] for plan in decide.plans("backward")}
    assert forward == backward == {mask_in_dot} and rows == {False, True}
    assert len(decide.plans("backward")) == 5


def test_inference_without_lse_skips_its_store():
    """A call that needs no lse (no gradient, no return_lse) launches the forward without its lse store, on the first
    call and on its plan after it, and gets the oracle's output; asking for lse on the same problem gets a
    plan that stores it (outputs NaN-poisoned by ``poison_outputs``)."""
    p = _fixed((7, 9), (3, 5), rpb=True, heads=2, heads_kv=1)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v, rpb = p.tensors(dtype=torch.float32, device=DEVICE, generator=gen)
    decide._PLANS.clear()
    ref_out, ref_lse = oracle_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), p.spatial,
                                        p.kernel_size, p.stride, p.dilation, p.causal, rpb=rpb.double().cpu())
    with torch.no_grad():
        for call in range(2):  # the first call builds the plan, the second takes it
            out = ops.neighborhood_attention(2, q, k, v, **p.kwargs(), rpb=rpb, backend="fused")
            assert _rel_err(out, ref_out) < TOL[torch.float32], call
        assert [plan.launch.meta["STORE_LSE"] for plan in decide.plans("forward")] == [False]
        out, lse = ops.neighborhood_attention(2, q, k, v, **p.kwargs(), rpb=rpb, return_lse=True, backend="fused")
    assert _rel_err(out, ref_out) < TOL[torch.float32] and _rel_err(lse, ref_lse) < TOL[torch.float32]
    assert sorted(plan.launch.meta["STORE_LSE"] for plan in decide.plans("forward")) == [False, True]


def test_additional_keys_merge_through_lse():
    """functional.py merges extra keys through the lse: the lse gradient path of the backward."""
    _run(_fixed((30,), 7, s=2, heads=2, heads_kv=1), torch.float32, grads=True, extra=5)


def test_only_lse_used():
    """Gradient through the lse alone (out unused) reaches q and k."""
    p = _fixed((24,), 5)
    q, k, v, _ = p.tensors(dtype=torch.float32, device=DEVICE, requires_grad=True)
    _, lse = ops.na1d(q, k, v, 5, return_lse=True, backend="fused")
    lse.sum().backward()
    ref_q = q.detach().double().cpu().requires_grad_()
    _, ref_lse = oracle_attention(ref_q, k.detach().double().cpu(), v.detach().double().cpu(), (24,), (5,), (1,),
                                  (1,), (False,))
    ref_lse.sum().backward()
    assert _rel_err(q.grad, ref_q.grad) < 4 * TOL[torch.float32]
    assert v.grad.abs().max() < 1e-6  # values do not affect the lse


def test_module_training_step_matches_naive():
    """An NA module with RPB (NAT block attention): fused and naive give the same loss and parameter
    gradients (float32; the CI stand-in for the NAT-Mini training-step check on the GPU)."""
    torch.manual_seed(0)
    module = ops.NeighborhoodAttention2D(32, 2, kernel_size=5, dilation=(1, 2), rel_pos_bias=True).to(DEVICE)
    with torch.no_grad():
        module.rpb.normal_()  # a zero-initialised bias would hide a wrong dRPB
    x = torch.randn(2, 9, 10, 32, device=DEVICE)
    grads = {}
    for backend in ("naive", "fused"):
        module.zero_grad()
        module.backend = backend
        loss = module(x).square().mean()
        loss.backward()
        grads[backend] = (loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()})
    loss_n, g_n = grads["naive"]
    loss_f, g_f = grads["fused"]
    # compiled kernels multiply float32 in TF32 (like SDPA on Ampere+), the interpreter in full fp32
    assert torch.allclose(loss_f, loss_n, rtol=1e-5 if INTERPRETED else 1e-3)
    for name in g_n:
        assert _rel_err(g_f[name], g_n[name]) < (1e-4 if INTERPRETED else 5e-3), name


def _problem(device=DEVICE, dtype=torch.float32, head_dim=16):
    params = NAParams((8, 8), (3, 3), (1, 1), (1, 1), (False, False))
    return Problem(params, dtype, torch.device(device), head_dim, head_dim, 2, 2, False, False)


def test_unsupported_reasons(monkeypatch):
    assert BACKEND.unsupported(_problem()) is None
    assert "float64" in BACKEND.unsupported(_problem(dtype=torch.float64))
    assert "head dim" in BACKEND.unsupported(_problem(head_dim=512))
    import ops.fused as fused

    monkeypatch.setattr(fused, "interpreted", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = BACKEND.unsupported(_problem(device="cpu"))
    assert "CUDA" in reason and "TRITON_INTERPRET=1" in reason
    with pytest.raises(ValueError, match="fused"):
        q = torch.randn(1, 8, 8, 2, 16)
        ops.na2d(q, q, q, 3, backend="fused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_repeated_calls_run_from_the_plans(dtype):
    """The second call of a problem launches from the cached plans (no views, no tile choice), forward
    and backward: fresh strided q/k/v views of a qkv projection and a float32 RPB each time, outputs
    and all four gradients checked against the oracle."""
    spatial, kernel, heads, dim = (6, 9), (3, 5), 2, 16
    for call in range(2):  # the second call runs from the plans
        gen = torch.Generator(device=DEVICE).manual_seed(100 + call)
        qkv = torch.randn(2, *spatial, 3, heads, dim, dtype=dtype, device=DEVICE, generator=gen, requires_grad=True)
        q, k, v = qkv.unbind(-3)
        rpb = torch.randn(heads, 5, 9, device=DEVICE, generator=gen, requires_grad=True)
        out, lse = ops.na2d(q, k, v, kernel, dilation=(2, 1), rpb=rpb, return_lse=True, backend="fused")
        ref_in = [t.detach().double().cpu().requires_grad_() for t in (qkv, rpb)]
        ref_out, ref_lse = oracle_attention(*ref_in[0].unbind(-3), spatial, kernel, (1, 1), (2, 1), (False, False),
                                            rpb=ref_in[1])
        assert _rel_err(out, ref_out) < TOL[dtype] and _rel_err(lse, ref_lse) < TOL[dtype]
        assert out.shape == (2, *spatial, heads, dim) and out.is_contiguous()
        assert len(decide.plans("forward")) == 1, "the first call should have left a plan"
        # dense d_out and d_lse (an expanded gradient, as .sum() gives, is another layout: a plan of its own)
        weight = torch.randn(out.shape, dtype=dtype, device=DEVICE, generator=gen)
        lse_weight = torch.randn(lse.shape, device=DEVICE, generator=gen)
        got = torch.autograd.grad((out * weight).float().sum() + (lse * lse_weight).sum(), (qkv, rpb))
        ref = torch.autograd.grad((ref_out * weight.double().cpu()).sum() + (ref_lse * lse_weight.double().cpu()).sum(),
                                  ref_in)
        for g, r in zip(got, ref):
            assert _rel_err(g, r) < 4 * TOL[dtype]
        assert len(decide.plans("backward")) == 1, "the first backward should have left a plan"


@pytest.mark.parametrize("scale", [0.7, -0.5, 0.0])
@pytest.mark.parametrize("rpb", [False, True])
def test_any_scale_sign(scale, rpb):
    """A positive scale without RPB takes the forward's folded-scale path (row max before scaling);
    negative and zero scales, and RPB, take the other.  Both against the oracle."""
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    q, k, v = (torch.randn(1, 7, 6, 2, 16, device=DEVICE, generator=gen) for _ in range(3))
    bias = torch.randn(2, 5, 3, device=DEVICE, generator=gen) if rpb else None
    out, lse = ops.na2d(q, k, v, (3, 2), dilation=(2, 1), rpb=bias, scale=scale, return_lse=True, backend="fused")
    ref_out, ref_lse = oracle_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), (7, 6), (3, 2), (1, 1),
                                        (2, 1), (False, False), rpb=None if bias is None else bias.double().cpu(),
                                        scale=scale)
    assert _rel_err(out, ref_out) < TOL[torch.float32] and _rel_err(lse, ref_lse) < TOL[torch.float32]


def test_empty_launch_hook_chain_is_skipped():
    """A plan's launch passes no hook (and builds no launch metadata) for an empty hook chain, and
    passes a chain with hooks (a profiler's) on."""
    import triton

    chain = triton.knobs.HookChain()
    assert launch._hook(None) is None and launch._hook(chain) is None
    chain.add(print)
    assert launch._hook(chain) is chain and launch._hook(print) is print


def test_inference_calls_skip_autograd_and_training_calls_do_not():
    """No input needs a gradient: no autograd node; one does: the eager autograd.Function, whose
    gradients match the oracle's (checked in depth by the random backward tests)."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    q, k, v = (torch.randn(1, 10, 2, 16, device=DEVICE, generator=gen) for _ in range(3))
    out = ops.na1d(q, k, v, 5, backend="fused")
    assert out.grad_fn is None and not out.requires_grad
    qg = q.clone().requires_grad_()
    out_g = ops.na1d(qg, k, v, 5, backend="fused")
    assert out_g.grad_fn is not None and "EagerFusedNA" in type(out_g.grad_fn).__name__
    torch.testing.assert_close(out_g.detach(), out)
    with torch.no_grad():
        assert ops.na1d(qg, k, v, 5, backend="fused").grad_fn is None
    (grad,) = torch.autograd.grad(out_g.sum(), qg)
    ref_q = q.double().cpu().requires_grad_()
    ref, _ = oracle_attention(ref_q, k.double().cpu(), v.double().cpu(), (10,), (5,), (1,), (1,), (False,))
    (ref_grad,) = torch.autograd.grad(ref.sum(), ref_q)
    assert _rel_err(grad, ref_grad) < 4 * TOL[torch.float32]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "custom-op"])
def test_frozen_rpb_gets_no_gradient_kernel(monkeypatch, traced):
    """An RPB that needs no gradient (frozen while fine-tuning) still biases the scores, but the dRPB
    kernel does not run; q/k/v gradients match the oracle, on the eager path and through the custom op
    (what compiled code calls)."""
    calls = _record_drpb_paths(monkeypatch)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    mk = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    q, k, v, rpb = mk(1, 6, 5, 2, 16), mk(1, 6, 5, 2, 16), mk(1, 6, 5, 2, 16), mk(2, 5, 5)

    def loss_of(q, k, v, rpb):
        if traced:
            from ops.fused.op import fused_na_forward
            out, _ = fused_na_forward(q, k, v, rpb, [3, 3], [1, 1], [1, 1], [False, False], 0.25)
        else:
            out = ops.na2d(q, k, v, 3, rpb=rpb, scale=0.25, backend="fused")
        return out.square().sum()

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(loss_of(*inputs, rpb), inputs)
    assert calls == []
    ref_in = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref_in, (6, 5), (3, 3), (1, 1), (1, 1), (False, False), rpb=rpb.double().cpu(),
                                  scale=0.25)
    ref = torch.autograd.grad(ref_out.square().sum(), ref_in)
    for g, r in zip(grads, ref):
        assert _rel_err(g, r) < 4 * TOL[torch.float32]
    # the same call with a trainable bias runs the kernel
    rpb_g = rpb.clone().requires_grad_()
    torch.autograd.grad(loss_of(*inputs, rpb_g), [inputs[0], rpb_g])
    assert calls == ["reduce_tile_ds"]


def test_custom_op_opcheck():
    from ops.fused.op import fused_na_forward

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=DEVICE, generator=gen, requires_grad=True)  # noqa: E731
    q, k, v = mk(1, 5, 6, 2, 16), mk(1, 5, 6, 1, 16), mk(1, 5, 6, 1, 16)
    rpb = mk(2, 5, 3)
    args = (q, k, v, rpb, [3, 2], [1, 2], [1, 2], [False, False], 0.3)
    torch.library.opcheck(fused_na_forward, args, test_utils=("test_schema", "test_autograd_registration",
                                                              "test_faketensor"))


def test_torch_compile_fullgraph_forward_backward():
    """No graph break: the op (forward and backward) is opaque to dynamo, shapes from the fake impls."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    mk = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    q, k, v, rpb = mk(2, 6, 7, 2, 16), mk(2, 6, 7, 2, 16), mk(2, 6, 7, 2, 16), mk(2, 5, 5)

    def f(q, k, v, rpb):
        return ops.na2d(q, k, v, 3, dilation=(2, 1), rpb=rpb, backend="fused").square().sum()

    inputs = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
    # The backend must have been loaded once (eagerly) before tracing: dynamo cannot trace the import.
    ops.backends.load_backend("fused")
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(*inputs)
    loss.backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
    ref = f(*eager)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-6)
    for a, b in zip(inputs, eager):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)


# An unusual resolved config for the 1-D problem of the cache tests (not what the defaults table gives it).
_CACHED_ENTRY = {"outer_tile": [1, 1, 16], "inner_tile": [1, 1, 32], "num_warps": 2, "num_stages": 1}
_CACHED_CONFIG = autotune.ResolvedConfig((1, 1, 16), (1, 1, 32), 2, 1)


@pytest.fixture
def cache_problem(tmp_path, monkeypatch):
    """A tuning cache file of its own (empty, nothing memoised) and a small 1-D problem:
    (path, q, k, v, params, key)."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("NAMODELS_FUSED_CACHE", str(path))
    monkeypatch.setattr(autotune, "_cache", None)
    monkeypatch.setattr(decide, "_PLANS", {})
    q, k, v, _ = _fixed((20,), 5).tensors(dtype=torch.float32, device=DEVICE)
    params = NAParams((20,), (5,), (1,), (1,), (False,))
    return path, q, k, v, params, autotune.problem_key("fwd", q, k, v, params, False)


def test_autotune_cache_roundtrip(cache_problem, monkeypatch):
    _, q, k, v, params, key = cache_problem
    autotune._store(key, _CACHED_ENTRY)
    monkeypatch.setattr(autotune, "_cache", None)  # force a reload from disk
    assert decide.tile_config("fwd", q, k, v, params, False)[0] == _CACHED_CONFIG
    out = ops.na1d(q, k, v, 5, backend="fused")  # runs with the cached (unusual) tiles
    ref, _ = oracle_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), (20,), (5,), (1,), (1,),
                              (False,))
    assert _rel_err(out, ref) < TOL[torch.float32]


def test_autotune_cache_ignores_entries_of_other_code(cache_problem, monkeypatch):
    """An entry tuned on other kernel / launcher sources (another ``CODE_VERSION`` in its key) is not used: the problem
    gets the defaults-table launch, and its own entry once stored under today's version."""
    path, q, k, v, params, key = cache_problem
    assert key.endswith(f"|v{autotune.CODE_VERSION}")
    path.write_text(json.dumps({key.replace(autotune.CODE_VERSION, "0" * 12): _CACHED_ENTRY}))
    default = decide.tile_config("fwd", q, k, v, params, False)[0]
    assert default == decide._default_resolved("fwd", params, 16) != _CACHED_CONFIG
    monkeypatch.setattr(autotune, "_cache", None)
    monkeypatch.setattr(decide, "_PLANS", {})
    autotune._store(key, _CACHED_ENTRY)
    assert decide.tile_config("fwd", q, k, v, params, False)[0] == _CACHED_CONFIG


def test_tma_launch_installs_a_scratch_allocator_in_its_thread():
    """Triton's allocator is per thread (autograd runs the backward in worker threads): a launch with TMA
    loads installs one in the thread that launches it, a launch without TMA leaves the thread alone."""
    import threading

    from triton.runtime import _allocation

    p = _fixed((20,), 5, heads=1)
    # compiled, TMA needs 16-bit inputs (float32 would fall back to pointer loads and install nothing)
    q, k, v, _ = p.tensors(dtype=TMA_DTYPE, device=DEVICE)
    seen = {}

    def launch_in_fresh_thread(tma):
        with autotune.forced(fwd=Config(16, 16, 4, 1, tma)):
            ops.na1d(q, k, v, 5, backend="fused")
        seen[tma] = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)

    for tma in (False, True):
        worker = threading.Thread(target=launch_in_fresh_thread, args=(tma,))
        worker.start()
        worker.join()
    assert seen == {False: True, True: False}


def test_default_tma_only_for_long_loops():
    """The head-dim-128 defaults use TMA, except where a program builds its own descriptors and loops over few
    tiles (descriptor set-up would dominate): a 7x7 window on 56x56 keeps pointer loads unless the launcher builds
    the descriptors on the host; an 80x80 window uses TMA either way."""
    small = NAParams((56, 56), (7, 7), (1, 1), (1, 1), (False, False))
    large = NAParams((256, 256), (80, 80), (1, 1), (1, 1), (False, False))
    for kernel in ("fwd", "dq", "dkdv"):
        assert decide.default_config(kernel, 128).tma
        assert not decide._default_resolved(kernel, small, 128).tma
        assert decide._default_resolved(kernel, small, 128, host_descriptors=True).tma
        assert decide._default_resolved(kernel, large, 128).tma
        assert not decide._default_resolved(kernel, large, 32).tma  # head dim 32: pointer loads


@pytest.mark.parametrize("packed", [True, False])
def test_forward_default_keeps_tma_only_with_host_descriptors(monkeypatch, packed):
    """The launcher tells the defaults whether the forward's descriptors are built on the host, as it decides with
    the tensors in hand: packed heads with a power-of-two head dim get them (and TMA on a short loop); keys and
    values whose heads are not packed (a slice of a wider tensor) build them per program, so the short loop keeps
    pointer loads.  (autotune used to guess from the dilation alone.)  float16 on a GPU (``TMA_DTYPE``'s rule, with
    its tighter tolerance)."""
    monkeypatch.setattr(decide, "_PLANS", {})
    monkeypatch.setattr(autotune, "_cache", {})
    dtype = torch.float32 if INTERPRETED else torch.float16
    params = NAParams((6, 6), (3, 3), (1, 1), (1, 1), (False, False))
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 6, 6, 2, 32, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(2, 1, 6, 6, 2, 32 if packed else 64, generator=gen).to(DEVICE, dtype)
    k, v = kv[0, ..., :32], kv[1, ..., :32]
    out = ops.na2d(q, k, v, 3, backend="fused")
    ref, _ = oracle_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), (6, 6), (3, 3), (1, 1), (1, 1),
                              (False, False))
    assert _rel_err(out, ref) < TOL[dtype]
    (plan,) = decide.plans("forward")
    assert plan.choices.host_desc == packed  # host descriptors
    assert decide.window_regime(params) == "small" and plan.config.tma == packed


def test_head_dim_32_defaults_follow_the_window_regime():
    """Head dims up to 32: small windows get 16-query one-warp tiles (half the keys per query of the table's
    tiles, with TMA loads where the descriptors are built on the host), windows that cover their whole dilation group
    one 64-query tile per group, other windows the head-dim table; wider heads ignore the regime."""
    nat = NAParams((56, 56), (7, 7), (1, 1), (1, 1), (False, False))
    dinat = NAParams((56, 56), (7, 7), (1, 1), (8, 8), (False, False))
    large = NAParams((64, 64), (13, 13), (1, 1), (1, 1), (False, False))
    assert [decide.window_regime(p) for p in (nat, dinat, large)] == ["small", "dense-group", "large"]
    fwd = decide._default_resolved("fwd", nat, 32, host_descriptors=True)
    assert (fwd.outer_tile, fwd.inner_tile, fwd.num_warps, fwd.tma) == ((1, 2, 8), (1, 4, 16), 1, True)
    for kernel in ("dq", "dkdv"):  # TMA only where the backward builds its descriptors on the host
        config = decide._default_resolved(kernel, nat, 32)
        assert math.prod(config.outer_tile) == 16 and config.num_warps == 1 and not config.tma
        with_host = decide._default_resolved(kernel, nat, 32, host_descriptors=True)
        assert with_host == dataclasses.replace(config, tma=True)
    dense = decide._default_resolved("fwd", dinat, 32)
    assert (dense.outer_tile, dense.inner_tile, dense.num_warps) == ((1, 8, 8), (1, 8, 8), 4)
    for params in (large, nat):
        assert decide.default_config("fwd", 32, params if params is large else None) == decide.DEFAULTS["fwd"][0][1]
    assert decide.default_config("fwd", 64, nat) == decide.default_config("fwd", 64)


@pytest.mark.parametrize("tma", [False, True])
def test_tuner_tries_tma_candidates_only_where_allowed(monkeypatch, tma):
    """TMA candidates run as their pointer-load twins where a launch cannot use TMA (older GPU, float32,
    unaligned views): the tuner must time only the twins there (each once), and the TMA ones where it can."""
    timed = []
    monkeypatch.setattr(autotune, "_kernel_ms", lambda fn: fn() or 1.0)
    monkeypatch.setattr(autotune, "_store", lambda key, entry: None)
    params = NAParams((64,), (9,), (1,), (1,), (False,))
    q = torch.zeros(1, 64, 1, 32)
    best = autotune.tune("k", decide.tuner_candidates("fwd", q, params, tma), timed.append)
    assert best is not None
    assert any(launch.tma for launch in timed) == tma
    assert any(not launch.tma for launch in timed)
    assert len(timed) == len(set(timed))


# ------------------------------------------------------------------------------------------------
# GPU (run on the device machine: pytest -m gpu tests/test_fused.py)
# ------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA (compiled kernels)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(2))
def test_gpu_random_problems(dtype, seed):
    rng = random.Random(1000 + seed)
    for rank in (1, 2, 3):
        p = random_problem(rng, rank=rank, max_tokens=400, max_dim=64)
        p.dim = max(p.dim, 8)
        _run(p, dtype, grads=True, seed=seed)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dim", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_head_dims(dim, dtype):
    """The default tiles of every head dim fit the GPU, in 16-bit and in float32 (twice the bytes per row)."""
    _run(_fixed((14, 18), (7, 5), d=(2, 1), rpb=True, heads=4, heads_kv=2, dim=dim, dim_v=dim), dtype, grads=True)
    # a window long enough for the TMA defaults (16-bit) at head dim 128
    _run(_fixed((40, 48), (21, 23), heads=2, heads_kv=1, dim=dim, dim_v=dim), dtype, grads=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,seed", [(torch.bfloat16, 0), (torch.bfloat16, 1), (torch.float16, 2),
                                        (torch.float32, 3)])
def test_gpu_tma_loads(dtype, seed):
    """TMA loads on random problems (any rank, stride, dilation, causal, RPB, GQA, head dims 8-128 that
    pad to the descriptor box) with 64- and 128-row tiles; float32 must fall back to pointer loads."""
    rng = random.Random(2000 + seed)
    for rank in (1, 2, 3):
        decide._PLANS.clear()
        p = random_problem(rng, rank=rank, max_tokens=600, max_dim=128)
        p.dim, p.dim_v = max(p.dim, 8) // 8 * 8, max(p.dim_v, 8) // 8 * 8  # 16-byte token strides
        cfg = Config(64, 64, 4, 3, True) if rank != 2 else Config(128, 32, 8, 2, True)
        dq_cfg = Config(64, 64, 4, 2, True)
        if dtype == torch.float32:  # tiles that fit shared memory at head dim 128 in float32 (dQ's atomic dS
            cfg = dq_cfg = Config(32, 32, 4, 2, True)  # adds stage their tile through shared memory too)
        with autotune.forced(fwd=cfg, dq=dq_cfg, dkdv=Config(64, 32, 4, 2, True)):
            _run(p, dtype, grads=True, seed=seed)
        _assert_tma_used(dtype != torch.float32)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("warps", [1, 2])
def test_gpu_small_window_tiles(warps):
    """The tuner's small-window candidates: 16-query tiles on one or two warps (mma.sync, no wgmma) in every
    kernel, with dK/dV in both orientations (32-query tiles: keys as rows; 64: queries as rows, where the
    problem has that many)."""
    rng = random.Random(3000 + warps)
    small = Config(16, 64, warps, 2)
    dkdv = Config(16, 32 * warps, warps, 2)
    for rank in (1, 2, 3):
        decide._PLANS.clear()
        p = random_problem(rng, rank=rank, max_tokens=400, max_dim=64)
        p.dim = max(p.dim, 8)
        with autotune.forced(fwd=small, dq=small, dkdv=dkdv):
            _run(p, torch.bfloat16, grads=True, seed=warps)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rpb", [False, True])
def test_gpu_small_window_defaults_use_host_descriptors(rpb, monkeypatch):
    """NAT's small windows on the default tiles (no cache, no tuning): one-warp 16-query tiles whose forward, dQ and
    dK/dV read through TMA descriptors built on the host, with GQA and RPB."""
    monkeypatch.setattr(decide, "_PLANS", {})
    monkeypatch.setattr(autotune, "_cache", {})
    _run(_fixed((20, 24), (7, 7), rpb=rpb, heads=4, heads_kv=2, dim=32, dim_v=32, batch=2), torch.bfloat16,
         grads=True)
    (fwd,), (bwd,) = decide.plans("forward"), decide.plans("backward")
    assert fwd.launch.meta["HOST_DESC"] and bwd.dq.meta["HOST_DESC"] and bwd.dkdv.meta["HOST_DESC"]


@pytest.mark.gpu
@gpu
def test_gpu_tma_falls_back_on_misaligned_views():
    """A view whose base is not 16-byte aligned cannot be a TMA source: the launch must use pointer
    loads (and stay correct), and an aligned call of the same problem afterwards uses TMA again."""
    p = _fixed((20, 24), (7, 9), rpb=True, heads=2, heads_kv=2, dim=64, dim_v=64)
    q, k, v, _ = p.tensors(dtype=torch.bfloat16, device=DEVICE)
    cfg = Config(64, 64, 4, 3, True)
    with autotune.forced(fwd=cfg, dq=cfg, dkdv=cfg):
        storage = torch.randn(k.numel() + 1, dtype=k.dtype, device=DEVICE)
        k_odd = storage[1:].view(k.shape)  # 2-byte offset
        k_odd.copy_(k)
        ref = ops.neighborhood_attention(2, q.float(), k.float(), v.float(), **p.kwargs(), backend="naive")
        out = ops.neighborhood_attention(2, q, k_odd, v, **p.kwargs(), backend="fused")
        assert _rel_err(out, ref) < TOL[torch.bfloat16]
        assert [plan.launch.meta["TMA"] for plan in decide.plans("forward")] == [False]
        out = ops.neighborhood_attention(2, q, k, v, **p.kwargs(), backend="fused")
        assert _rel_err(out, ref) < TOL[torch.bfloat16]
        assert sorted(plan.launch.meta["TMA"] for plan in decide.plans("forward")) == [False, True]


@pytest.mark.gpu
@gpu
def test_gpu_planned_launches_pass_addresses_and_respect_alignment():
    """A plan's compiled launch passes the tensors' addresses; a call whose query is not 16-byte aligned (the
    kernel was compiled for an aligned one) takes Triton's own launch, and the next aligned call the plan's again.
    Device-built descriptors (TMA without host descriptors) take their scratch from one buffer per stream."""
    p = _fixed((20, 24), (7, 9), rpb=True, heads=2, heads_kv=2, dim=64, dim_v=64)
    q, k, v, rpb = p.tensors(dtype=torch.bfloat16, device=DEVICE)
    rpb = rpb.float()
    params = NAParams((20, 24), (7, 9), (1, 1), (1, 1), (False, False))
    cfg = Config(64, 64, 4, 3, True)
    storage = torch.randn(q.numel() + 1, dtype=q.dtype, device=DEVICE)
    q_odd = storage[1:].view(q.shape)  # 2-byte offset
    q_odd.copy_(q)
    ref = ops.neighborhood_attention(2, q.float(), k.float(), v.float(), **p.kwargs(), rpb=rpb, backend="naive")
    import triton
    from triton.runtime import _allocation

    launch._SCRATCH.clear()
    previous = _allocation._allocator.get()  # (inductor installs its own when a test before this one compiled)
    triton.set_allocator(launch._torch_scratch)
    try:
        with autotune.forced(fwd=cfg):
            for query in (q, q, q_odd, q):
                out, _ = launch.forward(query, k, v, rpb, params, 64 ** -0.5, host_descriptors=False)
                assert _rel_err(out, ref) < TOL[torch.bfloat16]
    finally:
        triton.set_allocator(previous)
    (plan,) = decide.plans("forward")
    assert plan.launch.compiled is not None and plan.launch.pointers_only and plan.launch.all_aligned
    assert plan.launch.meta["TMA"] and not plan.launch.meta["HOST_DESC"]
    assert len(launch._SCRATCH) == 1


@pytest.mark.gpu
@gpu
def test_gpu_autotune_small_problem(tmp_path, monkeypatch):
    """The tuner times candidates from CUDA-graph replays, writes a cache entry per kernel, and the
    tuned tiles give oracle-correct outputs and gradients (a small 2-D problem with RPB and GQA)."""
    monkeypatch.setenv("NAMODELS_FUSED_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(autotune, "_cache", None)
    monkeypatch.setattr(decide, "_PLANS", {})
    timed = []
    real = autotune._kernel_ms
    monkeypatch.setattr(autotune, "_kernel_ms", lambda fn: timed.append(1) or real(fn))
    autotune.set_autotune(True)
    try:
        _run(_fixed((14, 14), (7, 7), rpb=True, heads=4, heads_kv=2, dim=32, dim_v=32, batch=8), torch.bfloat16,
             grads=True)
    finally:
        autotune.set_autotune(None)
    entries = json.loads((tmp_path / "tune.json").read_text())
    assert {key.split("|")[0] for key in entries} == {"fwd", "dq", "dkdv"}
    assert all(entry["ms"] > 0 for entry in entries.values()) and len(timed) >= 3


@pytest.mark.parametrize("backend", ["fused", "naive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_qkv_matches_the_oracle(backend, dtype):
    """``neighborhood_attention_qkvpacked`` on ``qkv [B, *spatial, 3, H, D]``: output, lse, the packed gradient and
    dRPB against the oracle, on the first call and from the plans; the fused backend writes the gradient as one
    buffer (one autograd node, no stack of three), the naive one takes ``qkv.unbind(-3)``."""
    spatial, kernel, dilation, heads, dim = (6, 9), (3, 5), (2, 1), 2, 16
    for call in range(2):
        gen = torch.Generator(device=DEVICE).manual_seed(40 + call)
        qkv = torch.randn(2, *spatial, 3, heads, dim, device=DEVICE, generator=gen).to(dtype).requires_grad_()
        rpb = torch.randn(heads, 5, 9, device=DEVICE, generator=gen, requires_grad=True)
        out, lse = ops.neighborhood_attention_qkvpacked(2, qkv, kernel, dilation=dilation, rpb=rpb, return_lse=True,
                                                        backend=backend)
        ref_in = [t.detach().double().cpu().requires_grad_() for t in (qkv, rpb)]
        ref_out, ref_lse = oracle_attention(*ref_in[0].unbind(-3), spatial, kernel, (1, 1), dilation, (False, False),
                                            rpb=ref_in[1])
        tol = TOL[dtype] if backend == "fused" else 1e-5 if dtype == torch.float32 else 3e-2
        assert out.dtype == dtype and _rel_err(out, ref_out) < tol and _rel_err(lse, ref_lse) < tol
        if backend == "fused":
            assert type(out.grad_fn).__name__ == "_EagerFusedNAPackedBackward"
        weight = torch.randn(out.shape, device=DEVICE, generator=gen)
        got = torch.autograd.grad((out.float() * weight).sum() + lse.sum(), (qkv, rpb))
        ref = torch.autograd.grad((ref_out * weight.double().cpu()).sum() + ref_lse.sum(), ref_in)
        assert got[0].shape == qkv.shape and got[0].dtype == dtype and got[0].is_contiguous()
        for g, r in zip(got, ref):
            assert _rel_err(g, r) < 4 * tol
    if backend == "fused":
        assert len(decide.plans("forward")) == 1 and len(decide.plans("backward")) == 1


def test_packed_qkv_needs_three_slices():
    with pytest.raises(ValueError, match=r"qkv: expected a 6-D tensor \[B, L0, L1, 3, H, D\]"):
        ops.neighborhood_attention_qkvpacked(2, torch.zeros(1, 5, 5, 2, 2, 8, device=DEVICE), 3, backend="fused")


def test_packed_custom_op_opcheck():
    from ops.fused.op import fused_na_packed_forward

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    qkv = torch.randn(1, 5, 6, 3, 2, 16, device=DEVICE, generator=gen, requires_grad=True)
    rpb = torch.randn(2, 5, 3, device=DEVICE, generator=gen, requires_grad=True)
    args = (qkv, rpb, [3, 2], [1, 2], [1, 2], [False, False], 0.3)
    torch.library.opcheck(fused_na_packed_forward, args, test_utils=("test_schema", "test_autograd_registration",
                                                                     "test_faketensor"))


def test_torch_compile_packed_qkv_forward_backward():
    """The packed op traces into one graph whose backward has no stack of three gradients; gradients match eager."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    qkv = torch.randn(2, 6, 7, 3, 2, 16, device=DEVICE, generator=gen)
    rpb = torch.randn(2, 5, 5, device=DEVICE, generator=gen)

    def f(qkv, rpb):
        return ops.neighborhood_attention_qkvpacked(2, qkv, 3, dilation=(2, 1), rpb=rpb, backend="fused").square().sum()

    ops.backends.load_backend("fused")
    graphs = []

    def backend(gm, inputs):
        from torch._functorch.aot_autograd import aot_module_simplified
        from functorch.compile import make_boxed_func

        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)

    inputs = [t.clone().requires_grad_() for t in (qkv, rpb)]
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend=backend)(*inputs), inputs)
    eager_inputs = [t.clone().requires_grad_() for t in (qkv, rpb)]
    want = torch.autograd.grad(f(*eager_inputs), eager_inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert "namodels.fused_na_packed_backward.default" in targets
    assert not any("stack" in t or "cat" in t for t in targets)


def _plan_launches(plan) -> list:
    """Every kernel launch a forward or backward plan holds (batch chunks, bias tiles, delta, reductions)."""
    found = []
    for value in vars(plan).values():
        if isinstance(value, launch._Launch):
            found.append(value)
        elif isinstance(value, tuple):
            found += [item for item in value if isinstance(item, launch._Launch)]
            found += [item[0] for item in value if isinstance(item, tuple) and item
                      and isinstance(item[0], launch._Launch)]
    return found


def test_every_planned_launch_names_all_its_constexprs():
    """A plan's compiled launch passes the constexprs in the kernel's order from the launch's ``meta`` and cannot
    fall back on a default: every constexpr of every planned kernel (bias tiles, dRPB reductions included) is set."""
    import inspect

    _run(_fixed((6, 7), (3, 5), rpb=True, heads=2, batch=2), torch.float32, grads=True)
    plans = list(decide.plans("forward")) + list(decide.plans("backward"))
    launches = [item for plan in plans for item in _plan_launches(plan)]
    kernels_seen = {item.kernel for item in launches}
    assert {launch.kernels.na_bias_tiles_kernel, launch.kernels.na_bias_tiles_inverse_kernel,
            launch.kernels.na_drpb_tiles_kernel} <= kernels_seen
    for item in launches:
        fn = getattr(item.kernel, "fn", item.kernel)
        constexprs = [name for name, arg in inspect.signature(fn).parameters.items()
                      if "constexpr" in str(arg.annotation)]
        missing = [name for name in constexprs if name not in item.meta]
        assert not missing, f"{fn.__name__}: {missing}"
