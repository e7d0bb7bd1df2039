"""The fused backend's Hopper kernels (the forward in ``ops/fused/hopper.py``, dK/dV in ``ops/fused/hopper_dkdv.py``)
against the dense float64 oracle.

The kernels need an sm_90 GPU (``gpu`` tests); their host sides (eligibility, tiles, window tables) are plain torch
and run here too, and so does an offline sm_90 compile that checks the forward's scheduled loop.  Each GPU case
asserts that the call took the Hopper kernel, poisons every output buffer with NaN first, and covers masked and
mask-free launches, padded tiles, GQA, causal and strided axes, both 16-bit dtypes and both head dims.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import ops  # noqa: E402
from ops.fused import decide, hopper, hopper_dkdv, hopper_dq, launch, launch_order  # noqa: E402
from ops.window import NAParams, axis_window  # noqa: E402
from tests.oracle import RandomProblem, dense_mask_and_bias_index, oracle_attention  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("h100_sms_without_a_gpu")


def _params(spatial, kernel, stride=None, causal=None):
    rank = len(spatial)
    return NAParams(tuple(spatial), tuple(kernel), tuple(stride or (1,) * rank), (1,) * rank,
                    tuple(causal or (False,) * rank))


def _plan(spatial, kernel, stride=None, heads=2, dim=128, batch=1, causal=None):
    params = _params(spatial, kernel, stride, causal)
    q4 = torch.zeros(batch, params.num_tokens, heads, dim, dtype=torch.bfloat16)
    return hopper.build_launches(q4, q4, q4, params, dim**-0.5, True)


def test_mask_only_where_some_tile_is_partial():
    # 2-D stride 16 with an 80 x 80 window: every query tile shares its window, whose span the key tiles cover
    # exactly; the unstrided problem has tiles partly outside some query's window
    assert not _plan((256, 256), (80, 80), (16, 16)).masked
    assert _plan((256, 256), (80, 80)).masked
    assert not _plan((32768,), (2048,), (256,)).masked and _plan((32768,), (2048,)).masked
    fw = _plan((30, 48, 80), (18, 24, 24))
    assert fw.masked and len(fw.q_tile) == 3 and len(fw.kv_tile) == 3
    assert fw.q_tile[0] * fw.q_tile[1] * fw.q_tile[2] == hopper.ROWS
    assert fw.kv_tile[0] * fw.kv_tile[1] * fw.kv_tile[2] == hopper.COLS


def test_one_program_per_sm_without_masks_or_in_1d(monkeypatch):
    """Mask-free launches (every tile's loop as long) and masked 1-D ones without causal axes (loops as long but at
    the ends) run one program per SM over all work items (132 here: ``h100_sms_without_a_gpu``); other masked ones one
    program per work item, which the hardware hands out as SMs free up."""
    strided, unstrided = _plan((256, 256), (80, 80), (16, 16), heads=24), _plan((256, 256), (80, 80), heads=24)
    assert strided.programs == unstrided.programs == 512 * 24
    assert strided.persistent and strided.main_grid(torch.device("cpu")) == (132,)
    assert not unstrided.persistent and unstrided.main_grid(torch.device("cpu")) == (512, 24)
    assert strided.meta["PERSISTENT_"] and not unstrided.meta["PERSISTENT_"]
    small = _plan((64, 64), (32, 32), (16, 16))
    assert small.main_grid(torch.device("cpu")) == (small.programs,) and small.programs < 132
    line, causal_line = _plan((32768,), (2048,), heads=16), _plan((32768,), (2048,), heads=16, causal=(True,))
    assert line.masked and line.persistent and line.main_grid(torch.device("cpu")) == (132,)
    assert causal_line.masked and not causal_line.persistent
    monkeypatch.setattr(hopper, "PERSISTENT_MASKED_RANKS", ())
    assert not _plan((32768,), (2048,), heads=16).persistent


@pytest.mark.parametrize("spatial, kernel, stride, causal", [
    ((4, 16, 24), (3, 9, 9), (1, 2, 1), (True, False, False)), ((40, 24), (33, 17), (8, 1), (False, True)),
    ((300,), (129,), (64,), (False,))])
def test_window_tables_follow_the_window_rules(spatial, kernel, stride, causal):
    """Every position's window, and every query tile's key span, its part inside all its rows' windows and its first
    query, per axis (leading dummy axes first), as ``ops.window`` and the portable kernels' loops define them."""
    params = _params(spatial, kernel, stride, causal)
    q_tile = (1,) * (3 - len(spatial)) + tuple(min(8, L) for L in spatial[:-1]) + (128 // math.prod(
        min(8, L) for L in spatial[:-1]),)
    starts, spans, rows = hopper.window_tables(params, q_tile)
    axes = [(1, 1, 1, False)] * (3 - len(spatial)) + list(zip(spatial, kernel, stride, causal))
    for a, ((L, K, s, c), t) in enumerate(zip(axes, q_tile)):
        windows = [tuple(int(x) for x in axis_window(i, L, K, s, 1, c)[2:]) for i in range(L)]
        assert starts[a, :L].tolist() == [list(w) for w in windows]
        for tile in range(-(-L // t)):
            first, last = tile * t, min(tile * t + t, L) - 1
            assert spans[a, tile, :5].tolist() == [windows[first][0], windows[last][1], windows[last][0],
                                                   windows[first][1], first]
    r = torch.arange(math.prod(q_tile))
    assert torch.equal(rows.long(), torch.stack([r // (q_tile[1] * q_tile[2]), (r // q_tile[2]) % q_tile[1],
                                                 r % q_tile[2]]))


@pytest.mark.parametrize("spatial, kernel, stride, causal", [
    ((4, 16, 24), (3, 9, 9), (1, 2, 1), (True, False, False)), ((40, 24), (33, 17), (8, 1), (False, True)),
    ((300,), (129,), (64,), (False,))])
def test_inverse_tables_follow_the_window_rules(spatial, kernel, stride, causal):
    """For dK/dV, per axis: the queries whose windows hold each key, and per key tile the queries reaching any of its
    keys, those whose windows hold all of them and its first key, against ``ops.window`` query by query."""
    params = _params(spatial, kernel, stride, causal)
    kv_tile = (1,) * (3 - len(spatial)) + tuple(min(8, L) for L in spatial[:-1]) + (128 // math.prod(
        min(8, L) for L in spatial[:-1]),)
    ranges, spans, rows = hopper_dkdv.inverse_tables(params, kv_tile)
    axes = [(1, 1, 1, False)] * (3 - len(spatial)) + list(zip(spatial, kernel, stride, causal))
    for a, ((L, K, s, c), u) in enumerate(zip(axes, kv_tile)):
        windows = [tuple(int(x) for x in axis_window(i, L, K, s, 1, c)[2:]) for i in range(L)]
        holding = [[i for i in range(L) if windows[i][0] <= key < windows[i][1]] for key in range(L)]
        for key in range(ranges.shape[1]):
            lo, hi = ranges[a, key].tolist()
            assert list(range(lo, hi)) == (holding[key] if key < L else [])
        for tile in range(-(-L // u)):
            keys = range(tile * u, min(tile * u + u, L))
            reach = sorted(set().union(*(holding[key] for key in keys)))
            inside = [i for i in range(L) if all(i in holding[key] for key in keys)]
            lo, hi, in_lo, in_hi, first = spans[a, tile, :5].tolist()
            assert list(range(lo, hi)) == reach and list(range(in_lo, in_hi)) == inside and first == keys[0]
    r = torch.arange(math.prod(kv_tile))
    assert torch.equal(rows.long(), torch.stack([r // (kv_tile[1] * kv_tile[2]), (r // kv_tile[2]) % kv_tile[1],
                                                 r % kv_tile[2]]))


def test_dkdv_plan_and_reasons():
    params = _params((256, 256), (80, 80), (16, 16))
    q4 = torch.zeros(1, params.num_tokens, 4, 128, dtype=torch.bfloat16)
    k4 = torch.zeros(1, params.num_tokens, 2, 128, dtype=torch.bfloat16)
    bw = hopper_dkdv.build_launches(q4, k4, k4, q4, params, 0.1, (k4, k4))
    assert bw.grid == (256 * 256 // 128, 2)  # a 128-key tile per program and kv head
    assert bw.query_ranges.dtype == torch.int8  # every box inside every key's window: no mask code
    assert decide.hopper_dkdv_unsupported(q4, k4, k4, q4, torch.zeros(4, 159, 159), params, 0.1) is not None
    assert decide.hopper_dkdv_unsupported(q4, k4, k4, q4.float(), None, params, 0.1) is not None
    with hopper.disabled():
        assert "disabled" in decide.hopper_dkdv_unsupported(q4, k4, k4, q4, None, params, 0.1)


# where the fixup kernels of the tests below run: the GPU where there is one (Triton launches there), else the
# interpreter on the CPU
FIXUP_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _oracle_case(params, heads, heads_kv, dim, seed):
    """float32 ``[B, N, H, D]`` q, k, v, dO and the oracle's output, lse, dQ, dK and dV (float64 math on the CPU, GQA
    as given), on ``FIXUP_DEVICE``: ``(q, k, v, do, out, dq, lse, dk, dv)``."""
    gen = torch.Generator().manual_seed(seed)
    n = params.num_tokens
    q = torch.randn(2, *params.spatial, heads, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, *params.spatial, heads_kv, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    ins = [t.requires_grad_(True) for t in (q, k, v)]
    out, lse = oracle_attention(*ins, params.spatial, params.kernel_size, params.stride, params.dilation,
                                params.is_causal, scale=dim**-0.5)
    d_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dq, dk, dv = torch.autograd.grad(out, ins, d_out)
    flat = [t.detach().reshape(2, n, t.shape[-2], dim).float().contiguous() for t in (q, k, v, d_out, out, dq)]
    grads = [t.reshape(2, n, heads_kv, dim).float().contiguous() for t in (dk, dv)]
    case = (*flat, lse.detach().reshape(2, n, heads).float().contiguous(), *grads)
    return tuple(t.to(FIXUP_DEVICE) for t in case)


# one 128-row query tile holds the whole 5 x 8 map: a program per batch element and head, the last one (b 1, h 1)
FIXUP_PARAMS = _params((5, 8), (3, 5), (1, 2))


def test_forward_fixup_recomputes_the_flagged_programs():
    """The Hopper forward's fixup launch computes a flagged program's rows again (one window offset at a time) and
    leaves every other program's as the main kernel wrote them."""
    q4, k4, v4, _, out_ref, _, lse_ref, _, _ = _oracle_case(FIXUP_PARAMS, 2, 1, 16, seed=5)
    fw = hopper.build_launches(q4, k4, v4, FIXUP_PARAMS, 16**-0.5, True)
    assert fw.programs == 4
    flags = torch.zeros(fw.programs * hopper.ROWS, dtype=torch.int8, device=FIXUP_DEVICE)
    flags[hopper.ROWS * (fw.programs - 1) + 3] = 1
    out, lse = torch.full_like(out_ref, 7.0), torch.full_like(lse_ref, 7.0)
    hopper.na_fwd_nonfinite_kernel[fw.grid](q4, k4, v4, out, lse, flags, *fw.fixup_scalars, **fw.fixup_meta)
    torch.testing.assert_close(out[1, :, 1], out_ref[1, :, 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse[1, :, 1], lse_ref[1, :, 1], rtol=1e-4, atol=1e-4)
    assert (out[0] == 7.0).all() and (out[1, :, 0] == 7.0).all() and (lse[0] == 7.0).all()


def test_dq_fixup_recomputes_the_flagged_programs():
    """The Hopper dQ's fixup launch computes a flagged program's query tile again from the inputs (the oracle's dQ)
    and leaves every other tile as the main kernel wrote it."""
    q4, k4, v4, do4, o4, dq_ref, lse, _, _ = _oracle_case(FIXUP_PARAMS, 2, 1, 16, seed=6)
    bw = hopper_dq.build_launches(q4, k4, v4, do4, o4, FIXUP_PARAMS, 16**-0.5, dq_ref)
    flags = torch.zeros(bw.programs * hopper.ROWS, dtype=torch.int8, device=FIXUP_DEVICE)
    flags[hopper.ROWS * (bw.programs - 1) + 3] = 1
    dq = torch.full_like(dq_ref, 7.0)
    hopper_dq.na_bwd_dq_nonfinite_kernel[bw.grid](q4, k4, v4, do4, lse, (o4 * do4).sum(-1), dq, flags,
                                                  *bw.fixup_scalars, **bw.fixup_meta)
    torch.testing.assert_close(dq[1, :, 1], dq_ref[1, :, 1], rtol=1e-4, atol=1e-4)
    assert (dq[0] == 7.0).all() and (dq[1, :, 0] == 7.0).all()


def test_dkdv_fixup_recomputes_the_flagged_programs():
    """The Hopper dK/dV's fixup launch computes a flagged program's key tile again from the inputs (the oracle's dK
    and dV, summed over the query heads of the kv head) and leaves every other tile as the main kernel wrote it."""
    params = _params((4, 6), (3, 3))  # the recomputation walks every window offset: a small window keeps it quick
    q4, k4, v4, do4, o4, _, lse, dk_ref, dv_ref = _oracle_case(params, 2, 1, 16, seed=7)
    dk, dv = torch.full_like(dk_ref, 7.0), torch.full_like(dv_ref, 7.0)
    bw = hopper_dkdv.build_launches(q4, k4, v4, do4, params, 16**-0.5, (dk, dv))
    assert bw.programs == 2  # a 128-key tile per batch element and kv head
    flags = torch.zeros(bw.programs * hopper_dkdv.KEYS, dtype=torch.int8, device=FIXUP_DEVICE)
    flags[hopper_dkdv.KEYS + 5] = 1
    # 32 key rows a step instead of the launch's 8 (``SUB``): the same loop in four steps, which the interpreter runs
    # in 5 s instead of 20
    hopper_dkdv.na_bwd_dkdv_nonfinite_kernel[bw.grid](q4, k4, v4, do4, lse, (o4 * do4).sum(-1), dk, dv, flags,
                                                      *bw.fixup_scalars, **dict(bw.fixup_meta, SUB=32))
    torch.testing.assert_close(dk[1], dk_ref[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dv[1], dv_ref[1], rtol=1e-4, atol=1e-4)
    assert (dk[0] == 7.0).all() and (dv[0] == 7.0).all()


def test_half_box_holds_the_first_64_rows():
    assert hopper.half_box((2, 8, 8)) == ((1, 8, 8), (1, 0, 0))
    assert hopper.half_box((1, 8, 16)) == ((1, 4, 16), (0, 4, 0))
    assert hopper.half_box((1, 1, 128)) == ((1, 1, 64), (0, 0, 64))


def test_unsupported_names_the_reason():
    params = _params((64, 64), (33, 33))
    q4 = torch.zeros(1, params.num_tokens, 2, 128, dtype=torch.bfloat16)
    if not (torch.cuda.is_available() and decide.capability(torch.device("cuda")) == (9, 0)):
        assert "sm_90" in decide.hopper_unsupported(q4, q4, q4, None, params, 0.1)
    assert decide.hopper_unsupported(q4, q4, q4, torch.zeros(2, 65, 65), params, 0.1) is not None
    with hopper.disabled():
        assert "disabled" in decide.hopper_unsupported(q4, q4, q4, None, params, 0.1)


def test_the_reason_for_the_portable_kernels_is_logged(caplog):
    """Each kernel of a fused call that stays on the portable kernels says why, once, on the launcher's debug log."""
    decide._PLANS.clear()
    q = torch.randn(1, 8, 8, 2, 16, requires_grad=True)
    with caplog.at_level("DEBUG", logger="ops.fused.decide"):
        ops.na2d(q, q, q, kernel_size=3, backend="fused").sum().backward()
        ops.na2d(q, q, q, kernel_size=3, backend="fused").sum().backward()  # planned already: logged once
    decide._PLANS.clear()
    q4 = q.detach().view(1, 64, 2, 16)
    why = decide.hopper_unsupported(q4, q4, q4, None, _params((8, 8), (3, 3)), 0.25)  # (on a CPU: no sm_90 GPU)
    messages = [r.getMessage() for r in caplog.records if r.name == "ops.fused.decide"]
    for kernel in ("forward", "dQ", "dK/dV"):
        said = [m for m in messages if m.startswith(f"fused {kernel}: portable kernel; not the Hopper kernel: ")]
        assert len(said) == 1, messages
        assert said[0].endswith(why), said


# --- on the GPU -------------------------------------------------------------------------------------------------

def _sm90():
    return torch.cuda.is_available() and decide.capability(torch.device("cuda")) == (9, 0)


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")(test))


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels write starts as NaN; plans start empty and end empty."""
    monkeypatch.setattr(launch, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                     device=device))
    decide._PLANS.clear()
    yield
    decide._PLANS.clear()


@pytest.fixture(params=["planned", "shuffled"])
def tile_orders(request, monkeypatch):
    """Tiles run in the planned order, or in a random one: each kernel must find its tile, and number its flags as the
    fixup kernels do, through the order table whatever it holds."""
    if request.param == "shuffled":
        gen = torch.Generator().manual_seed(0)
        monkeypatch.setattr(launch_order, "block_order", lambda counts, spans, at_once: torch.randperm(
            math.prod(counts), generator=gen).to(torch.int32))


TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}

CASES = {
    # (spatial, kernel, stride, causal, heads, heads_kv)
    "1d": ((3000,), (1025,), (1,), (False,), 2, 2),
    "1d-causal-gqa": ((2000,), (1025,), (1,), (True,), 4, 2),
    "1d-strided": ((4096,), (1024,), (256,), (False,), 2, 2),
    "2d": ((48, 40), (33, 33), (1, 1), (False, False), 2, 1),
    "2d-causal-gqa": ((40, 48), (32, 33), (1, 4), (True, False), 4, 2),
    "2d-strided": ((64, 64), (32, 32), (16, 16), (False, False), 2, 2),
    "3d-causal": ((6, 16, 20), (5, 15, 15), (1, 1, 1), (True, False, False), 2, 2),
    "3d-strided-padded": ((7, 18, 16), (5, 15, 15), (2, 8, 8), (False, False, False), 1, 1),
}


def _problem(name, dim):
    spatial, kernel, stride, causal, heads, heads_kv = CASES[name]
    return RandomProblem(spatial, kernel, stride, (1,) * len(spatial), causal, 2, heads, heads_kv, dim, dim, False)


def _attend(p, dtype, seed, grads=False, poison_keys=None, poison_queries=None, hopper_forward=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, _ = p.tensors(dtype=dtype, device="cuda", generator=gen, requires_grad=grads)
    with torch.no_grad():
        if poison_keys is not None:
            k.view(p.batch, -1, p.heads_kv, p.dim)[:, poison_keys] = float("nan")
        if poison_queries is not None:
            q.view(p.batch, -1, p.heads, p.dim)[:, poison_queries] = float("nan")
    out, lse = ops.neighborhood_attention(len(p.spatial), q, k, v, **p.kwargs(), return_lse=True, backend="fused")
    plans = list(decide.plans("forward"))
    assert plans and all((plan.hopper is not None) == hopper_forward for plan in plans), "not the expected forward"
    return (q, k, v), out, lse


def _rel_err(got, ref):
    got, ref = got.double().cpu(), ref.double().cpu()
    assert torch.isfinite(got).all(), "non-finite values (unwritten output?)"
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


# every problem once, each dtype and head dim on masked and mask-free launches
@pytest.mark.parametrize("name, dtype, dim", [
    ("1d", torch.float16, 128), ("1d-causal-gqa", torch.bfloat16, 128), ("1d-strided", torch.float16, 64),
    ("2d", torch.bfloat16, 128), ("2d-causal-gqa", torch.float16, 64), ("2d-strided", torch.bfloat16, 64),
    ("2d-strided", torch.float16, 128), ("3d-causal", torch.bfloat16, 128), ("3d-causal", torch.float16, 64),
    ("3d-strided-padded", torch.bfloat16, 64)])
@gpu
def test_gpu_forward_matches_oracle(poisoned, name, dtype, dim):
    p = _problem(name, dim)
    (q, k, v), out, lse = _attend(p, dtype, seed=len(name) + dim)
    ref_out, ref_lse = oracle_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), p.spatial,
                                        p.kernel_size, p.stride, p.dilation, p.causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert _rel_err(out, ref_out) < TOL[dtype]
    assert _rel_err(lse, ref_lse) < TOL[dtype]


@pytest.mark.parametrize("name, dim", [("3d-causal", 128), ("2d-strided", 64), ("1d-causal-gqa", 128), ("1d", 64)])
@gpu
def test_gpu_forward_programs_run_many_work_items(poisoned, tile_orders, monkeypatch, name, dim):
    """With 3 programs every program runs many query tiles one after another (the rings, turns and Q / output buffers
    carried from tile to tile, masked tiles of different loop lengths too); the result still matches the oracle."""
    monkeypatch.setattr(hopper, "PERSISTENT_MASKED", True)
    monkeypatch.setattr(hopper, "multiprocessors", lambda device: 3)
    p = _problem(name, dim)
    (q, k, v), out, lse = _attend(p, torch.bfloat16, seed=11)
    plan = next(iter(decide.plans("forward"))).hopper
    assert plan.persistent and plan.programs > 3 * 4, "too few work items for the test"
    ref_out, ref_lse = oracle_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), p.spatial,
                                        p.kernel_size, p.stride, p.dilation, p.causal)
    assert _rel_err(out, ref_out) < TOL[torch.bfloat16]
    assert _rel_err(lse, ref_lse) < TOL[torch.bfloat16]


@gpu
def test_gpu_backward_from_the_hopper_forward(poisoned):
    """The portable backward reads the Hopper forward's output and lse."""
    p = _problem("2d", 64)
    (q, k, v), out, lse = _attend(p, torch.bfloat16, seed=3, grads=True)
    gen = torch.Generator(device="cuda").manual_seed(4)
    d_out = torch.randn(out.shape, dtype=out.dtype, device="cuda", generator=gen)
    got = torch.autograd.grad((out.float() * d_out.float()).sum(), (q, k, v))
    ref_in = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref_in, p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    ref = torch.autograd.grad((ref_out * d_out.double().cpu()).sum(), ref_in)
    for name, g, r in zip("qkv", got, ref):
        assert _rel_err(g, r) < 4 * TOL[torch.bfloat16], f"d{name}"


@gpu
def test_gpu_nonfinite_keys_stay_in_their_windows(poisoned, tile_orders):
    """A NaN key reaches exactly the queries whose windows hold it: the flagged programs' rows are recomputed one
    window offset at a time, every other row is finite and matches the oracle."""
    p = _problem("2d-strided", 64)
    bad = 1500
    (q, k, v), out, lse = _attend(p, torch.bfloat16, seed=5, poison_keys=[bad])
    q64, k64, v64 = (t.detach().double().cpu() for t in (q, k, v))
    ref_out, _ = oracle_attention(q64, k64, v64, p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    got = out.double().cpu()
    expect_nan = torch.isnan(ref_out).any(-1)  # [B, N, H]: the queries whose window holds the bad key
    assert expect_nan.any() and not expect_nan.all()
    assert torch.equal(torch.isnan(got).any(-1), expect_nan)
    keep = ~expect_nan
    assert (got[keep] - ref_out[keep]).abs().max() / ref_out[keep].abs().max() < TOL[torch.bfloat16]


def _gradients(p, dtype, seed, poison_queries=None):
    """(got, reference): dQ, dK, dV of the fused backend (asserting that both ran on the Hopper kernels) and of the
    float64 oracle, for a random output gradient."""
    (q, k, v), out, _ = _attend(p, dtype, seed, grads=True, poison_queries=poison_queries,
                                hopper_forward=len(p.spatial) in hopper.RANKS)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    d_out = torch.randn(out.shape, dtype=out.dtype, device="cuda", generator=gen)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    plans = list(decide.plans("backward"))
    assert plans and all(plan.hopper_dkdv is not None for plan in plans), "dK/dV did not take the Hopper kernel"
    assert all(plan.hopper_dq is not None for plan in plans), "dQ did not take the Hopper kernel"
    ref_in = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref_in, p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    ref = torch.autograd.grad(ref_out, ref_in, d_out.double().cpu()) if poison_queries is None else None
    return got, ref, (ref_in, ref_out, d_out)


# dK/dV's problems and whether some query box needs a mask (the kernel without mask code runs the others)
DKDV_CASES = {
    "2d-aligned-gqa": (((96, 64), (48, 32), (16, 16), (False, False), 4, 2), False),
    "3d-aligned": (((8, 32, 48), (4, 16, 16), (4, 16, 16), (False, False, False), 2, 2), False),
    "2d": (CASES["2d"], True), "2d-causal-gqa": (CASES["2d-causal-gqa"], True),
    "2d-strided": (CASES["2d-strided"], True), "3d-causal": (CASES["3d-causal"], True),
    "3d-strided-padded": (CASES["3d-strided-padded"], True),
}


def _dkdv_problem(name, dim):
    (spatial, kernel, stride, causal, heads, heads_kv), _ = DKDV_CASES[name]
    return RandomProblem(spatial, kernel, stride, (1,) * len(spatial), causal, 2, heads, heads_kv, dim, dim, False)


@pytest.mark.parametrize("name", DKDV_CASES)
def test_dkdv_mask_follows_the_windows(name):
    p = _dkdv_problem(name, 128)
    params = _params(p.spatial, p.kernel_size, p.stride, p.causal)
    q4 = torch.zeros(2, params.num_tokens, p.heads, 128, dtype=torch.bfloat16)
    k4 = torch.zeros(2, params.num_tokens, p.heads_kv, 128, dtype=torch.bfloat16)
    bw = hopper_dkdv.build_launches(q4, k4, k4, q4, params, 0.1, (k4, k4))
    masked = bw.query_ranges.dtype == torch.int32  # (the kernel's switch: an int8 stand-in runs no mask code)
    assert masked == DKDV_CASES[name][1]
    kv_tile, q_tile = hopper_dkdv._tiles(params)
    assert masked == (not _boxes_inside_by_brute_force(params, kv_tile, q_tile))


def _boxes_inside_by_brute_force(params, kv_tile, q_tile):
    """Whether every query box a dK/dV program visits holds, in every one of its (in-range) positions, all of the
    program's keys in its window, from ``axis_window`` position by position."""
    axes = [(1, 1, 1, False)] * (3 - params.rank) + [(L, K, s, c) for L, K, s, _, c in params.axes()]
    for (L, K, s, c), u, t in zip(axes, kv_tile, q_tile):
        windows = [axis_window(i, L, K, s, 1, c)[2:] for i in range(L)]
        for k0 in range(0, L, u):
            keys = range(k0, min(k0 + u, L))
            reaching = [q for q in range(L) if any(windows[q][0] <= k < windows[q][1] for k in keys)]
            if not reaching:
                continue
            for q0 in range(reaching[0], reaching[-1] + 1, t):
                if not all(q < L and windows[q][0] <= keys[0] and keys[-1] < windows[q][1] for q in range(q0, q0 + t)):
                    return False
    return True


@pytest.mark.parametrize("name", DKDV_CASES)
def test_every_box_inside_matches_the_windows(name):
    p = _dkdv_problem(name, 128)
    params = _params(p.spatial, p.kernel_size, p.stride, p.causal)
    pad = (1,) * (3 - params.rank)
    for keys in (hopper_dkdv.KEYS, 64):
        kv_tile, q_tile = hopper.tiles.choose_tiles(hopper.tiles.axes_of(params), keys, hopper_dkdv.QUERIES,
                                                    inverse=True)
        kv_tile, q_tile = pad + tuple(kv_tile), pad + tuple(q_tile)
        spans = hopper_dkdv.inverse_tables(params, kv_tile)[1]
        assert hopper_dkdv.every_box_inside(spans, q_tile) == _boxes_inside_by_brute_force(params, kv_tile, q_tile)


def test_dq_plan_and_reasons():
    params = _params((256, 256), (80, 80), (16, 16))
    q4 = torch.zeros(1, params.num_tokens, 4, 128, dtype=torch.bfloat16)
    k4 = torch.zeros(1, params.num_tokens, 2, 128, dtype=torch.bfloat16)
    bw = hopper_dq.build_launches(q4, k4, k4, q4, q4, params, 0.1, q4)
    assert bw.grid == (256 * 256 // hopper.ROWS, 4) and bw.scalars[-1] == 0  # a query tile per program, no mask
    assert hopper_dq.build_launches(q4, k4, k4, q4, q4, _params((256, 256), (80, 80)), 0.1, q4).scalars[-1] == 1
    assert decide.hopper_dq_unsupported(q4, k4, k4, q4, q4.float(), None, params, 0.1) is not None
    with hopper.disabled():
        assert "disabled" in decide.hopper_dq_unsupported(q4, k4, k4, q4, q4, None, params, 0.1)


def test_step_decode_is_exact_below_max_steps():
    """``_step_box`` divides a step index ``t`` by the boxes per axis ``n`` as ``(t + 1/2) * (1 / n)`` in float32
    and truncates: exact for every ``t < MAX_STEPS``, even with the reciprocal two units in the last place off (the
    GPU's approximate division), checked at every ``t`` on either side of a multiple of ``n``, where an error would
    show."""
    for n in [*range(1, 1025), 4095, 4096, 65521]:
        k = torch.arange(hopper.MAX_STEPS // n + 2, dtype=torch.int64) * n
        t = torch.cat([k - 1, k])
        t = t[(t >= 0) & (t < hopper.MAX_STEPS)]
        for inverse in _ulps_around(torch.tensor(1.0) / n, 2):
            decoded = ((t.float() + 0.5) * inverse).to(torch.int64)
            assert torch.equal(decoded, t // n), (n, inverse.item())


def _ulps_around(x: torch.Tensor, ulps: int) -> list:
    """``x`` (float32) and its neighbours up to ``ulps`` units in the last place below and above."""
    found, below, above = [x], x, x
    for _ in range(ulps):
        below, above = torch.nextafter(below, torch.tensor(0.0)), torch.nextafter(above, torch.tensor(math.inf))
        found += [below, above]
    return found


def test_tiles_visiting_too_many_boxes_run_portable(monkeypatch):
    monkeypatch.setattr(decide, "capability", lambda device: (9, 0))  # (on an sm_90 GPU)
    params = _params((256, 256), (80, 80), (16, 16))
    q4 = torch.zeros(1, params.num_tokens, 2, 128, dtype=torch.bfloat16)
    assert decide.longest_loop(params) == 50  # 80 x 80 keys in 8 x 16 boxes
    assert decide.longest_loop(_params((30, 48, 80), (18, 24, 24))) == 10 * 4 * 4
    assert decide.hopper_unsupported(q4, q4, q4, None, params, 0.1) is None
    monkeypatch.setattr(hopper, "MAX_STEPS", 50)
    assert "50 key boxes" in decide.hopper_unsupported(q4, q4, q4, None, params, 0.1)


def test_dkdv_leaves_1d_to_the_portable_kernel(monkeypatch):
    monkeypatch.setattr(decide, "capability", lambda device: (9, 0))  # (on an sm_90 GPU)
    params = _params((4096,), (1025,))
    q4 = torch.zeros(1, 4096, 2, 128, dtype=torch.bfloat16)
    assert "1-D" in decide.hopper_unsupported(q4, q4, q4, None, params, 0.1, ranks=hopper_dkdv.RANKS)


# dK/dV: with and without mask code, every problem once, each dtype and head dim
@pytest.mark.parametrize("name, dtype, dim", [
    ("2d-aligned-gqa", torch.bfloat16, 128), ("3d-aligned", torch.float16, 64), ("2d", torch.bfloat16, 128),
    ("2d-causal-gqa", torch.float16, 64), ("2d-strided", torch.float16, 128), ("3d-causal", torch.bfloat16, 64),
    ("3d-strided-padded", torch.float16, 128)])
@gpu
def test_gpu_dkdv_matches_oracle(poisoned, name, dtype, dim):
    p = _dkdv_problem(name, dim)
    got, ref, _ = _gradients(p, dtype, seed=len(name) * dim)
    for grad, g, r in zip("qkv", got, ref):
        assert g.dtype == dtype
        assert _rel_err(g, r) < 4 * TOL[dtype], f"d{grad}"


@gpu
def test_gpu_dkdv_nonfinite_queries_stay_in_their_windows(poisoned, tile_orders):
    """A NaN query reaches the dK / dV of exactly the keys in its window (the flagged key tiles are recomputed one
    window offset at a time); every other key's gradients are finite and match the oracle's from the same inputs with
    that query's output gradient zeroed."""
    p = _dkdv_problem("2d-aligned-gqa", 64)
    bad = 1000
    got, _, (ref_in, _, d_out) = _gradients(p, torch.bfloat16, seed=7, poison_queries=[bad])
    q64, k64, v64 = (t.detach() for t in ref_in)
    allowed = dense_mask_and_bias_index(p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)[0]
    expect_nan = allowed[bad]  # [N]: the keys in the window of query ``bad``
    for grad in (got[1], got[2]):
        nan_rows = torch.isnan(grad.double().cpu()).view(p.batch, -1, p.heads_kv, p.dim).any(-1).any(-1).any(0)
        assert torch.equal(nan_rows, expect_nan)
    # elsewhere: the oracle's gradients with the bad query taken out (its output gradient zeroed, its value finite)
    clean_q = q64.clone()
    clean_q.view(p.batch, -1, p.heads, p.dim)[:, bad] = 0.0
    d_clean = d_out.double().cpu().clone()
    d_clean.view(p.batch, -1, p.heads, p.dim)[:, bad] = 0.0
    ins = [t.requires_grad_(True) for t in (clean_q, k64.clone(), v64.clone())]
    out, _ = oracle_attention(*ins, p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    ref = torch.autograd.grad(out, ins, d_clean)
    keep = ~expect_nan
    for g, r in zip(got[1:], ref[1:]):
        g = g.double().cpu().view(p.batch, -1, p.heads_kv, p.dim)[:, keep]
        r = r.view(p.batch, -1, p.heads_kv, p.dim)[:, keep]
        assert torch.isfinite(g).all()
        assert ((g - r).abs().max() / r.abs().max()).item() < 4 * TOL[torch.bfloat16]


@gpu
def test_gpu_dq_matches_oracle_in_1d_with_an_lse_gradient(poisoned):
    """1-D (dK/dV on the portable kernel), GQA, causal, and a loss on lse as well as on the output: dQ's delta then
    subtracts the lse gradient."""
    p = _problem("1d-causal-gqa", 128)
    (q, k, v), out, lse = _attend(p, torch.bfloat16, seed=11, grads=True)
    gen = torch.Generator(device="cuda").manual_seed(12)
    d_out = torch.randn(out.shape, dtype=out.dtype, device="cuda", generator=gen)
    d_lse = torch.randn(lse.shape, dtype=lse.dtype, device="cuda", generator=gen)
    got = torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse))
    plans = list(decide.plans("backward"))
    assert plans and all(plan.hopper_dq is not None and plan.hopper_dkdv is None for plan in plans)
    ref_in = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = oracle_attention(*ref_in, p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    ref = torch.autograd.grad((ref_out, ref_lse), ref_in, (d_out.double().cpu(), d_lse.double().cpu()))
    for name, g, r in zip("qkv", got, ref):
        assert _rel_err(g, r) < 4 * TOL[torch.bfloat16], f"d{name}"


@gpu
def test_gpu_dq_nonfinite_keys_stay_in_their_windows(poisoned, tile_orders):
    """A NaN key reaches the dQ of exactly the queries whose windows hold it (the flagged programs' rows are
    recomputed one window offset at a time); every other query's dQ is finite and matches the oracle's from the same
    inputs with that key zeroed."""
    p = _problem("2d-strided", 64)
    bad = 1500
    (q, k, v), out, _ = _attend(p, torch.bfloat16, seed=13, grads=True, poison_keys=[bad])
    gen = torch.Generator(device="cuda").manual_seed(14)
    d_out = torch.randn(out.shape, dtype=out.dtype, device="cuda", generator=gen)
    dq = torch.autograd.grad(out, q, d_out)[0].double().cpu().view(p.batch, -1, p.heads, p.dim)
    assert all(plan.hopper_dq is not None for plan in decide.plans("backward"))
    allowed = dense_mask_and_bias_index(p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)[0]
    expect_nan = allowed[:, bad]  # [N]: the queries whose windows hold key ``bad``
    assert expect_nan.any() and not expect_nan.all()
    assert torch.equal(torch.isnan(dq).any(-1).any(-1).any(0), expect_nan)
    clean_k = k.detach().double().cpu().clone()
    clean_k.view(p.batch, -1, p.heads_kv, p.dim)[:, bad] = 0.0
    ins = [t.detach().double().cpu().requires_grad_(True) for t in (q, clean_k, v)]
    ref_out, _ = oracle_attention(*ins, p.spatial, p.kernel_size, p.stride, p.dilation, p.causal)
    ref = torch.autograd.grad(ref_out, ins[0], d_out.double().cpu())[0].view(p.batch, -1, p.heads, p.dim)
    keep = ~expect_nan
    assert torch.isfinite(dq[:, keep]).all()
    assert ((dq[:, keep] - ref[:, keep]).abs().max() / ref[:, keep].abs().max()).item() < 4 * TOL[torch.bfloat16]


def _scheduled_loops(kernel):
    """``{case: [loop, ...]}``: ``benchmarks/hopper_compile_check.py``'s ``loop_orders`` of each of its cases of
    ``kernel``, each loop a list of ``(event, count)``; compiled offline for sm_90 in a process of its own (this one
    runs Triton's interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import hopper_compile_check as h; "
            "print(json.dumps({str(case): h.loop_orders(h.fused_sass.disassemble(h.compile_case(*case)[3])) "
            f"for case in h.CASES if case[0] == {kernel!r}}}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.skipif(hopper.gluon is None, reason="needs Triton's Gluon dialect")
def test_forward_softmax_runs_under_the_value_matmul():
    """In each consumer's compiled loop every exponential of the softmax lies between the wait for the score matmul
    and the wait for the value matmul issued with it, so the softmax overlaps that matmul (ptxas, left to itself,
    hoists the second wait to the first); and no step divides integers (``MUFU.RCP``): the masked steps carry their
    key box from step to step instead of decoding it from the step index."""
    loops = _scheduled_loops("fwd")
    assert len(loops) == 7  # masked and mask-free (persistent) launches
    for case, orders in loops.items():
        assert len(orders) == 2, case  # one loop per consumer
        for order in orders:
            names = [name for name, _ in order]
            first = names.index("wait<=1")
            second = names.index("wait<=0", first)
            exps = sum(count for name, count in order if name == "exp")
            assert exps >= 64, (case, order)
            assert sum(count for name, count in order[first:second] if name == "exp") == exps, (case, order)
            assert "rcp" not in names, (case, order)


@pytest.mark.skipif(hopper.gluon is None, reason="needs Triton's Gluon dialect")
def test_dq_steps_do_not_divide_integers():
    """dQ's masked steps decode their key box from the step index with reciprocals taken once per tile
    (``_step_box``), not with integer divisions, whose reciprocals (``MUFU.RCP``) would sit between the score matmuls
    and the exponentials of every step."""
    loops = _scheduled_loops("dq")
    assert len(loops) == 4
    for case, orders in loops.items():
        assert len(orders) == 2, case  # one loop per consumer
        for order in orders:
            names = [name for name, _ in order]
            assert "exp" in names and "rcp" not in names, (case, order)
