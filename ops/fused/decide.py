"""Every launch decision of the fused kernels, in one place: ``decide_forward`` / ``decide_backward``.

A call's decisions (kernel family, portable or Hopper; tile config and N-D tiles; TMA and host-built descriptors;
masking mode; bias tiles; index width; dot precision; batch chunks; the dRPB mode) are made once per problem and input
layout by the two ``decide_*`` functions, which return a frozen plan (``ForwardPlan`` / ``BackwardPlan``) holding
every launch with its arguments and the decisions themselves.  ``forward_plan`` / ``backward_plan`` keep the plans in
the one decision cache (``_PLANS``), keyed on everything a decision reads; the launcher (``launch.forward`` /
``backward``) only looks a plan up and runs it, and ``ops.fused.explain`` words the plan that ``decide_*`` returns.
The functions below them are the rules, one per launch parameter; nothing else in ``ops/fused`` chooses one.  The
tuner (``autotune``) times the candidates ``tile_config`` gives it and stores the winner.

Where a decision reads the GPU, it asks ``capability`` (and the Hopper kernels' ``hopper.multiprocessors``): one
probe, which the decision tests replace to decide for a GPU they do not have.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass

import torch
import triton

from . import autotune, hopper, hopper_dkdv, hopper_dq, kernels, launch, rpb_grad
from .autotune import Config, ResolvedConfig
from .tiles import axes_of, choose_tiles, loop_length, max_boxes, partial_axes, total_size
from ..window import NAParams

log = logging.getLogger(__name__)
_strides = launch._strides  # (batch, token, head) strides of a [B, N, H, D] tensor


def capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability, or None where the kernels run through Triton's interpreter or off a GPU."""
    if kernels.interpreted() or device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


# --- tile configs -----------------------------------------------------------------------------------------------------

# kernel -> list of (max head dim, default config); the first entry whose bound covers the head dim wins.
DEFAULTS: dict[str, list[tuple[int, Config]]] = {
    # The tuner's winners (docs/fused.md, "Tiling"): one warpgroup (4 warps) on 64-row tiles for every kernel,
    # kept by time although ptxas reports some spills for them at head dim 128.  Head dim 256 keeps small tiles.
    # TMA loads on the head-dim-128 entries; the head-dim-32 entries keep pointer loads, since a short program
    # pays for building its descriptors (docs/fused.md, "TMA and host descriptors").
    # The bound is ``row_width``: float32 past head dim 64 counts double (its tiles take twice the shared
    # memory; float32 at head dim 128 runs out of it with the 128 entry).
    "fwd": [(32, Config(32, 32, 4, 2)), (128, Config(64, 64, 4, 3, True)), (256, Config(64, 32, 8, 2)),
            (512, Config(32, 32, 8, 1))],
    "dq": [(32, Config(64, 32, 4, 2)), (128, Config(64, 64, 4, 2, True)), (256, Config(32, 32, 8, 1))],
    # dkdv: outer = key/value tile, inner = query tile.
    "dkdv": [(32, Config(64, 32, 4, 2)), (128, Config(64, 64, 4, 2, True)), (256, Config(32, 32, 8, 1))],
    "drpb": [(256, Config(64, 1, 4, 1))],
}

# Head dims up to 32 (NAT / DiNAT) by window regime, each replacing the table above where it was faster
# (docs/fused.md, "Tiling"):
# * small windows (at most SMALL_WINDOW keys, smaller than the dilation group): 16-query tiles on one warp reach
#   about half the keys of 32- or 64-query tiles;
# * windows covering their whole dilation group (DiNAT's dilated layers): dense attention inside each group, one
#   64-query tile per group.
# The small-window tiles use TMA where the launcher builds the descriptors on the host (``_default_resolved`` drops
# it elsewhere; docs/fused.md, "TMA and host descriptors").
SMALL_WINDOW = 81
SMALL_WINDOW_DEFAULTS = {"fwd": Config(16, 64, 1, 2, True), "dq": Config(16, 32, 1, 2, True),
                         "dkdv": Config(16, 32, 1, 2, True)}
DENSE_GROUP_DEFAULTS = {"fwd": Config(64, 64, 4, 3)}
REGIME_MAX_WIDTH = 32

# Triton's input precision of float32 matmuls per torch setting (``torch.set_float32_matmul_precision``): "highest"
# asks for float32 results, which 3xTF32 gives on the tensor cores (each operand split into a TF32 head and tail, three
# products; as accurate as the gemm backend's float32) where an IEEE dot runs on the FMA units at a fraction of the
# speed; "high" and "medium" allow TF32 (errors of both: docs/fused.md, "Float32 inputs").
FP32_DOT_PRECISION = {"highest": "tf32x3", "high": "tf32", "medium": "tf32"}
# 16-bit matmuls: Triton's default (the argument only matters for float32 operands)
HALF_DOT_PRECISION = "tf32"


def float32_matmul_setting() -> str:
    """torch's float32 matmul precision ("highest", "high" or "medium").  torch >= 2.9 also sets it through
    ``torch.backends.cuda.matmul.fp32_precision``; once a program used that API its legacy getter raises, and the new
    one (with "none" inheriting from the backend-wide setting) says whether TF32 is allowed."""
    import torch

    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        for owner in (torch.backends.cuda.matmul, torch.backends.cuda, torch.backends):
            value = getattr(owner, "fp32_precision", "none")
            if value != "none":
                return "high" if value == "tf32" else "highest"
        return "highest"


def dot_precision(dtype) -> str:
    """The kernels' ``tl.dot`` input precision for inputs of ``dtype`` under torch's current setting."""
    import torch

    if dtype != torch.float32:
        return HALF_DOT_PRECISION
    return FP32_DOT_PRECISION[float32_matmul_setting()]


def window_regime(params) -> str:
    """``"dense-group"`` where the window covers its whole dilation group on every axis, ``"small"`` for windows of
    at most ``SMALL_WINDOW`` keys, else ``"large"``."""
    axes = axes_of(params)
    if all(a.K >= a.Lg for a in axes):
        return "dense-group"
    window = 1
    for a in axes:
        window *= a.K
    return "small" if window <= SMALL_WINDOW else "large"


def default_config(kernel: str, head_dim: int, params=None) -> Config:
    """The defaults-table entry for a ``row_width`` (and, given the problem, its window regime)."""
    return _default_entry(kernel, head_dim, params)[1]


def _default_entry(kernel: str, head_dim: int, params=None) -> tuple[str, Config]:
    """``default_config``'s entry and the name of its table."""
    if params is not None and head_dim <= REGIME_MAX_WIDTH:
        regime = window_regime(params)
        name, table = {"small": ("SMALL_WINDOW_DEFAULTS", SMALL_WINDOW_DEFAULTS),
                       "dense-group": ("DENSE_GROUP_DEFAULTS", DENSE_GROUP_DEFAULTS)}.get(regime, ("", {}))
        if kernel in table:
            return name, table[kernel]
    for bound, cfg in DEFAULTS[kernel]:
        if head_dim <= bound:
            return "DEFAULTS", cfg
    return "DEFAULTS", DEFAULTS[kernel][-1][1]


def row_width(head_dim: int, dtype) -> int:
    """The defaults-table key: the head dim, doubled for float32 rows wider than 64, whose tiles take
    twice the shared memory (float32 up to 64 fits the 16-bit entries and keeps their tiles)."""
    return head_dim * 2 if dtype.itemsize > 2 and head_dim > 64 else head_dim


def resolve(cfg: Config, params, kernel: str) -> ResolvedConfig:
    """N-D tile shapes for a configuration of ``kernel`` (padded to 3 axes, leading dummy axes of size 1)."""
    axes = axes_of(params)
    tokens = 1
    for a in axes:
        tokens *= a.Lg
    outer_size = total_size(tokens, cfg.outer)
    if cfg.inner == 1:  # kernels without an inner tile (drpb)
        outer, inner = choose_tiles(axes, outer_size, 1)
    else:
        outer, inner = choose_tiles(axes, outer_size, total_size(tokens, cfg.inner), inverse=kernel == "dkdv")
    pad = (1,) * (3 - len(axes))
    return ResolvedConfig(pad + tuple(outer), pad + tuple(inner), cfg.num_warps, cfg.num_stages, cfg.tma, cfg.maxnreg)


