"""``explain``: the launch decisions the fused backend makes for one problem, and why, without running a kernel.

``explain`` calls the decision functions the launcher's plans come from (``decide.decide_forward`` /
``decide_backward``, dry: no tuner and no kernel run) on the same inputs, keeps the plans they return
(``Explanation.forward_plan`` / ``backward_plan``) and words their decisions, so what it reports is what a call with
these tensors launches (docs/fused.md, "Explaining a launch").  The decisions also go to this module's debug log, as
NATTEN logs its backend choice.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from . import decide, hopper, hopper_dkdv, launch, op, tiles
from .. import dense_window, functional
from ..backends import Problem
from ..window import NAParams

log = logging.getLogger(__name__)


@dataclass
class KernelDecision:
    """One kernel's launch decisions (``explain``)."""

    kernel: str  # "forward", "dQ" or "dK/dV"
    family: str  # "portable" or "Hopper"
    outer_tile: tuple | None  # per axis, leading dummy axes first (the query tile; dK/dV's key tile); None: not yet
    inner_tile: tuple | None  # the tile the loop visits
    num_warps: int | None
    num_stages: int | None
    maxnreg: int | None
    config_source: str  # where the tile config comes from (forced, tuning cache, tuner, defaults)
    tma: bool  # tiles read by TMA
    host_descriptors: bool  # TMA descriptors built on the host
    masking: str  # "mask in dot", "selects" or "no mask code"
    bias_tiles: bool  # RPB read from per-call bias tiles
    index_width: str  # "int32" or "int64"
    precision: str  # tl.dot input precision
    batch_chunks: int  # launches the batch takes (grid limit)
    tile_order: str
    carveout: str
    flags: dict = field(default_factory=dict)  # the kernel's decided constexprs (portable kernels)
    reasons: list = field(default_factory=list)  # why, one line per decision

    def __str__(self) -> str:
        tiles_ = "decided by the tuner on first use" if self.outer_tile is None else \
            f"{_shape(self.outer_tile)} x {_shape(self.inner_tile)}"
        pipeline = "" if self.num_warps is None else f", {self.num_warps} warps, {self.num_stages} stages" + (
            f", maxnreg {self.maxnreg}" if self.maxnreg else "")
        lines = [f"{self.kernel}: {self.family} kernel, tiles {tiles_}{pipeline}",
                 f"  TMA {'on' if self.tma else 'off'}"
                 + (f" ({'host' if self.host_descriptors else 'per-program'} descriptors)" if self.tma else "")
                 + f"; masking: {self.masking}; bias tiles {'on' if self.bias_tiles else 'off'}; {self.index_width} "
                 f"offsets; dot precision {self.precision}; {self.batch_chunks} batch chunk(s)",
                 f"  tile order: {self.tile_order}; carveout: {self.carveout}"]
        lines += [f"  - {reason}" for reason in self.reasons]
        return "\n".join(lines)


@dataclass
class Explanation:
    """Every launch decision of a fused call (``explain``); ``str()`` words them with their reasons."""

    params: NAParams
    shapes: dict  # query / key / value shapes, dtype, device
    scale: float
    unsupported: str | None  # why the fused backend refuses these inputs (None: it serves them)
    forward: KernelDecision
    forward_plan_cached: bool  # the decision cache already holds this forward's plan (``decide._PLANS``)
    dq: KernelDecision | None = None  # None: no backward explained
    dkdv: KernelDecision | None = None
    drpb: str | None = None  # dRPB mode: "tile-layout dS", "window-layout dS", "offset pass", None
    drpb_reasons: list = field(default_factory=list)
    backward_plan_cached: bool = False
    forward_plan: decide.ForwardPlan | None = None  # the plans the words above describe (``decide``, dry)
    backward_plan: decide.BackwardPlan | None = None
    # the window covers the map (``ops.dense_window``): "dense" where the call runs SDPA per dilation group instead of
    # the kernels below, "kernels" where it could but ``DENSE_WINDOW`` is off or the lse is asked for, None otherwise
    dense_window: str | None = None

    def __str__(self) -> str:
        p = self.params
        head = (f"fused NA {p.rank}-D: spatial {_shape(p.spatial)}, window {_shape(p.kernel_size)}, stride "
                f"{_shape(p.stride)}, dilation {_shape(p.dilation)}, causal {p.is_causal}; q {self.shapes['query']}, "
                f"k {self.shapes['key']}, v {self.shapes['value']}, {self.shapes['dtype']} on {self.shapes['device']}, "
                f"scale {self.scale:.6g}")
        lines = [head]
        if self.unsupported is not None:
            lines.append(f"the fused backend refuses these inputs: {self.unsupported} (the decisions below are those "
                         "its launcher would make)")
        if self.dense_window == "dense":
            lines.append("the window covers the map and ops.fused.DENSE_WINDOW is on: the call runs dense attention "
                         "per dilation group (ops.dense_window), not the kernels below")
        elif self.dense_window == "kernels":
            lines.append("the window covers the map: dense attention per dilation group (ops.dense_window) would "
                         "serve it, but ops.fused.DENSE_WINDOW is off or the lse is asked for, so the kernels run")
        lines.append(f"forward plan {'cached' if self.forward_plan_cached else 'built on the first call'}")
        lines.append(str(self.forward))
        if self.dq is not None:
            lines.append(f"backward plan {'cached' if self.backward_plan_cached else 'built on the first call'}")
            lines += [str(self.dq), str(self.dkdv), f"dRPB: {self.drpb or 'none'}"]
            lines += [f"  - {reason}" for reason in self.drpb_reasons]
        return "\n".join(lines)


