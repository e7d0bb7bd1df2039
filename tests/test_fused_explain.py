"""``ops.fused.explain`` reports the launch decisions the fused launcher makes.

Each case runs a tiny problem's forward and backward through ``ops.na*d(..., backend="fused")`` (Triton's
interpreter without a GPU), records the plans the launcher builds, and compares every decision ``explain`` reports
for the same tensors with the plans' launches: kernel family, tiles, warps, stages, the decided constexprs (TMA,
host descriptors, masking mode, bias tiles, dS layout, ...), index width, dot precision, batch chunks and the dRPB
mode.  Bad arguments raise errors that name the argument, as ``ops.functional`` does.
"""
import os

import pytest
import torch

pytest.importorskip("triton")

import ops  # noqa: E402
from ops.fused import Explanation, autotune, decide, explain, launch, rpb_grad  # noqa: E402
from ops.fused.autotune import Config  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or interpreter")

NA = {1: ops.na1d, 2: ops.na2d, 3: ops.na3d}


@pytest.fixture
def fresh_plans(monkeypatch):
    """An empty decision cache, and a list of the plans the launcher builds from here on."""
    monkeypatch.setattr(decide, "_PLANS", {})
    built = {"forward": [], "backward": []}
    decide_forward, decide_backward = decide.decide_forward, decide.decide_backward

    def record_forward(*args, **kwargs):
        plan = decide_forward(*args, **kwargs)
        if not kwargs.get("dry"):  # (``explain`` decides dry, and keeps nothing)
            built["forward"].append(plan)
        return plan

    def record_backward(*args, **kwargs):
        plan = decide_backward(*args, **kwargs)
        if not kwargs.get("dry"):
            built["backward"].append(plan)
        return plan

    monkeypatch.setattr(decide, "decide_forward", record_forward)
    monkeypatch.setattr(decide, "decide_backward", record_backward)
    return built


def _inputs(batch, spatial, heads, dim, window, heads_kv=None, rpb=False, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, *spatial)
    q = torch.randn(*shape, heads, dim, generator=gen).to(DEVICE, dtype).requires_grad_()
    k, v = (torch.randn(*shape, heads_kv or heads, dim, generator=gen).to(DEVICE, dtype).requires_grad_()
            for _ in range(2))
    bias = None
    if rpb:
        bias = (0.1 * torch.randn(heads, *(2 * w - 1 for w in window), generator=gen)).to(DEVICE).requires_grad_()
    return q, k, v, bias


def _run(rank, q, k, v, rpb, window, **kwargs):
    out = NA[rank](q, k, v, window, rpb=rpb, backend="fused", **kwargs)
    out.backward(torch.randn_like(out))  # a fresh contiguous d_out, as an eager step's next op gives


def _check_portable(decision, launch_, outer_is_query=True):
    """A portable kernel's reported decisions against the launch the plan holds."""
    meta = launch_.meta
    assert decision.family == "portable"
    q_tile, kv_tile = (decision.outer_tile, decision.inner_tile) if outer_is_query else \
        (decision.inner_tile, decision.outer_tile)
    assert (meta["T0"], meta["T1"], meta["T2"]) == tuple(q_tile)
    assert (meta["U0"], meta["U1"], meta["U2"]) == tuple(kv_tile)
    assert (meta["num_warps"], meta["num_stages"], meta.get("maxnreg")) == \
        (decision.num_warps, decision.num_stages, decision.maxnreg)
    assert decision.flags, "a resolved config gives the kernel's flags"
    for name, value in decision.flags.items():
        assert meta[name] == value, name
    assert (meta["TMA"], meta["HOST_DESC"], meta["BIAS_TILES"], meta["MASK_IN_DOT"]) == \
        (decision.tma, decision.host_descriptors, decision.bias_tiles, decision.masking == "mask in dot")
    assert meta["IDX64"] == (decision.index_width == "int64")
    assert meta["PREC"] == decision.precision