# A program that builds its TMA descriptors itself pays for it once, so TMA pays only over a long enough loop
# (docs/fused.md, "TMA and host descriptors").  Where the launcher builds the descriptors on the host (an undilated
# problem with packed heads and power-of-two head dims, ``host_descriptors_ok``), TMA wins on short loops too
# (the backward: ``BACKWARD_HOST_DESCRIPTORS``).
MIN_TMA_LOOP = 16


def _default_resolved(kernel: str, params, width: int, host_descriptors: bool = False) -> ResolvedConfig:
    """The defaults-table entry for a ``row_width``, resolved, without TMA where a program's loop is short and
    builds its own descriptors (``host_descriptors``: the launcher passes them in, as it decided with the tensors)."""
    resolved = resolve(default_config(kernel, width, params), params, kernel)
    if resolved.tma and not host_descriptors:
        outer, inner = resolved.outer_tile, resolved.inner_tile
        axes = axes_of(params)
        pad = 3 - len(axes)
        if loop_length(axes, outer[pad:], inner[pad:], inverse=kernel == "dkdv") < MIN_TMA_LOOP:
            resolved = dataclasses.replace(resolved, tma=False)
    return resolved


def default_source(kernel: str, params, width: int, host_descriptors: bool = False) -> str:
    """Which defaults-table entry ``_default_resolved`` takes, in words."""
    table, config = _default_entry(kernel, width, params)
    words = f"defaults: {table}[{kernel!r}] ({window_regime(params)} window, row width {width})"
    if config.tma and not _default_resolved(kernel, params, width, host_descriptors).tma:
        words += f"; TMA off: a loop under MIN_TMA_LOOP ({MIN_TMA_LOOP}) boxes without host descriptors"
    return words

def tile_config(kernel: str, q, k, v, params, has_rpb: bool, run=None, tunable: bool = True, tma: bool = False,
                host_descriptors: bool = False, tune: bool = True) -> tuple[ResolvedConfig | None, str]:
    """``(config, source)``: one kernel's resolved configuration for a problem and where it comes from, in this
    order: pinned (``autotune.forced``), the tuning cache's entry, the tuner's winner (tuning on, a GPU, ``tunable``;
    ``run(config)`` runs a candidate once), else the defaults table.  ``tma``: the launch can use TMA loads (else the
    tuner skips those candidates, which would run as their pointer-load twins); ``host_descriptors``: its TMA
    descriptors are built on the host, which decides whether the defaults keep TMA on short loops.  ``tune`` False
    (``explain``): where the tuner would run, ``config`` is None and nothing runs."""
    if kernel in autotune._forced:
        return resolve(autotune._forced[kernel], params, kernel), "pinned by autotune.forced"
    key = autotune.problem_key(kernel, q, k, v, params, has_rpb)
    entry = autotune.stored(key)
    if entry is not None:
        return entry, f"tuning cache entry {key} ({autotune.cache_path()})"
    width = row_width(max(q.shape[-1], v.shape[-1]), q.dtype)
    if tunable and autotune.autotune_enabled() and q.is_cuda:
        if not tune:
            return None, f"the tuner, on first use (stored as {key})"
        best = autotune.tune(key, tuner_candidates(kernel, q, params, tma), run)
        if best is not None:
            return best, f"the tuner (stored as {key})"
    return _default_resolved(kernel, params, width, host_descriptors), default_source(kernel, params, width,
                                                                                      host_descriptors)


def tuner_candidates(kernel: str, q, params, tma: bool) -> list[ResolvedConfig]:
    """What the tuner times for a kernel: the default (by the q/k rows, which set the register budget) and
    ``autotune.CANDIDATES``, resolved, each once; TMA candidates as their pointer-load twins where the launch cannot
    use TMA."""
    seen, candidates = set(), []
    for cfg in [default_config(kernel, row_width(q.shape[-1], q.dtype), params)] + autotune.CANDIDATES[kernel]:
        if cfg.tma and not tma:
            cfg = dataclasses.replace(cfg, tma=False)
        candidate = resolve(cfg, params, kernel)
        if candidate not in seen:
            seen.add(candidate)
            candidates.append(candidate)
    return candidates


# --- launch parameters ----------------------------------------------------------------------------------------------

# Deterministic dRPB writes one partial row per program; above this many bytes it uses atomics
# instead (unless torch.use_deterministic_algorithms is on).
DRPB_PARTIAL_BYTES = 64 * 1024 * 1024
MAX_GRID_Y = 65535

INT32_LIMIT = 2**31 - 1


def needs_int64(*tensors) -> bool:
    """True when a per-batch-element offset (token index * token stride + head + dim) of any of
    the [B, N, H, D] tensors can pass int32 (batch offsets are always computed in int64)."""
    return any(t.shape[1] * t.stride(1) + t.shape[2] * t.stride(2) >= INT32_LIMIT for t in tensors)