def _shape(values) -> str:
    return "x".join(str(v) for v in values)


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size, stride=1, dilation=1,
            is_causal=False, rpb: torch.Tensor | None = None, scale: float | None = None, return_lse: bool = False,
            backward: bool | None = None, deterministic: bool | None = None,
            host_descriptors: bool = True) -> Explanation:
    """The fused backend's launch decisions for ``ops.na{1,2,3}d(query, key, value, kernel_size, stride, dilation,
    is_causal, rpb, scale, return_lse=return_lse, backend="fused")`` with these tensors, and why.

    The arguments are checked as ``ops.functional`` checks them (errors name the argument); the rank is that of
    ``query`` (``[B, *spatial, H, D]``).  ``backward``: also explain the backward (None: where the call would build
    an autograd graph, as autograd decides from ``requires_grad`` and the grad mode); its dRPB follows
    ``rpb.requires_grad``.  ``deterministic``: dRPB in a fixed order (None: ``torch.use_deterministic_algorithms``
    or ``ops.fused.op.DRPB_DETERMINISTIC_DEFAULT``).  ``host_descriptors``: False as the taped NAT block's training path
    launches.  Nothing runs on the device; explaining a backward allocates one uninitialised output-sized tensor as a
    stand-in for the call's output and its gradient (their layout is a fresh contiguous one, as in an eager step).
    """
    if not isinstance(query, torch.Tensor):
        raise ValueError(f"query: expected a tensor, got {type(query).__name__}")
    if query.dim() not in (4, 5, 6):
        raise ValueError(f"query: expected a 4-D, 5-D or 6-D tensor [B, *spatial, H, D] (1-D, 2-D or 3-D attention), "
                         f"got shape {tuple(query.shape)}")
    rank = query.dim() - 3
    params = functional._check_tensors(rank, query, key, value, rpb, (kernel_size, stride, dilation, is_causal),
                                       None, None)
    if scale is None:  # (as ops.functional's checks take it)
        scale = query.shape[-1] ** -0.5
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    scale = float(scale)
    for name, flag in (("return_lse", return_lse), ("host_descriptors", host_descriptors)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    for name, flag in (("backward", backward), ("deterministic", deterministic)):
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool or None, got {flag!r}")
    needs_grad = op._needs_grad(query, key, value, rpb)
    if backward is None:
        backward = needs_grad
    if deterministic is None:
        deterministic = op.drpb_deterministic()
    problem = Problem(params=params, dtype=query.dtype, device=query.device, head_dim=query.shape[-1],
                      value_dim=value.shape[-1], heads_q=query.shape[-2], heads_kv=key.shape[-2],
                      has_rpb=rpb is not None, requires_grad=needs_grad)
    from . import BACKEND

    # the forward stores lse where the caller asks for it or a backward will read it (``op.attention``)
    need_lse = return_lse or needs_grad or backward
    # the plan the launcher keeps for these inputs, else the one it would make (decided dry: nothing runs)
    forward_key = decide._forward_key(query, key, value, rpb, params, scale, need_lse, host_descriptors)
    plan = decide._PLANS.get(forward_key)
    cached = plan is not None
    if not cached:
        plan = decide.decide_forward(query, key, value, rpb, params, scale, need_lse, host_descriptors, dry=True)
    result = Explanation(
        params=params, scale=scale, unsupported=BACKEND.unsupported(problem),
        shapes=dict(query=_shape(query.shape), key=_shape(key.shape), value=_shape(value.shape),
                    dtype=str(query.dtype).replace("torch.", ""), device=str(query.device)),
        forward=_forward(plan, query, params, scale, rpb is not None, need_lse, host_descriptors),
        forward_plan_cached=cached, forward_plan=plan,
        dense_window=None if not dense_window.covers(params) else "dense" if _dense(params, return_lse) else "kernels")
    if backward:
        _backward(result, query, key, value, rpb, params, scale, deterministic, rpb is not None and rpb.requires_grad,
                  host_descriptors)
    log.debug("%s", result)
    return result


def _dense(params: NAParams, return_lse: bool) -> bool:
    from . import DENSE_WINDOW

    return DENSE_WINDOW and not return_lse


def _masking(flags: dict, params: NAParams, config, scale: float, has_rpb: bool, inverse: bool = False) -> tuple:
    """(masking mode, reason) from a portable kernel's flags."""
    axes = tiles.axes_of(params)
    pad = 3 - len(axes)
    partial = tiles.partial_axes(axes, config.outer_tile[pad:], config.inner_tile[pad:], inverse)
    rule = f"MASK_IN_DOT_FROM ({decide.MASK_IN_DOT_FROM}) x {len(axes)} axes"
    if flags["BIAS_TILES"]:
        return "mask in dot", "masking: in the score matmul's initial value, the bias tiles' -inf"
    if flags["MASK_IN_DOT"]:
        return "mask in dot", f"masking: boxes partial on {partial:.2f} axes on average, at least {rule}"
    if scale <= 0:
        why = "the scale is not positive"
    elif has_rpb and not inverse and not flags.get("FOLD_SCALE", True):
        why = "the RPB is gathered per element (the scale is not folded)"
    else:
        why = f"boxes partial on {partial:.2f} axes on average, under {rule}"
    return "selects", f"masking: one select per element and partial axis: {why}"


def _tma_reasons(config, tma_ok: bool, host: bool, host_descriptors: bool, layout_rule: str) -> list:
    if not config.tma:
        return ["TMA off: the tile config has no TMA"]
    if not tma_ok:
        return ["TMA off: the tensors or the GPU do not allow bulk copies (decide.tma_eligible: a Hopper or newer "
                "GPU, 16-bit values, 16-byte aligned bases and batch / token / head strides)"]
    if host:
        return ["TMA on, descriptors built on the host (decide.host_descriptors_ok)"]
    why = "this call builds none (host_descriptors=False)" if not host_descriptors else layout_rule
    return [f"TMA on, descriptors built per program: {why}"]


HOST_LAYOUT_RULE = ("decide.host_descriptors_ok needs no dilation, heads packed per token, power-of-two head dims "
                    "and one batch chunk")


def _bias_reason(flags: dict, has_rpb: bool, scale: float) -> str | None:
    if not has_rpb:
        return None
    if flags["BIAS_TILES"]:
        return "RPB: per-call bias tiles (decide.BIAS_TILES)"
    if not decide.BIAS_TILES:
        return "RPB: gathered per element (decide.BIAS_TILES off, NAMODELS_BIAS_TILES=0)"
    if scale <= 0:
        return "RPB: gathered per element (the scale is not positive)"
    return f"RPB: gathered per element (the table would pass decide.BIAS_TILE_ELEMENTS, {decide.BIAS_TILE_ELEMENTS})"


def _portable(kernel: str, config, source: str, flags: dict, why: str, heads: int, batch: int, idx64: bool,
              precision: str, reasons: list, masking: tuple | None) -> KernelDecision:
    """A portable kernel's decision; ``masking``: ``_masking``'s (mode, reason), None without a config yet."""
    chunks = len(decide.batch_chunks(batch, heads))
    reasons = [f"portable kernel: not the Hopper kernel: {why}", f"tile config: {source}"] + reasons
    if masking is not None:
        reasons.append(masking[1])
    if chunks > 1:
        reasons.append(f"batch x heads past the grid's limit ({decide.MAX_GRID_Y}): {chunks} launches")
    if idx64:
        reasons.append("int64 offsets: a batch element's offsets can pass 2**31 (decide.needs_int64)")
    common = dict(kernel=kernel, family="portable", config_source=source, index_width="int64" if idx64 else "int32",
                  precision=precision, batch_chunks=chunks,
                  tile_order="row-major over each batch element and head, a dilation group's tiles adjacent",
                  carveout="Triton's default")
    if config is None:
        return KernelDecision(outer_tile=None, inner_tile=None, num_warps=None, num_stages=None, maxnreg=None,
                              tma=False, host_descriptors=False, masking="decided with the tiles", bias_tiles=False,
                              reasons=reasons, **common)
    return KernelDecision(outer_tile=config.outer_tile, inner_tile=config.inner_tile, num_warps=config.num_warps,
                          num_stages=config.num_stages, maxnreg=config.maxnreg, tma=flags["TMA"],
                          host_descriptors=flags["HOST_DESC"], masking=masking[0], bias_tiles=flags["BIAS_TILES"],
                          flags=flags, reasons=reasons, **common)


def _hopper_order() -> str:
    if hopper.ORDERED:
        return (f"launch_order blocks (hopper.ORDERED), runs of the SMs / {hopper.L2_PARTITIONS} L2 partitions "
                "in flight")
    return "row-major (hopper.ORDERED off)"


def _hopper_query_kernel(kernel: str, record, forward: bool) -> KernelDecision:
    q_tile, kv_tile, masked = record.q_tile, record.kv_tile, record.masked
    reasons = ["Hopper kernel: the problem passes decide.hopper_unsupported's checks",
               "tiles: the 128-row query box and 128-key box of tiles.choose_tiles (hopper.ROWS, hopper.COLS)",
               "masking: " + ("boxes partial somewhere: masked boxes tested on the axes they leave" if masked
                              else "no key box of any program needs a mask")]
    if forward:
        reasons.append("persistent: one program per SM runs the work items" if record.persistent
                       else "one program per query tile (masked launch; hopper.PERSISTENT_MASKED)")
    return KernelDecision(kernel=kernel, family="Hopper", outer_tile=q_tile, inner_tile=kv_tile, num_warps=4,
                          num_stages=hopper.STAGES, maxnreg=None, config_source="the Hopper kernel's fixed tiles",
                          tma=True, host_descriptors=True, masking="mask per axis" if masked else "no mask code",
                          bias_tiles=False, index_width="int32", precision=decide.HALF_DOT_PRECISION,
                          batch_chunks=1, tile_order=_hopper_order(), carveout="Triton's default", reasons=reasons)


def _forward(plan: decide.ForwardPlan, q, params, scale, has_rpb, need_lse, host_descriptors) -> KernelDecision:
    choices, config, flags = plan.choices, plan.config, plan.flags
    if plan.hopper is not None:
        return _hopper_query_kernel("forward", plan.hopper, forward=True)
    reasons, masking = [], None
    if config is not None:
        reasons += _tma_reasons(config, choices.tma_ok, flags["HOST_DESC"], host_descriptors, HOST_LAYOUT_RULE)
        reasons += [r for r in (_bias_reason(flags, has_rpb, scale),) if r]
        reasons.append("lse stored" if need_lse else "lse not stored (no caller or backward reads it)")
        masking = _masking(flags, params, config, scale, has_rpb)
    return _portable("forward", config, plan.config_source, flags, choices.hopper_why, q.shape[-2], q.shape[0],
                     choices.idx64, choices.precision, reasons, masking)


def _backward(result: Explanation, q, k, v, rpb, params, scale, deterministic, want_drpb, host_descriptors) -> None:
    b, hq, dv = q.shape[0], q.shape[-2], v.shape[-1]
    has_rpb = rpb is not None
    # stands for the call's output and its gradient: fresh and contiguous, as in an eager step
    out = torch.empty((*q.shape[:-1], dv), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    arguments = (q, k, v, rpb, out, lse, out, None, params, scale, deterministic, want_drpb, None, host_descriptors)
    plan = decide._PLANS.get(decide._backward_key(*arguments))
    result.backward_plan_cached = plan is not None
    if plan is None:
        plan = decide.decide_backward(*arguments, dry=True)
    result.backward_plan = plan
    choices, config, dq = plan.choices, plan.dq_config, plan.dq_flags
    if plan.hopper_dq is not None:
        result.dq = _hopper_query_kernel("dQ", plan.hopper_dq, forward=False)
    else:
        reasons, masking = [], None
        if config is not None:
            reasons += _tma_reasons(config, choices.dq_tma_ok, dq["HOST_DESC"], host_descriptors, HOST_LAYOUT_RULE)
            reasons += [r for r in (_bias_reason(dq, has_rpb, scale),) if r]
            masking = _masking(dq, params, config, scale, has_rpb)
        result.dq = _portable("dQ", config, plan.dq_source, dq, choices.dq_hopper_why, hq, b, choices.idx64,
                              choices.precision, reasons, masking)
    result.dkdv = _dkdv(plan, q, k, params, scale, has_rpb, host_descriptors)
    _drpb(result, plan, has_rpb, want_drpb, deterministic)


def _dkdv(plan: decide.BackwardPlan, q, k, params, scale, has_rpb, host_descriptors) -> KernelDecision:
    b, hkv = q.shape[0], k.shape[-2]
    choices = plan.choices
    if plan.hopper_dkdv is not None:
        record = plan.hopper_dkdv
        kv_tile, q_tile = hopper_dkdv._tiles(params)
        masked = record.query_ranges.dtype != torch.int8  # the kernel's mask switch (``build_launches``)
        return KernelDecision(
            kernel="dK/dV", family="Hopper", outer_tile=kv_tile, inner_tile=q_tile, num_warps=4,
            num_stages=hopper_dkdv.STAGES, maxnreg=None, config_source="the Hopper kernel's fixed tiles", tma=True,
            host_descriptors=True, masking="mask per box" if masked else "no mask code", bias_tiles=False,
            index_width="int32", precision=decide.HALF_DOT_PRECISION, batch_chunks=1, tile_order=_hopper_order(),
            carveout="the smallest shared-memory capacity holding one program per SM (carveout.fit_shared_memory)",
            reasons=["Hopper kernel: the problem passes decide.hopper_dkdv_unsupported's checks",
                     f"tiles: {hopper_dkdv.KEYS}-key boxes and {hopper_dkdv.QUERIES}-query boxes of "
                     "tiles.choose_tiles (keys as the matmul rows)",
                     "masking: " + ("some query box leaves a key's window" if masked
                                    else "every query box inside its keys' windows (every_box_inside)")])
    config, flags = plan.dkdv_config, plan.dkdv_flags
    reasons, masking = [], None
    if config is not None:
        reasons += _tma_reasons(config, choices.dkdv_tma_ok, flags["HOST_DESC"], host_descriptors,
                                HOST_LAYOUT_RULE + " (for Q/dO as well as K/V)")
        reasons += [r for r in (_bias_reason(flags, has_rpb, scale),) if r]
        rows = math.prod(config.inner_tile)
        reasons.append(f"score tile as [queries, keys] (QUERY_ROWS): {rows}-query tiles, at least "
                       f"DKDV_QUERY_ROWS_FROM ({decide.DKDV_QUERY_ROWS_FROM})" if flags["QUERY_ROWS"] else
                       f"score tile as [keys, queries]: {rows}-query tiles, under DKDV_QUERY_ROWS_FROM "
                       f"({decide.DKDV_QUERY_ROWS_FROM})")
        masking = _masking(flags, params, config, scale, has_rpb, inverse=True)
    return _portable("dK/dV", config, plan.dkdv_source, flags, choices.dkdv_hopper_why, hkv, b, choices.idx64,
                     choices.precision, reasons, masking)


def _drpb(result, plan: decide.BackwardPlan, has_rpb, want_drpb, deterministic) -> None:
    if not has_rpb:
        return
    if not want_drpb:
        result.drpb_reasons = ["the RPB needs no gradient (rpb.requires_grad is False)"]
        return
    if not plan.dq_flags:
        result.drpb_reasons = ["decided with dQ's tiles, which the tuner picks on first use"]
        return
    result.drpb = plan.drpb_mode
    choices = plan.choices
    reasons = []
    if result.drpb == "tile-layout dS":
        reasons.append("dQ adds dS over the batch by atomics in its bias tiles' layout (DS_BOXES)")
    elif result.drpb == "window-layout dS":
        how = "atomics into one buffer" if choices.ds_atomic else "one buffer per batch element, summed in order"
        reasons.append(f"dQ stores dS in window layout (STORE_DS), {how}"
                       + ("" if choices.ds_atomic else " (deterministic)")
                       + ("; dQ's launch has no bias tiles" if choices.ds_tiles else ""))
    else:
        reasons.append(f"offset pass: the window-layout buffer would pass rpb_grad.WINDOW_BUFFER_BYTES "
                       f"({launch.rpb_grad.WINDOW_BUFFER_BYTES}) or an axis is causal")
        reasons.append("its rows added by atomics" if plan.drpb_atomic else
                       "one partial row per program, summed in order")
    if deterministic:
        reasons.append("deterministic (torch.use_deterministic_algorithms or op.DRPB_DETERMINISTIC_DEFAULT)")
    result.drpb_reasons = reasons