def _check(explained: Explanation, forward_plan, backward_plan):
    assert forward_plan.hopper is None and backward_plan.hopper_dq is None and backward_plan.hopper_dkdv is None
    _check_portable(explained.forward, forward_plan.launch)
    assert explained.forward.batch_chunks == len(forward_plan.launches)
    _check_portable(explained.dq, backward_plan.dq)
    _check_portable(explained.dkdv, backward_plan.dkdv, outer_is_query=False)
    assert explained.dq.batch_chunks == len(backward_plan.dq_launches)
    assert explained.dkdv.batch_chunks == len(backward_plan.dkdv_launches)
    mode = ("tile-layout dS" if backward_plan.ds_tiles else "window-layout dS" if backward_plan.ds_window else
            "offset pass" if backward_plan.drpb_launches is not None else None)
    assert explained.drpb == mode


CASES = {
    # NAT's small-window regime with RPB: bias tiles, dS in their layout
    "2d-rpb": dict(rank=2, batch=2, spatial=(8, 8), heads=2, dim=16, window=(7, 7), rpb=True),
    # dilation and a causal axis: selects or mask in dot by the partial axes, no RPB
    "2d-dilated-causal": dict(rank=2, batch=1, spatial=(9, 8), heads=2, dim=16, window=(3, 3),
                              kwargs=dict(dilation=(2, 1), is_causal=(True, False))),
    # GQA, stride, a head dim that pads, 1-D
    "1d-gqa-stride": dict(rank=1, batch=2, spatial=(23,), heads=4, heads_kv=2, dim=24, window=(7,),
                          kwargs=dict(stride=2)),
    # 3-D with RPB and a window covering the dilation group (the dense-group regime)
    "3d-rpb": dict(rank=3, batch=1, spatial=(4, 6, 6), heads=1, dim=16, window=(3, 3, 3), rpb=True,
                   kwargs=dict(dilation=(1, 2, 2))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_explain_reports_what_the_launcher_launches(name, fresh_plans):
    case = CASES[name]
    q, k, v, rpb = _inputs(case["batch"], case["spatial"], case["heads"], case["dim"], case["window"],
                           case.get("heads_kv"), case.get("rpb", False))
    kwargs = case.get("kwargs", {})
    explained = explain(q, k, v, case["window"], rpb=rpb, **kwargs)
    assert not explained.forward_plan_cached and not explained.backward_plan_cached
    assert not fresh_plans["forward"] and not decide._PLANS  # explaining builds nothing
    _run(case["rank"], q, k, v, rpb, case["window"], **kwargs)
    (forward_plan,), (backward_plan,) = fresh_plans["forward"], fresh_plans["backward"]
    _check(explained, forward_plan, backward_plan)
    again = explain(q, k, v, case["window"], rpb=rpb, **kwargs)  # now the plans the launcher keeps
    assert again.forward_plan_cached and again.backward_plan_cached
    assert again.forward_plan is forward_plan and again.backward_plan is backward_plan
    _check(again, forward_plan, backward_plan)
    text = str(explained)
    for word in ("forward: portable kernel", "dQ: portable kernel", "dK/dV: portable kernel", "tile config:",
                 "masking:", "not the Hopper kernel"):
        assert word in text
    if rpb is not None:
        assert "dRPB: tile-layout dS" in text


@pytest.mark.parametrize("bias_tiles, deterministic, window_bytes, mode", [
    (False, False, rpb_grad.WINDOW_BUFFER_BYTES, "window-layout dS"),
    (True, True, rpb_grad.WINDOW_BUFFER_BYTES, "window-layout dS"),
    (True, True, 0, "offset pass"),
])
def test_explain_reports_each_drpb_mode(bias_tiles, deterministic, window_bytes, mode, fresh_plans, monkeypatch):
    monkeypatch.setattr(decide, "BIAS_TILES", bias_tiles)
    monkeypatch.setattr(rpb_grad, "WINDOW_BUFFER_BYTES", window_bytes)
    q, k, v, rpb = _inputs(2, (6, 6), 2, 16, (3, 3), rpb=True, seed=1)
    monkeypatch.setattr("ops.fused.op.DRPB_DETERMINISTIC_DEFAULT", deterministic)
    explained = explain(q, k, v, 3, rpb=rpb)
    assert explained.drpb == mode
    _run(2, q, k, v, rpb, 3)
    (forward_plan,), (backward_plan,) = fresh_plans["forward"], fresh_plans["backward"]
    _check(explained, forward_plan, backward_plan)
    assert explained.drpb == mode
    if mode == "offset pass":
        assert ("added by atomics" in " ".join(explained.drpb_reasons)) == backward_plan.drpb_atomic


def test_explain_follows_pinned_configs_inference_and_frozen_rpb(fresh_plans):
    q, k, v, rpb = _inputs(1, (8, 8), 2, 16, (5, 5), rpb=True, seed=2)
    q, k, v = (t.detach() for t in (q, k, v))
    rpb = rpb.detach()  # a frozen RPB: no dRPB
    with autotune.forced(fwd=Config(16, 16, 4, 1)):
        explained = explain(q, k, v, 5, rpb=rpb)
        ops.na2d(q, k, v, 5, rpb=rpb, backend="fused")
    assert explained.dq is None and explained.drpb is None  # inference: no backward
    assert explained.forward.config_source == "pinned by autotune.forced"
    assert explained.forward.flags["STORE_LSE"] is False
    (plan,) = fresh_plans["forward"]
    _check_portable(explained.forward, plan.launch)
    with_backward = explain(q, k, v, 5, rpb=rpb, backward=True)
    assert with_backward.dq is not None and with_backward.drpb is None
    assert "needs no gradient" in " ".join(with_backward.drpb_reasons)


def test_explain_runs_no_kernel(monkeypatch):
    def refuse(self, tensors):
        raise AssertionError("explain launched a kernel")

    monkeypatch.setattr(launch._Launch, "__call__", refuse)
    q, k, v, rpb = _inputs(1, (8, 8), 2, 16, (3, 3), rpb=True, seed=3)
    assert "dRPB" in str(explain(q, k, v, 3, rpb=rpb))


@pytest.mark.parametrize("change, argument", [
    (dict(query="not a tensor"), "query"),
    (dict(query=torch.zeros(2, 8, 16)), "query"),
    (dict(key=torch.zeros(1, 8, 8, 2, 8)), "head dim"),
    (dict(value=torch.zeros(1, 8, 7, 2, 16)), "value"),
    (dict(kernel_size=(3, 3, 3)), "kernel_size"),
    (dict(kernel_size=9), "kernel_size"),
    (dict(dilation=0), "dilation"),
    (dict(stride=5), "stride"),
    (dict(is_causal=(True, "no")), "is_causal"),
    (dict(rpb=torch.zeros(2, 3, 3)), "rpb"),
    (dict(scale=float("nan")), "scale"),
    (dict(backward="yes"), "backward"),
    (dict(deterministic=1), "deterministic"),
    (dict(return_lse=None), "return_lse"),
])
def test_explain_names_the_bad_argument(change, argument):
    args = dict(query=torch.zeros(1, 8, 8, 2, 16), key=torch.zeros(1, 8, 8, 2, 16), value=torch.zeros(1, 8, 8, 2, 16),
                kernel_size=3)
    args.update(change)
    with pytest.raises(ValueError, match=argument):
        explain(**args)


def test_explain_says_when_a_covered_window_runs_dense(monkeypatch):
    """A window that covers the map: explain names the dense route while ``DENSE_WINDOW`` is on and no lse is asked
    for, the kernels otherwise; a window that does not cover the map mentions neither."""
    import ops.fused as fused

    q = torch.randn(1, 14, 14, 2, 8, device=DEVICE)
    for enabled, return_lse, route in ((True, False, "dense"), (True, True, "kernels"), (False, False, "kernels")):
        monkeypatch.setattr(fused, "DENSE_WINDOW", enabled)
        result = explain(q, q, q, 7, dilation=2, return_lse=return_lse, backward=False)
        assert result.dense_window == route
        assert ("runs dense attention per dilation group" in str(result)) == (route == "dense")
    assert explain(q, q, q, 7, backward=False).dense_window is None