def gather_rows(block_d: int, block_dv: int) -> int:
    """Rows per step of the kernels' window-offset loops (``kernels._attend_by_offset`` and its backward twins, run
    where a program's result holds a NaN / inf): few, about 128 elements per gathered vector block, since a kernel
    is given the registers of its most demanding code, the rare loops included."""
    return max(2, 128 // max(block_d, block_dv))


def constexprs(params: NAParams, config: ResolvedConfig, q_tile, kv_tile, d, dv, has_rpb, idx64,
                precision):
    _, _, _, _, C = launch._axes3(params)
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    return dict(IDX64=idx64, PREC=precision, GATHER_ROWS=gather_rows(block_d, block_dv),
        CAUSAL0=C[0], CAUSAL1=C[1], CAUSAL2=C[2], ACT0=params.rank >= 3, ACT1=params.rank >= 2,
        T0=q_tile[0], T1=q_tile[1], T2=q_tile[2], U0=kv_tile[0], U1=kv_tile[1], U2=kv_tile[2],
        BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_RPB=has_rpb, num_warps=config.num_warps, num_stages=config.num_stages,
    ) | ({"maxnreg": config.maxnreg} if config.maxnreg else {})


# The backward kernels read their tiles through descriptors built on the host, as the forward does, where the layout
# allows it (``host_descriptors_ok``) and the launch uses TMA: K/V in dQ, Q/dO (and, with queries as the matmul rows,
# their own K/V tile) in dK/dV.  A program that builds its own descriptors pays for it on every launch, which a short
# loop does not earn back; host-built ones cost the program nothing (docs/fused.md, "TMA and host descriptors").
BACKWARD_HOST_DESCRIPTORS = True

# The kernels mask key boxes through the score matmul's initial value (a 0 / -inf bias tile built on every box from
# per-axis compares that ptxas shares across a thread's columns) where a launch's boxes are partial on at least this
# fraction of the problem's axes on average; elsewhere one select per element and partial axis, skipped on unmasked
# boxes.  One threshold for every kernel, forward and backward (docs/fused.md, "Softmax and masking").
MASK_IN_DOT_FROM = 0.5


def mask_in_dot(params: NAParams, config: ResolvedConfig, scale: float, inverse: bool = False) -> bool:
    """A kernel's ``MASK_IN_DOT`` for a resolved config (see ``MASK_IN_DOT_FROM``; ``inverse``: dK/dV, whose outer
    tiles are keys).  Needs a positive scale: the scores are scaled after the matmul, and -inf must stay -inf."""
    axes = axes_of(params)
    pad = 3 - len(axes)
    partial = partial_axes(axes, config.outer_tile[pad:], config.inner_tile[pad:], inverse)
    return scale > 0 and partial >= MASK_IN_DOT_FROM * len(axes)


# dK/dV puts the queries on the matmul rows from this query-tile size on (``QUERY_ROWS`` in the kernel): k/v
# are then B operands and the kernel spills less, but smaller query tiles fall under wgmma's 64-row minimum and keep
# the keys as rows (docs/fused.md, "Backward").
DKDV_QUERY_ROWS_FROM = 64


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """The tiles a kernel reads (k/v for the forward and dQ, q/dO/k/v for dK/dV) can be TMA bulk
    copies: a Hopper or newer GPU with 16-bit values (the interpreter runs the same kernel code in any
    dtype), base pointers and batch / token / head strides on 16-byte boundaries (the copy engine's
    rule; the descriptors step whole tokens and heads)."""
    if kernels.interpreted():  # any GPU and dtype, but the copy engine's alignment rule still holds for descriptors
        return all(_copy_aligned(t) for t in tensors)
    major = capability(tensors[0].device)
    if major is None or major[0] < 9:
        return False
    return all(t.dtype in (torch.float16, torch.bfloat16) and _copy_aligned(t) for t in tensors)


def _copy_aligned(t: torch.Tensor) -> bool:
    """Base pointer and batch / token / head strides of a [B, N, H, D] tensor on 16-byte boundaries (TMA's rule)."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:3])


def host_descriptors_ok(params: NAParams, k4: torch.Tensor, v4: torch.Tensor, batch: int, heads: int) -> bool:
    """The forward's K/V descriptors can be built on the host (``host_kv_descriptors``): no dilation (one group),
    heads packed in each token (head stride = head dim, unit last stride), power-of-two head dims (a box never
    reaches into the next head) and one launch for the whole batch (a descriptor spans it)."""
    if any(d != 1 for d in params.dilation) or len(batch_chunks(batch, heads)) != 1:
        return False
    for t in (k4, v4):
        dim = t.shape[-1]
        if dim < 16 or dim & (dim - 1) or t.stride(3) != 1 or t.stride(2) != dim or not _copy_aligned(t):
            return False
    return True


def host_kv_layouts(params: NAParams, k: torch.Tensor, v: torch.Tensor, kv_tile) -> tuple:
    """(shape, strides, box) of the forward's host-built K and V descriptors: ``[B, L0, L1, L2, heads * D]`` arrays
    read in ``(1, *kv_tile, D)`` boxes (the kernel's ``HOST_DESC``).  ``k`` / ``v`` may be the flat-token views or the
    tensors themselves (same memory, ``host_descriptors_ok``)."""
    L = (1,) * (3 - params.rank) + tuple(params.spatial)
    layouts = []
    for t in (k, v):
        tok = t.stride(-3)  # token stride: the same in the [B, N, H, D] view and in [B, *spatial, H, D]
        heads, dim = t.shape[-2], t.shape[-1]
        layouts.append(([t.shape[0], *L, heads * dim], [t.stride(0), L[1] * L[2] * tok, L[2] * tok, tok, 1],
                        [1, *kv_tile, dim]))
    return tuple(layouts)

def batch_chunks(batch: int, heads: int) -> list[tuple[int, int]]:
    """Batch ranges ``[lo, hi)`` whose B*H fits the grid's second dimension (CUDA's limit is 65535): every Triton
    launcher with a ``(tiles, B * H)`` grid (this one and ``ops.gemm.triton_kernels``) runs one launch per range."""
    step = max(1, MAX_GRID_Y // heads)
    return [(lo, min(batch, lo + step)) for lo in range(0, batch, step)]


def _rpb_direct(rpb) -> bool:
    """The kernels read a float32 contiguous ``[H, ...]`` table: such an rpb goes in as it is."""
    return rpb is not None and rpb.dtype == torch.float32 and rpb.is_contiguous()


def _same_memory(pairs) -> bool:
    """Every flat-token view is the tensor itself, reshaped (so the tensor can be passed instead)."""
    return all(t4.data_ptr() == t.data_ptr() and t4.dtype == t.dtype for t4, t in pairs)


# A kernel's launches for one problem: one per batch range whose B*H fits the grid (``batch_chunks``), each
# ``(launch, first batch element, end)``.
Chunks = tuple[tuple[launch._Launch, int, int], ...]


def _chunked(kernel, programs: int, heads: int, batch: int, scalars: tuple, meta: dict) -> Chunks:
    return tuple((launch._Launch(kernel, (programs, (hi - lo) * heads), scalars, meta), lo, hi)
                 for lo, hi in batch_chunks(batch, heads))


# --- the decision cache ---------------------------------------------------------------------------------------------
# Plans per problem and input layout, under keys that hold everything their decisions read: the problem, shapes,
# strides, dtypes, device (and with it its capability), base alignment (TMA), the rpb's layout, scale, the call's flags
# (lse, deterministic dRPB, dRPB wanted, host descriptors), the module switches (BIAS_TILES, hopper.ENABLED), torch's
# float32 matmul setting and the tuner's state (on / off, pinned configs, the tuning cache's version).  Eager models
# call the same few problems over and over, and at small maps (NAT's 14x14 stage) the kernels run for less time than
# deciding their arguments takes: a warm call is one lookup here.
_PLANS: dict[tuple, "ForwardPlan | BackwardPlan"] = {}
MAX_PLANS = 2048


def forward_plan(q, k, v, rpb, params: NAParams, scale: float, need_lse: bool = True,
                 host_descriptors: bool = True) -> "ForwardPlan":
    """The forward's plan for these inputs: the cached one, else ``decide_forward``'s, kept."""
    plan = _PLANS.get(_forward_key(q, k, v, rpb, params, scale, need_lse, host_descriptors))
    if plan is None:
        plan = decide_forward(q, k, v, rpb, params, scale, need_lse, host_descriptors)
        # keyed after deciding: a decision may load or add to the tuning cache, which the key's tuner state counts
        launch.remember_plan(_PLANS, _forward_key(q, k, v, rpb, params, scale, need_lse, host_descriptors), plan,
                             MAX_PLANS)
    return plan


def backward_plan(q, k, v, rpb, out, lse, d_out, d_lse, params: NAParams, scale: float, deterministic: bool,
                  want_drpb: bool, grads=None, host_descriptors: bool = True) -> "BackwardPlan":
    """The backward's plan for these inputs: the cached one, else ``decide_backward``'s, kept."""
    key = (q, k, v, rpb, out, lse, d_out, d_lse, params, scale, deterministic, want_drpb, grads, host_descriptors)
    plan = _PLANS.get(_backward_key(*key))
    if plan is None:
        plan = decide_backward(*key)
        launch.remember_plan(_PLANS, _backward_key(*key), plan, MAX_PLANS)
    return plan


def plans(kind: str) -> list:
    """The plans of one kind (``"forward"`` or ``"backward"``) decided and kept so far, oldest first."""
    return [plan for key, plan in _PLANS.items() if key[0] == kind]


# --- forward --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ForwardPlan:
    """Every launch parameter of a forward problem and input layout (``decide_forward``), and the decisions behind
    them (``choices``, ``config`` and where it came from) for ``explain``."""

    launches: Chunks
    tokens: int  # N: the kernels see the inputs as [B, N, H, D]
    out_shape: tuple  # [B, *spatial, Hq, Dv]
    lse_shape: tuple | None  # [B, *spatial, Hq], or None where the kernel skips the store (``need_lse`` False)
    as_tokens: bool  # the inputs need ``_tokens`` copies (strided spatial axes, bfloat16 under the interpreter)
    rpb_direct: bool  # the rpb tensor is the kernels' table as it is (float32, contiguous, one launch)
    host_desc_layouts: tuple | None = None  # (K/V layouts,) of host-built descriptors, rebuilt per call
    bias_tiles: tuple | None = None  # (launch, elements, dtype) of the per-box RPB tiles (``na_bias_tiles_kernel``)
    hopper: hopper.HopperForward | None = None  # the problem runs on the Hopper kernel instead (``hopper.py``)
    choices: ForwardChoices | None = None
    config: ResolvedConfig | None = None  # the portable kernel's (None on the Hopper kernel, or the tuner's to come)
    config_source: str = ""
    flags: dict = dataclasses.field(default_factory=dict)  # the portable kernel's decided constexprs

    @property
    def launch(self) -> launch._Launch:
        """The first batch range's launch (the only one unless B * H passes the grid)."""
        return self.launches[0][0]


def _forward_key(q, k, v, rpb, params, scale, need_lse, host_descriptors):
    # k / v alignment decides whether their tiles can be bulk copies (tma_eligible)
    return ("forward", params, q.shape, q.stride(), k.shape, k.stride(), v.stride(), v.shape[-1], q.dtype, q.device,
            None if rpb is None else (rpb.dtype, rpb.stride()), scale, k.data_ptr() % 16, v.data_ptr() % 16, need_lse,
            BIAS_TILES, autotune.state(),
            dot_precision(q.dtype), host_descriptors, hopper.ENABLED)


# The kernels read each box's RPB and window mask as one contiguous tile of a table built per call
# (``kernels.na_bias_tiles_kernel``) wherever there is an RPB and the scale is positive, instead of gathering the bias
# per element: the table is shared by the batch and stays in L2 (docs/fused.md, "Softmax and masking").  Off (also
# through ``NAMODELS_BIAS_TILES=0``): the per-element gather, which the tests run too.
BIAS_TILES = os.environ.get("NAMODELS_BIAS_TILES", "1") != "0"


# A kernel's bias tiles (and dQ's tile-layout float32 dS) hold every box of every program once per head: small for
# small windows but large for large 3-D windows (sizes in docs/fused.md, "Softmax and masking").  Above this many
# elements a launch gathers the bias per element instead (and dRPB takes the window layout or the offset pass), where
# long loops amortise the per-element work anyway.
BIAS_TILE_ELEMENTS = 16 * 1024 * 1024


def bias_tiles_fit(heads: int, programs: int, boxes: int, tile: int) -> bool:
    return heads * programs * boxes * tile <= BIAS_TILE_ELEMENTS


def _boxes_and_tile(params: NAParams, config: ResolvedConfig, inverse: bool = False) -> tuple[int, int]:
    """(the most boxes any program of a launch visits, elements per box): a launch's bias tiles per program and
    head (``inverse``: dK/dV's loops)."""
    pad = 3 - params.rank
    boxes = max_boxes(axes_of(params), config.outer_tile[pad:], config.inner_tile[pad:], inverse)
    return boxes, math.prod(config.outer_tile) * math.prod(config.inner_tile)


def bias_tiles_dtype(dtype: torch.dtype) -> torch.dtype:
    """The bias table's dtype: float32 for float32 inputs; float16 for 16-bit ones (half the bytes of float32, and
    8x finer than bfloat16; RPB values beyond its range saturate)."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def _bias_tiles_spec(kernel, programs: int, heads: int, scale: float, window, boxes: int, meta: dict, tile: int,
                     dtype, **extra):
    """(launch, elements, dtype) of a kernel's bias tiles: ``boxes`` tiles of ``tile`` elements per program and
    query head.  ``extra``: the generator's other constexprs, every one given (the compiled launch passes them in
    order and skips defaults)."""
    tmeta = {name: meta[name] for name in ("CAUSAL0", "CAUSAL1", "CAUSAL2", "ACT0", "ACT1", "T0", "T1", "T2",
                                           "U0", "U1", "U2")}
    generator = launch._Launch(kernel, (programs, heads), (heads, 1.0 / (scale * kernels.LOG2E), *window, boxes),
                     tmeta | extra | dict(num_warps=4, num_stages=1))
    return generator, heads * programs * boxes * tile, dtype


# why a plan with ``host_descriptors=False`` keeps every kernel off its Hopper kernel, which reads every tile through
# host-built descriptors
NO_HOST_DESCRIPTORS = "the launch builds no host descriptors (the taped NAT block's training path)"


def _takes_hopper(kernel: str, why: str | None) -> bool:
    """Whether a plan runs ``kernel`` on its Hopper kernel (``why`` is ``None``); else ``why``, the reason,
    goes to this module's debug log, once per plan (plans are cached)."""
    if why is not None:
        log.debug("fused %s: portable kernel; not the Hopper kernel: %s", kernel, why)
    return why is None


# --- decisions ------------------------------------------------------------------------------------------------------
# The launch parameters that are choices, as functions of the problem, its layout and a resolved config, with no
# kernel run: ``decide_forward`` / ``decide_backward`` build their launches from them, and ``ops.fused.explain`` reports
# them, so the two cannot disagree.

@dataclass(frozen=True)
class ForwardChoices:
    """A forward's decisions that hold for every tile config (``forward_choices``)."""

    hopper_why: str | None  # why the portable kernel runs; None: the Hopper kernel does
    tma_ok: bool  # K/V tiles may be TMA copies (``tma_eligible``)
    host_desc: bool  # ... through descriptors built on the host (``host_descriptors_ok``)
    idx64: bool  # ``IDX64`` (``needs_int64``)
    precision: str  # ``PREC`` (``dot_precision``)
    bias_tiles: bool  # RPB through bias tiles wherever a launch's table fits (``BIAS_TILES``, positive scale)


def forward_choices(q4, k4, v4, rpb, params: NAParams, scale: float, dtype: torch.dtype,
                    host_descriptors: bool) -> ForwardChoices:
    """``q4`` / ``k4`` / ``v4``: the kernels' ``[B, N, H, D]`` views (``_tokens``); ``dtype``: the inputs' dtype."""
    b, hq = q4.shape[0], q4.shape[-2]
    tma_ok = tma_eligible(k4, v4)
    out4 = torch.empty((b, params.num_tokens, hq, v4.shape[-1]), device="meta")
    return ForwardChoices(
        hopper_why=hopper_unsupported(q4, k4, v4, rpb, params, scale) if host_descriptors else NO_HOST_DESCRIPTORS,
        tma_ok=tma_ok, host_desc=host_descriptors and tma_ok and host_descriptors_ok(params, k4, v4, b, hq),
        idx64=needs_int64(q4, k4, v4, out4), precision=dot_precision(dtype),
        bias_tiles=BIAS_TILES and rpb is not None and scale > 0)


def forward_flags(choices: ForwardChoices, params: NAParams, config: ResolvedConfig, scale: float,
                  has_rpb: bool, heads: int, need_lse: bool) -> dict:
    """The forward kernel's decided constexprs for a resolved config (the others: ``_constexprs``)."""
    _, programs = launch._window_args(params, config.outer_tile)
    flags = {"BIAS_TILES": choices.bias_tiles and bias_tiles_fit(heads, programs, *_boxes_and_tile(params, config))}
    # the row max is taken before scaling, which needs a positive scale
    flags["FOLD_SCALE"] = scale > 0 and (not has_rpb or flags["BIAS_TILES"])
    flags["MASK_IN_DOT"] = flags["BIAS_TILES"] or (flags["FOLD_SCALE"] and mask_in_dot(params, config, scale))
    flags["TMA"] = config.tma and choices.tma_ok
    flags["HOST_DESC"] = flags["TMA"] and choices.host_desc
    flags["STORE_LSE"] = need_lse
    return flags


def decide_forward(q, k, v, rpb, params: NAParams, scale: float, need_lse: bool, host_descriptors: bool = True,
                   dry: bool = False) -> ForwardPlan:
    """The forward's plan for these inputs' problem and layout: kernel family, tiles (pinned, tuning cache, tuner or
    defaults), TMA and host descriptors, masking mode, bias tiles, index width, batch chunks.  ``dry``: nothing runs
    (no tuner; ``explain``), so a config the tuner would pick is None and the plan has no launches."""
    b, n, hq, hkv = q.shape[0], params.num_tokens, q.shape[-2], k.shape[-2]
    d, dv = q.shape[-1], v.shape[-1]
    spatial = tuple(q.shape[1:-2])
    q4, k4, v4 = launch._tokens(q, n), launch._tokens(k, n), launch._tokens(v, n)
    out4 = torch.empty((b, n, hq, dv), device="meta")
    lse_strides = (n * hq, hq) if need_lse else (0, 0)
    has_rpb = rpb is not None
    # (precision: torch's float32 matmul setting, part of the plan's key)
    choices = forward_choices(q4, k4, v4, rpb, params, scale, q.dtype, host_descriptors)
    why = choices.hopper_why
    on_hopper = hopper.build_launches(q4, k4, v4, params, scale, need_lse) if _takes_hopper("forward", why) else None
    if on_hopper is not None:
        return ForwardPlan((), n, (b, *spatial, hq, dv), (b, *spatial, hq) if need_lse else None,
                           as_tokens=not _same_memory(((q4, q), (k4, k), (v4, v))), rpb_direct=False,
                           hopper=on_hopper, choices=choices, config_source="the Hopper kernel's fixed tiles")

    @functools.cache  # the tuner runs each candidate many times
    def decide(config: ResolvedConfig):
        window, programs = launch._window_args(params, config.outer_tile)
        meta = constexprs(params, config, config.outer_tile, config.inner_tile, d, dv, has_rpb, choices.idx64,
                           choices.precision)
        boxes, tile = _boxes_and_tile(params, config)
        meta.update(forward_flags(choices, params, config, scale, has_rpb, hq, need_lse))
        scalars = (*_strides(q4), *_strides(k4), *_strides(v4), *_strides(out4), *lse_strides,
                   hq, hq // hkv, d, dv, scale * kernels.LOG2E, *window, boxes)
        layouts = (host_kv_layouts(params, k4, v4, config.inner_tile),) if meta["HOST_DESC"] else None
        tiles = None
        if meta["BIAS_TILES"]:
            tiles = _bias_tiles_spec(kernels.na_bias_tiles_kernel, programs, hq, scale, window, boxes, meta, tile,
                                     bias_tiles_dtype(q.dtype), OFFSETS=False, ZERO_TILES=False)
        return _chunked(kernels.na_fwd_kernel, programs, hq, b, scalars, meta), layouts, tiles

    @functools.cache
    def tuning_outputs():
        return (launch._rpb_table(rpb, hq) if has_rpb else q4,
                torch.empty((b, n, hq, dv), dtype=q.dtype, device=q.device),
                torch.empty((b, n, hq), dtype=torch.float32, device=q.device))

    def run_candidate(config: ResolvedConfig):
        launches, layouts, tiles = decide(config)
        table, out, lse = tuning_outputs()
        launch._run_chunks(launches, (q4, k4, v4, table, out, lse, *launch.descriptor_args(q4, layouts, (k4, v4)),
                               launch._bias_tiles(tiles, table, q4)))

    config, source = tile_config("fwd", q, k, v, params, has_rpb, run_candidate, tma=choices.tma_ok,
                                 host_descriptors=choices.host_desc, tune=not dry)
    launches, layouts, tiles = decide(config) if config is not None else ((), None, None)
    direct = _same_memory(((q4, q), (k4, k), (v4, v)))
    return ForwardPlan(launches, n, (b, *spatial, hq, dv), (b, *spatial, hq) if need_lse else None,
                       as_tokens=not direct, rpb_direct=_rpb_direct(rpb) and len(launches) == 1,
                       host_desc_layouts=layouts, bias_tiles=tiles, choices=choices, config=config,
                       config_source=source, flags=launches[0][0].meta if launches else {})


# --- backward -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BackwardPlan:
    """Every launch parameter of a backward problem and input layout (``decide_backward``): dQ (which also writes
    delta), dK/dV and the dRPB path (dQ's dS summed by ``na_drpb_tiles_kernel`` or ``na_drpb_window_kernel``, or the
    offset pass); and the decisions behind them for ``explain``."""

    dq_launches: Chunks
    dkdv_launches: Chunks
    shapes: tuple  # (B, N, Hq, Hkv, D, Dv)
    params: NAParams
    as_tokens: bool  # the inputs need ``_tokens`` copies (see ``ForwardPlan``), lse / d_lse float32 copies
    rpb_direct: bool
    ds_window: tuple | None = None  # shape of dQ's window-layout dS (``rpb_grad``) where it gives dRPB
    ds_atomic: bool = False  # that buffer is summed over the batch by the dQ kernel's atomics (``window_ds_atomic``)
    reduce: launch._Launch | None = None  # na_drpb_window_kernel over that buffer
    drpb_launches: Chunks | None = None  # the offset pass, where the window buffer would be too large
    drpb_buffer: tuple | None = None  # the offset pass's accumulator: per-program partial rows unless atomic
    drpb_atomic: bool = False
    dq_layouts: tuple | None = None  # (K/V layouts,) of dQ's host-built descriptors, if any
    dkdv_layouts: tuple | None = None  # (K/V, Q/dO layouts) of dK/dV's host-built descriptors, if any
    dq_bias_tiles: tuple | None = None  # (launch, elements, dtype) of dQ's / dK/dV's bias tiles (see ``ForwardPlan``)
    dkdv_bias_tiles: tuple | None = None
    ds_tiles: int = 0  # elements of dQ's tile-layout dS where it gives dRPB (``rpb_grad.reduce_tile_ds``), else 0
    tile_index: torch.Tensor | None = None  # that path's gather index [R, M]
    hopper_dq: hopper_dq.HopperDq | None = None  # dQ runs on the Hopper kernel instead of dq_launches
    hopper_dkdv: hopper_dkdv.HopperDkDv | None = None  # dK/dV runs on the Hopper kernel instead of dkdv_launches
    choices: BackwardChoices | None = None
    dq_config: ResolvedConfig | None = None  # dQ's portable config (picked untuned even where Hopper runs dQ)
    dq_source: str = ""
    dkdv_config: ResolvedConfig | None = None
    dkdv_source: str = ""
    dq_flags: dict = dataclasses.field(default_factory=dict)  # the portable kernels' decided constexprs
    dkdv_flags: dict = dataclasses.field(default_factory=dict)
    drpb_mode: str | None = None  # ``drpb_mode``; None without an RPB gradient
    offset_config: ResolvedConfig | None = None  # the offset pass's config
    offset_programs: int = 0  # the offset pass's programs per batch element and head

    @property
    def dq(self) -> launch._Launch:
        return self.dq_launches[0][0]

    @property
    def dkdv(self) -> launch._Launch:
        return self.dkdv_launches[0][0]


def _backward_key(q, k, v, rpb, out, lse, d_out, d_lse, params, scale, deterministic, want_drpb, grads,
                  host_descriptors):
    d_lse_layout = None if d_lse is None else (d_lse.dtype, d_lse.stride())
    alignment = tuple(t.data_ptr() % 16 for t in (q, k, v, d_out))  # decides TMA eligibility
    grads_layout = None if grads is None else tuple(g.stride() for g in grads)
    return ("backward", params, q.shape, q.stride(), k.shape, k.stride(), v.stride(), v.shape[-1], out.stride(),
            d_out.stride(), d_out.dtype, lse.dtype, lse.stride(), d_lse_layout, q.dtype, q.device,
            None if rpb is None else (rpb.dtype, rpb.stride()), scale,
            deterministic, want_drpb, alignment, grads_layout, BIAS_TILES, autotune.state(),
            dot_precision(q.dtype), host_descriptors, hopper.ENABLED)


@dataclass(frozen=True)
class BackwardChoices:
    """A backward's decisions that hold for every tile config (``backward_choices``)."""

    dq_hopper_why: str | None  # why dQ runs on the portable kernel; None: on the Hopper kernel
    dkdv_hopper_why: str | None  # the same for dK/dV
    dq_tma_ok: bool  # dQ's K/V tiles may be TMA copies
    dkdv_tma_ok: bool  # dK/dV's Q/dO (and K/V) tiles may be TMA copies
    dq_host: bool  # ... through descriptors built on the host
    dkdv_host: bool
    idx64: bool
    precision: str
    bias_tiles: bool  # RPB through bias tiles wherever a launch's table fits
    ds_atomic: bool  # dQ's window-layout dS summed over the batch by atomics (``window_ds_atomic``)
    ds_tiles: bool  # dRPB from dQ's dS in the bias tiles' layout, where dQ's launch has bias tiles
    ds_shape: tuple | None  # dQ's window-layout dS buffer, where dRPB may come from it (``rpb_grad.window_path_ok``)


def backward_choices(q4, k4, v4, o4, do4, grads4, rpb, params: NAParams, scale: float, dtype: torch.dtype,
                     deterministic: bool, want_drpb: bool, host_descriptors: bool) -> BackwardChoices:
    """The kernels' ``[B, N, H, D]`` views of q, k, v, out, d_out and the gradient outputs (``_tokens``); ``dtype``:
    the inputs' dtype."""
    b, hq = q4.shape[0], q4.shape[-2]
    has_rpb = rpb is not None
    bias_tiles = BIAS_TILES and has_rpb and scale > 0
    # dRPB from dQ's dS: added over the batch in the bias tiles' layout where dQ's launch has bias tiles
    # (``rpb_grad.reduce_tile_ds``), else in window layout where that buffer is small enough, else from the offset pass
    ds_atomic = window_ds_atomic(deterministic)
    ds_shape = None
    if has_rpb and want_drpb and rpb_grad.window_path_ok(1 if ds_atomic else b, hq, params):
        ds_shape = rpb_grad.buffer_shape(1 if ds_atomic else b, hq, params)
    ds_meta = () if ds_shape is None else (torch.empty(ds_shape, device="meta"),)
    # with queries as rows dK/dV reads its own k/v tile by TMA too; all four must allow it (also asked of
    # key-rows tiles, which read k/v with pointer loads: one rule for the plan)
    dq_tma_ok, dkdv_tma_ok = tma_eligible(k4, v4), tma_eligible(q4, do4, k4, v4)
    kv_host = host_descriptors and BACKWARD_HOST_DESCRIPTORS and host_descriptors_ok(params, k4, v4, b, hq)
    return BackwardChoices(
        dq_hopper_why=(hopper_dq_unsupported(q4, k4, v4, do4, o4, rpb, params, scale) if host_descriptors
                       else NO_HOST_DESCRIPTORS),
        dkdv_hopper_why=(hopper_dkdv_unsupported(q4, k4, v4, do4, rpb, params, scale) if host_descriptors
                         else NO_HOST_DESCRIPTORS),
        dq_tma_ok=dq_tma_ok, dkdv_tma_ok=dkdv_tma_ok, dq_host=kv_host and dq_tma_ok,
        dkdv_host=kv_host and dkdv_tma_ok and host_descriptors_ok(params, q4, do4, b, hq),
        idx64=needs_int64(q4, k4, v4, do4, o4, *grads4, *ds_meta), precision=dot_precision(dtype),
        bias_tiles=bias_tiles, ds_atomic=ds_atomic,
        ds_tiles=bias_tiles and want_drpb and ds_atomic,  # where the chosen dQ launch's tiles fit (``dq_flags``)
        ds_shape=ds_shape)


def dq_flags(choices: BackwardChoices, params: NAParams, config: ResolvedConfig, scale: float, heads: int,
             has_dlse: bool) -> dict:
    """The dQ kernel's decided constexprs for a resolved config (the others: ``_constexprs``)."""
    _, programs = launch._window_args(params, config.outer_tile)
    flags = {"TMA": config.tma and choices.dq_tma_ok}
    flags["HOST_DESC"] = flags["TMA"] and choices.dq_host
    flags["BIAS_TILES"] = choices.bias_tiles and bias_tiles_fit(heads, programs, *_boxes_and_tile(params, config))
    flags["DS_BOXES"] = choices.ds_tiles and flags["BIAS_TILES"]
    flags["STORE_DS"] = choices.ds_shape is not None and not flags["DS_BOXES"]
    flags["DS_ATOMIC"] = choices.ds_atomic
    flags["MASK_IN_DOT"] = flags["BIAS_TILES"] or mask_in_dot(params, config, scale)
    flags["HAS_DLSE"] = has_dlse
    return flags


def dkdv_flags(choices: BackwardChoices, params: NAParams, config: ResolvedConfig, scale: float,
               heads: int) -> dict:
    """The dK/dV kernel's decided constexprs for a resolved config (outer tile: keys; the others: ``_constexprs``)."""
    _, programs = launch._window_args(params, config.outer_tile)
    flags = {"BISECT": max(math.ceil(L / dil).bit_length() for L, dil in zip(params.spatial, params.dilation))}
    flags["TMA"] = config.tma and choices.dkdv_tma_ok
    flags["QUERY_ROWS"] = math.prod(config.inner_tile) >= DKDV_QUERY_ROWS_FROM
    flags["HOST_DESC"] = flags["TMA"] and choices.dkdv_host
    flags["BIAS_TILES"] = choices.bias_tiles and bias_tiles_fit(heads, programs,
                                                                *_boxes_and_tile(params, config, inverse=True))
    flags["MASK_IN_DOT"] = flags["BIAS_TILES"] or mask_in_dot(params, config, scale, inverse=True)
    return flags


def drpb_mode(dq: dict, has_rpb: bool, want_drpb: bool) -> str | None:
    """How the backward sums dRPB, from dQ's flags (``dq_flags``): ``"tile-layout dS"``, ``"window-layout dS"``,
    ``"offset pass"``, or None where no RPB gradient is wanted."""
    if dq["DS_BOXES"]:
        return "tile-layout dS"
    if dq["STORE_DS"]:
        return "window-layout dS"
    return "offset pass" if has_rpb and want_drpb else None


def offset_pass_atomic(deterministic: bool, partial_bytes: int) -> bool:
    """Whether the offset pass adds dRPB with atomics rather than one partial row per program (see
    ``DRPB_PARTIAL_BYTES``)."""
    return not deterministic and partial_bytes > DRPB_PARTIAL_BYTES


def decide_backward(q, k, v, rpb, out, lse, d_out, d_lse, params: NAParams, scale: float, deterministic: bool,
                    want_drpb: bool, grads=None, host_descriptors: bool = True, dry: bool = False) -> BackwardPlan:
    """The backward's plan for these inputs' problem and layout (see ``decide_forward``), and its dRPB path.
    ``dry``: nothing runs (no tuner, and no tile-layout dS gather index, which a kernel writes)."""
    b, n, hq, hkv = q.shape[0], params.num_tokens, q.shape[-2], k.shape[-2]
    d, dv = q.shape[-1], v.shape[-1]
    q4, k4, v4 = launch._tokens(q, n), launch._tokens(k, n), launch._tokens(v, n)
    o4, do4 = launch._tokens(out, n), launch._tokens(d_out, n)
    lse3 = lse.reshape(b, n, hq).float().contiguous()
    dlse = d_lse.reshape(b, n, hq).float().contiguous() if d_lse is not None else None
    has_rpb = rpb is not None
    given = grads is not None
    if not given:  # allocated per call, contiguous
        grads = torch.empty((b, n, hq, d), device="meta"), torch.empty((b, n, hkv, d), device="meta"), \
            torch.empty((b, n, hkv, dv), device="meta")
    grads = tuple(g.reshape(b, n, g.shape[-2], g.shape[-1]) for g in grads)
    if any(g.stride(-1) != 1 for g in grads):
        raise ValueError("grads: the gradient outputs need unit last strides and flat-token views")
    # (precision: torch's float32 matmul setting, part of the plan's key)
    choices = backward_choices(q4, k4, v4, o4, do4, grads, rpb, params, scale, q.dtype, deterministic, want_drpb,
                               host_descriptors)
    ds_shape, ds_atomic = choices.ds_shape, choices.ds_atomic
    common = (*_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4), lse3.stride(0), lse3.stride(1))
    tiles_dtype = bias_tiles_dtype(q.dtype)

    @functools.cache  # the tuner runs each candidate many times
    def decide_dq(config):
        window, programs = launch._window_args(params, config.outer_tile)
        meta = constexprs(params, config, config.outer_tile, config.inner_tile, d, dv, has_rpb, choices.idx64,
                           choices.precision)
        boxes, tile = _boxes_and_tile(params, config)
        meta.update(dq_flags(choices, params, config, scale, hq, dlse is not None))
        scalars = (*common, *_strides(grads[0]), *_window_ds_strides(ds_shape, ds_atomic), *_strides(o4), hq,
                   hq // hkv, d, dv, scale * kernels.LOG2E, scale, *window, boxes)
        layouts = (host_kv_layouts(params, k4, v4, config.inner_tile),) if meta["HOST_DESC"] else None
        tiles = offsets = None
        if meta["BIAS_TILES"]:
            tiles = _bias_tiles_spec(kernels.na_bias_tiles_kernel, programs, hq, scale, window, boxes, meta, tile,
                                     tiles_dtype, OFFSETS=False, ZERO_TILES=meta["DS_BOXES"])
            offsets = _bias_tiles_spec(kernels.na_bias_tiles_kernel, programs, 1, scale, window, boxes, meta, tile,
                                       torch.int32, OFFSETS=True, ZERO_TILES=False)
        return _chunked(kernels.na_bwd_dq_kernel, programs, hq, b, scalars, meta), layouts, tiles, offsets

    @functools.cache
    def decide_dkdv(config):
        # outer tile = KV tile, inner tile = query tile
        window, programs = launch._window_args(params, config.outer_tile)
        meta = constexprs(params, config, config.inner_tile, config.outer_tile, d, dv, has_rpb, choices.idx64,
                           choices.precision)
        boxes, tile = _boxes_and_tile(params, config, inverse=True)
        meta.update(dkdv_flags(choices, params, config, scale, hq))
        scalars = (*common, *_strides(grads[1]), *_strides(grads[2]), hkv,
                   hq // hkv, d, dv, scale * kernels.LOG2E, scale, *window, boxes)
        layouts = None
        if meta["HOST_DESC"]:  # K/V in boxes of the KV tile, Q/dO in boxes of the query tile
            layouts = (host_kv_layouts(params, k4, v4, config.outer_tile),
                       host_kv_layouts(params, q4, do4, config.inner_tile))
        tiles = None
        if meta["BIAS_TILES"]:
            tiles = _bias_tiles_spec(kernels.na_bias_tiles_inverse_kernel, programs, hq, scale, window, boxes, meta,
                                     tile, tiles_dtype, BISECT=meta["BISECT"], QUERY_ROWS=meta["QUERY_ROWS"])
        return _chunked(kernels.na_bwd_dkdv_kernel, programs, hkv, b, scalars, meta), layouts, tiles

    @functools.cache
    def tuning_inputs() -> dict:
        """delta and gradient buffers for the tuner's candidate runs.  dQ candidates write delta themselves; dK/dV
        candidates may be tuned without a dQ run before them and read this real one (a NaN would send the kernels to
        their rare non-finite path and skew the timings)."""
        delta = (o4.float() * do4.float()).sum(-1)
        if dlse is not None:
            delta -= dlse
        return dict(delta=delta, table=launch._rpb_table(rpb, hq) if has_rpb else q4,
                    # the caller's gradient outputs where given (their strides are in the launches' scalars)
                    dq=grads[0] if given else torch.empty((b, n, hq, d), dtype=q.dtype, device=q.device),
                    dk=grads[1] if given else torch.empty((b, n, hkv, d), dtype=k.dtype, device=q.device),
                    dv=grads[2] if given else torch.empty((b, n, hkv, dv), dtype=v.dtype, device=q.device),
                    ds=None if ds_shape is None else launch._window_ds_buffer(ds_shape, ds_atomic, q.device))

    def run_dq(config):
        launches, layouts, tiles, _ = decide_dq(config)
        s = tuning_inputs()
        ds = s["ds"]
        ds_boxes = launches[0][0].meta["DS_BOXES"]
        if ds_boxes:  # the tile-layout buffer's size follows the candidate's tiles; its tile generator zeroes it
            ds = torch.empty(tiles[1], dtype=torch.float32, device=q.device)
        elif ds_atomic and ds is not None:  # each candidate run adds from zero
            ds.zero_()
        launch._run_chunks(launches, (q4, k4, v4, s["table"], do4, lse3, s["delta"], s["dq"],
                               *launch.descriptor_args(q4, layouts, (k4, v4)), q4 if ds is None else ds,
                               launch._bias_tiles(tiles, s["table"], q4, ds if ds_boxes else None), o4,
                               s["delta"] if dlse is None else dlse))

    def run_dkdv(config):
        launches, layouts, tiles = decide_dkdv(config)
        s = tuning_inputs()
        launch._run_chunks(launches, (q4, k4, v4, s["table"], do4, lse3, s["delta"], s["dk"], s["dv"],
                                      *launch.descriptor_args(q4, layouts, (k4, v4), (q4, do4)),
                                      launch._bias_tiles(tiles, s["table"], q4)))

    dq_on_hopper = (hopper_dq.build_launches(q4, k4, v4, do4, o4, params, scale, grads[0])
                    if _takes_hopper("dQ", choices.dq_hopper_why) else None)
    dq_config, dq_source = tile_config("dq", q, k, v, params, has_rpb, run_dq, tunable=dq_on_hopper is None,
                                       tma=choices.dq_tma_ok, host_descriptors=choices.dq_host, tune=not dry)
    dq_launches, dq_layouts, dq_tiles, dq_offsets = decide_dq(dq_config) if dq_config else ((), None, None, None)
    on_hopper = (hopper_dkdv.build_launches(q4, k4, v4, do4, params, scale, grads[1:])
                 if _takes_hopper("dK/dV", choices.dkdv_hopper_why) else None)
    config, source = tile_config("dkdv", q, k, v, params, has_rpb, run_dkdv, tunable=on_hopper is None,
                                 tma=choices.dkdv_tma_ok, host_descriptors=choices.dkdv_host, tune=not dry)
    dkdv_launches, dkdv_layouts, dkdv_tiles = decide_dkdv(config) if config else ((), None, None)
    pairs = ((q4, q), (k4, k), (v4, v), (o4, out), (do4, d_out), (lse3, lse))
    if d_lse is not None:
        pairs += ((dlse, d_lse),)
    dq_meta = dq_launches[0][0].meta if dq_launches else {}
    mode = drpb_mode(dq_meta, has_rpb, want_drpb) if dq_meta else None
    rpb_direct = _rpb_direct(rpb) and len(dq_launches) == 1 == len(dkdv_launches)
    drpb = dict(reduce=None, ds_tiles=0, tile_index=None, drpb_launches=None, drpb_buffer=None, drpb_atomic=False,
                offset_config=None, offset_programs=0)
    if mode == "tile-layout dS":
        n_rel = math.prod(rpb.shape[1:])
        drpb["ds_tiles"] = dq_tiles[1]
        if not dry:  # the index comes from a kernel run (the generator's OFFSETS mode), kept per problem and tiles
            index = rpb_grad.tile_index((params, dq_config.outer_tile, dq_config.inner_tile), dq_offsets[0],
                                        dq_offsets[1], n_rel, q.device)
            drpb["tile_index"] = index
            drpb["reduce"] = launch._Launch(kernels.na_drpb_tiles_kernel, (n_rel, hq),
                                            (dq_tiles[1] // hq, index.shape[1], n_rel),
                                            dict(BLOCK=rpb_grad.TILE_REDUCE_BLOCK, num_warps=4))
    elif mode == "window-layout dS":
        grid, scalars = rpb_grad.reduce_arguments(params, hq, rpb_grad.slot_tables(params, q.device)[1])
        drpb["reduce"] = launch._Launch(kernels.na_drpb_window_kernel, grid, scalars,
                                        dict(BLOCK_N=rpb_grad.REDUCE_BLOCK, num_warps=4))
    elif mode == "offset pass":
        drpb.update(_drpb_launch(q4, k4, v4, rpb, common, params, scale, deterministic, q, k, v, choices.idx64))
        rpb_direct = False  # the offset pass reads the [H, R] table: the chunks keep it whole
    return BackwardPlan(dq_launches, dkdv_launches, (b, n, hq, hkv, d, dv), params,
                        as_tokens=not _same_memory(pairs), rpb_direct=rpb_direct,
                        ds_window=ds_shape if dq_meta.get("STORE_DS") else None, ds_atomic=ds_atomic,
                        dq_layouts=dq_layouts, dkdv_layouts=dkdv_layouts, dq_bias_tiles=dq_tiles,
                        dkdv_bias_tiles=dkdv_tiles, hopper_dq=dq_on_hopper, hopper_dkdv=on_hopper, choices=choices,
                        dq_config=dq_config, dq_source=dq_source, dkdv_config=config, dkdv_source=source,
                        dq_flags=dq_meta, dkdv_flags=dkdv_launches[0][0].meta if dkdv_launches else {},
                        drpb_mode=mode, **drpb)


def window_ds_atomic(deterministic: bool) -> bool:
    """Whether dQ sums its window-layout dS over the batch with float32 atomics (one [N, H, slots] buffer, summation
    order free) rather than storing one buffer per batch element for the host to sum (bitwise reproducible, B times
    the memory traffic; taken under ``deterministic``)."""
    return not deterministic


def _window_ds_strides(shape, atomic: bool) -> tuple:
    """(batch, token, head) strides of the window-layout buffer ``[B, N, H, slots]``; every batch element adds into
    the same memory when it is atomic."""
    if shape is None:
        return 0, 0, 0
    _, n, h, slots = shape
    return (0 if atomic else n * h * slots), h * slots, slots


def _drpb_launch(q4, k4, v4, rpb, common, params, scale, deterministic, q, k, v, idx64) -> dict:
    """The offset pass's dRPB launches (one grid row per batch element and head), the shape of its zeroed
    accumulator, whether it adds with atomics, and its config and programs (``BackwardPlan``'s fields)."""
    b, hq, hkv = q4.shape[0], q4.shape[2], k4.shape[2]
    d, dv = q4.shape[-1], v4.shape[-1]
    n_rel = math.prod(rpb.shape[1:])
    config, _ = tile_config("drpb", q, k, v, params, True, tunable=False)
    window, programs = launch._window_args(params, config.outer_tile)
    _, _, _, _, C = launch._axes3(params)
    tile = config.outer_tile
    partial_bytes = b * hq * programs * n_rel * 4
    atomic = offset_pass_atomic(deterministic, partial_bytes)
    # per-program rows as [B, H, programs, R]: batch chunks slice it like q/k/v, and the kernel's row index
    # (b * H + h) * programs + program addresses the same memory
    buffer = (hq, n_rel) if atomic else (b, hq, programs, n_rel)
    meta = dict(CAUSAL0=C[0], CAUSAL1=C[1], CAUSAL2=C[2], T0=tile[0], T1=tile[1], T2=tile[2],
                BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                ATOMIC=atomic, IDX64=idx64, num_warps=config.num_warps, num_stages=config.num_stages)
    scalars = (*common, hq, hq // hkv, d, dv, scale * kernels.LOG2E, *window)
    return dict(drpb_launches=_chunked(kernels.na_bwd_drpb_kernel, programs, hq, b, scalars, meta),
                drpb_buffer=buffer, drpb_atomic=atomic, offset_config=config, offset_programs=programs)


# --- the Hopper kernels -----------------------------------------------------------------------------------------------

def hopper_unsupported(q4, k4, v4, rpb, params: NAParams, scale: float, ranks: tuple = hopper.RANKS) -> str | None:
    """Why the Hopper kernel cannot run this problem (None where it can); ``q4`` / ``k4`` / ``v4``: ``[B, N, H, D]``;
    ``ranks``: the problem ranks the kernel runs (``hopper_dkdv`` has its own)."""
    if not hopper.ENABLED:
        return "disabled (NAMODELS_HOPPER=0)"
    if hopper.gluon is None:
        return "needs Triton's Gluon dialect (Triton 3.5 or newer)"
    if capability(q4.device) != (9, 0):
        return "needs an sm_90 GPU"
    if q4.dtype not in (torch.float16, torch.bfloat16) or not (q4.dtype == k4.dtype == v4.dtype):
        return "needs 16-bit inputs"
    if q4.shape[-1] not in hopper.HEAD_DIMS or v4.shape[-1] != q4.shape[-1]:
        return f"needs head dim in {hopper.HEAD_DIMS} equal to the value dim"
    if rpb is not None:
        return "no RPB"
    if not scale > 0:
        return "needs a positive scale"
    if any(d != 1 for d in params.dilation):
        return "no dilation"
    if params.rank not in ranks:
        return f"{params.rank}-D problems run faster on the portable kernel"
    if params.window_size < hopper.MIN_WINDOW:
        return f"windows under {hopper.MIN_WINDOW} keys run faster on the portable kernel's smaller tiles"
    if params.num_tokens < hopper.ROWS:
        return "fewer tokens than one query tile"
    if not (host_descriptors_ok(params, k4, v4, q4.shape[0], q4.shape[-2])
            and host_descriptors_ok(params, q4, q4, q4.shape[0], q4.shape[-2])):
        return "Q/K/V layout does not allow host-built descriptors"
    if needs_int64(q4, k4, v4):
        return "offsets past 2**31 elements"
    if longest_loop(params) >= hopper.MAX_STEPS:
        return f"a query tile visiting {hopper.MAX_STEPS} key boxes or more"
    return None


def longest_loop(params: NAParams) -> int:
    """The most key boxes one query tile of the forward and dQ visits, with ``query_tiles``' boxes."""
    q_tile, kv_tile, _ = query_tiles(params)
    pad = 3 - params.rank
    return max_boxes(axes_of(params), q_tile[pad:], kv_tile[pad:])


def hopper_dq_unsupported(q4, k4, v4, do4, o4, rpb, params: NAParams, scale: float) -> str | None:
    """Why the Hopper dQ kernel cannot run this problem (None where it can); ``[B, N, H, D]`` inputs."""
    why = hopper_unsupported(q4, k4, v4, rpb, params, scale)
    if why is None and (do4.dtype != q4.dtype or o4.dtype != q4.dtype or do4.shape[-1] != v4.shape[-1]
                        or not host_descriptors_ok(params, do4, do4, do4.shape[0], do4.shape[-2])
                        or needs_int64(do4, o4)):
        why = "dO's or O's dtype, head dim or layout does not allow host-built descriptors"
    return why


def hopper_dkdv_unsupported(q4, k4, v4, do4, rpb, params: NAParams, scale: float) -> str | None:
    """Why the Hopper dK/dV kernel cannot run this problem (None where it can); ``[B, N, H, D]`` inputs."""
    why = hopper_unsupported(q4, k4, v4, rpb, params, scale, ranks=hopper_dkdv.RANKS)
    if why is None and (do4.dtype != q4.dtype or do4.shape[-1] != v4.shape[-1]
                        or not host_descriptors_ok(params, do4, do4, do4.shape[0], do4.shape[-2])
                        or needs_int64(do4)):
        why = "dO's dtype, head dim or layout does not allow host-built descriptors"
    return why


def query_tiles(params: NAParams) -> tuple[tuple, tuple, bool]:
    """``(q_tile, kv_tile, masked)``: the forward's and dQ's 128-row query box and 128-key box per axis
    (``choose_tiles``, leading dummy axes first) and whether some key box of some program needs a mask."""
    pad = 3 - params.rank
    axes = axes_of(params)
    q_tile, kv_tile = choose_tiles(axes, hopper.ROWS, hopper.COLS)
    masked = partial_axes(axes, q_tile, kv_tile) > 0
    return (1,) * pad + tuple(q_tile), (1,) * pad + tuple(kv_tile), masked


def runs_persistent(params: NAParams, masked: bool) -> bool:
    """Whether the forward's main kernel runs one program per SM over the work items (``PERSISTENT_``): mask-free
    launches, and masked ones where ``hopper.PERSISTENT_MASKED`` or the rank and causality allow it."""
    return (not masked or hopper.PERSISTENT_MASKED
            or (params.rank in hopper.PERSISTENT_MASKED_RANKS and not any(params.is_causal)))
