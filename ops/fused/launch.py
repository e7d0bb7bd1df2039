"""Host side of the fused kernels: one plan per problem and input layout, then launches.

``plan_forward`` / ``plan_backward`` decide every launch parameter of a call once (tiles from the defaults, the
tuning cache or the tuner; TMA and host-built descriptors; masking mode; index width; batch chunks; the dRPB path)
and return it; ``forward`` / ``backward`` look the plan up, allocate the outputs and run its launches, and the
tuner (``autotune``) only times the candidates a plan offers it.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import autotune, hopper, hopper_dkdv, hopper_dq, kernels, rpb_grad
from .tiles import axes_of, max_boxes, partial_axes
from ..window import NAParams

log = logging.getLogger(__name__)

# Deterministic dRPB writes one partial row per program; above this many bytes it uses atomics
# instead (unless torch.use_deterministic_algorithms is on).
DRPB_PARTIAL_BYTES = 64 * 1024 * 1024
MAX_GRID_Y = 65535


def _empty(shape, dtype, device):
    """Output allocation (tests replace this with a NaN-filled one to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tokens(t: torch.Tensor, n: int) -> torch.Tensor:
    """[B, *spatial, H, D] -> [B, N, H, D] with unit last stride (a view when possible).

    Triton's interpreter multiplies bfloat16 matrices wrongly (tl.dot on raw bf16 bits, seen with
    triton 3.8), so under the interpreter bfloat16 inputs are widened to float32 first; outputs keep
    the input dtype.  On the GPU the kernels read bfloat16 directly.
    """
    t = t.reshape(t.shape[0], n, t.shape[-2], t.shape[-1])
    if t.dtype == torch.bfloat16 and kernels.interpreted():
        t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


def _axes3(params: NAParams):
    """Per-axis (L, K, s, d, causal) padded to 3 axes with leading dummy axes."""
    pad = 3 - params.rank
    L = (1,) * pad + params.spatial
    K = (1,) * pad + params.kernel_size
    S = (1,) * pad + params.stride
    D = (1,) * pad + params.dilation
    C = (False,) * pad + params.is_causal
    return L, K, S, D, C


def _window_args(params: NAParams, tile):
    """Runtime window arguments plus tiles per group for an outer tile shape."""
    L, K, S, D, _ = _axes3(params)
    nt = [math.ceil(math.ceil(l / d) / t) for l, d, t in zip(L, D, tile)]
    programs = math.prod(d * n for d, n in zip(D, nt))
    return [*L, *K, *S, *D, *nt], programs


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


def _constexprs(params: NAParams, config: autotune.ResolvedConfig, q_tile, kv_tile, d, dv, has_rpb, idx64,
                precision):
    _, _, _, _, C = _axes3(params)
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


def mask_in_dot(params: NAParams, config: autotune.ResolvedConfig, scale: float, inverse: bool = False) -> bool:
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
    first = tensors[0]
    if not first.is_cuda or torch.cuda.get_device_capability(first.device)[0] < 9:
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


def host_kv_descriptors(k: torch.Tensor, v: torch.Tensor, layouts) -> tuple:
    """The K and V descriptors for this call's tensors (``host_kv_layouts``); the launcher encodes them per launch."""
    return TensorDescriptor(k, *layouts[0]), TensorDescriptor(v, *layouts[1])


def descriptor_args(stand_in: torch.Tensor, layouts, *pairs) -> tuple:
    """A launch's descriptor arguments: for each tensor pair (K/V, Q/dO) its host-built descriptors for this call's
    tensors, in the pair's entry of ``layouts`` (``host_kv_layouts``), or ``stand_in`` for each where ``layouts`` is
    None (the kernel leaves them unused)."""
    if layouts is None:
        return (stand_in,) * (2 * len(pairs))
    return tuple(desc for pair, layout in zip(pairs, layouts, strict=True)
                 for desc in host_kv_descriptors(*pair, layout))


# Scratch kept per stream: a launch's scratch is only read while the kernel runs, and the next launch on the same
# stream starts after it, so one buffer per stream serves every launch there instead of an allocation per launch.
_SCRATCH: dict[int, torch.Tensor] = {}


def _torch_scratch(size: int, alignment: int, stream):
    """Triton's scratch allocator: the stream's kept buffer, grown as needed; a fresh allocation while a CUDA graph
    is captured (the graph replays with the memory it captured, on whichever stream)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    buffer = _SCRATCH.get(stream)
    if buffer is None or buffer.numel() < size:
        buffer = _SCRATCH[stream] = torch.empty(max(size, 1 << 16), dtype=torch.int8, device="cuda")
    return buffer


def ensure_scratch_allocator(meta: dict) -> None:
    """Kernels that build TMA descriptors on the device (``meta["TMA"]``) write them to a global scratch
    buffer, which Triton allocates per launch through ``triton.set_allocator``.  Installs one backed by
    torch's caching allocator unless the caller set their own.  The setting is a ContextVar (per
    thread), so every launch runs this first: autograd's worker threads start without it."""
    if not meta.get("TMA"):
        return
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def batch_chunks(batch: int, heads: int) -> list[tuple[int, int]]:
    """Batch ranges ``[lo, hi)`` whose B*H fits the grid's second dimension (CUDA's limit is 65535): every Triton
    launcher with a ``(tiles, B * H)`` grid (this one and ``ops.gemm.triton_kernels``) runs one launch per range."""
    step = max(1, MAX_GRID_Y // heads)
    return [(lo, min(batch, lo + step)) for lo in range(0, batch, step)]


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _rpb_table(rpb, heads):
    return rpb.detach().reshape(heads, -1).float().contiguous() if rpb is not None else None


def _rpb_direct(rpb) -> bool:
    """The kernels read a float32 contiguous ``[H, ...]`` table: such an rpb goes in as it is."""
    return rpb is not None and rpb.dtype == torch.float32 and rpb.is_contiguous()


def _same_memory(pairs) -> bool:
    """Every flat-token view is the tensor itself, reshaped (so the tensor can be passed instead)."""
    return all(t4.data_ptr() == t.data_ptr() and t4.dtype == t.dtype for t4, t in pairs)


@dataclass
class _Launch:
    """One kernel launch with everything but the tensors fixed (grid, scalar arguments, constexprs).

    Once the kernel is compiled, calls skip Triton's per-call argument binding (``compiled``): that
    binding costs about as much as the rest of a small call.  The compiled
    kernel was specialised on which pointers were 16-byte aligned (``aligned``); a call whose pointers
    differ there, or that runs on another device, goes through Triton's normal launch instead."""

    kernel: object
    grid: tuple[int, int]
    scalars: tuple
    meta: dict
    compiled: object = None
    constexprs: tuple = ()
    aligned: tuple = ()
    device: int = -1
    pointers_only: bool = False  # every argument is a tensor (no host-built descriptor)
    all_aligned: bool = False

    def __call__(self, tensors) -> None:
        ensure_scratch_allocator(self.meta)
        if _compiled_launch(self, tensors):
            return
        compiled = self.kernel[self.grid](*tensors, *self.scalars, **self.meta)
        if self.compiled is None:
            _remember_compiled(self, compiled, tensors)


PlannedLaunch = _Launch  # (the name other Triton launchers use: ops.layer_norm)


def _alignment(tensors) -> tuple:
    """Which tensor arguments are 16-byte aligned (what Triton specialised the compiled kernel on); host-built
    TMA descriptors among the arguments are not pointers and are encoded per launch."""
    return tuple([t.data_ptr() % 16 == 0 for t in tensors if isinstance(t, torch.Tensor)])


def _pointer_arguments(launch: _Launch, tensors):
    """The tensors' addresses where every argument is a tensor and the call matches the alignment the kernel was
    compiled for, else None.  Triton's launcher takes an address as it is, where a tensor costs it a ``data_ptr``
    call and a driver query per argument (the plan already checked device and layout)."""
    if not launch.pointers_only:
        return None
    pointers = [t.data_ptr() for t in tensors]
    if launch.all_aligned:
        combined = 0
        for pointer in pointers:
            combined |= pointer
        return pointers if combined % 16 == 0 else None
    return pointers if tuple([p % 16 == 0 for p in pointers]) == launch.aligned else None


def _compiled_launch(launch: _Launch, tensors) -> bool:
    """Launches ``launch.compiled`` directly; False when the call must take Triton's normal launch."""
    compiled = launch.compiled
    if compiled is None:
        return False
    # launch hooks (profilers) get what Triton's own launch would give them, the tensors included; an empty hook
    # chain (what Triton installs by default) is passed as None, which skips building the launch metadata
    enter, leave = _hook(triton.knobs.runtime.launch_enter_hook), _hook(triton.knobs.runtime.launch_exit_hook)
    pointers = _pointer_arguments(launch, tensors) if enter is None else None
    if pointers is None:
        if _alignment(tensors) != launch.aligned:
            return False
        pointers = tensors
    device = _current_device()
    if device != launch.device:  # the compiled module is loaded on the device it was launched on
        return False
    stream = triton.runtime.driver.active.get_current_stream(device)
    args = (*pointers, *launch.scalars, *launch.constexprs)
    metadata = compiled.launch_metadata(launch.grid, stream, *args) if enter is not None else None
    compiled.run(launch.grid[0], launch.grid[1], 1, stream, compiled.function, compiled.packed_metadata, metadata,
                 enter, leave, *args)
    return True


# torch's direct query of the current CUDA device, where this torch has it (looked up once: every launch asks)
_CUDA_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _current_device() -> int:
    """The current CUDA device; a compiled launch exists only once CUDA is up, so torch's lazy-init check (host
    time on every launch) is skipped where this torch has the direct query."""
    return _CUDA_GET_DEVICE() if _CUDA_GET_DEVICE is not None else torch.cuda.current_device()


def _hook(hook):
    """A launch hook, or None where it would call nothing (an empty ``HookChain``)."""
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


def _remember_compiled(launch: _Launch, compiled, tensors) -> None:
    """Keeps a launch's compiled kernel when this Triton exposes the launcher it uses."""
    needed = ("run", "function", "packed_metadata")
    if compiled is None or not all(hasattr(compiled, name) for name in needed):
        return  # interpreter, or a Triton whose compiled kernels look different: keep the normal launch
    launch.constexprs = tuple(launch.meta[name] for name in launch.kernel.arg_names if name in launch.meta)
    launch.aligned = _alignment(tensors)
    launch.pointers_only = all(isinstance(t, torch.Tensor) for t in tensors)
    launch.all_aligned = all(launch.aligned)
    launch.device = triton.runtime.driver.active.get_current_device()
    launch.compiled = compiled


# A kernel's launches for one problem: one per batch range whose B*H fits the grid (``batch_chunks``), each
# ``(launch, first batch element, end)``.
Chunks = tuple[tuple[_Launch, int, int], ...]


def _chunked(kernel, programs: int, heads: int, batch: int, scalars: tuple, meta: dict) -> Chunks:
    return tuple((_Launch(kernel, (programs, (hi - lo) * heads), scalars, meta), lo, hi)
                 for lo, hi in batch_chunks(batch, heads))


def _run_chunks(chunks: Chunks, tensors) -> None:
    """Runs a kernel's launches; a chunk sees the tensors of rank above 2 (the ``[B, ...]`` ones) sliced to its batch
    range, and the tables (rpb ``[H, R]``, an atomic accumulator) whole."""
    if len(chunks) == 1:
        chunks[0][0](tensors)
        return
    for launch, lo, hi in chunks:
        launch(tuple(t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 2 else t for t in tensors))


# Plans, per problem and input layout (the keys below): every launch parameter of a call, decided once by
# ``plan_forward`` / ``plan_backward``; ``forward`` and ``backward`` only allocate the outputs and run the launches.
# Eager models call the same few problems over and over, and at small maps (NAT's 14x14 stage) the kernels run for
# less time than deciding their arguments takes.
_FORWARD: dict[tuple, "ForwardPlan"] = {}
_BACKWARD: dict[tuple, "BackwardPlan"] = {}
MAX_PLANS = 1024


def remember_plan(plans: dict, key: tuple, plan):
    """Keeps ``plan`` under ``key`` while ``plans`` holds fewer than ``MAX_PLANS`` (also ``ops.layer_norm``'s)."""
    if len(plans) < MAX_PLANS:
        plans[key] = plan
    return plan


def _rpb_layout(rpb):
    return None if rpb is None else (rpb.dtype, rpb.stride())


# --- forward --------------------------------------------------------------------------------------------------------

@dataclass
class ForwardPlan:
    """Every launch parameter of a forward problem and input layout (``plan_forward``)."""

    launches: Chunks
    tokens: int  # N: the kernels see the inputs as [B, N, H, D]
    out_shape: tuple  # [B, *spatial, Hq, Dv]
    lse_shape: tuple | None  # [B, *spatial, Hq], or None where the kernel skips the store (``need_lse`` False)
    as_tokens: bool  # the inputs need ``_tokens`` copies (strided spatial axes, bfloat16 under the interpreter)
    rpb_direct: bool  # the rpb tensor is the kernels' table as it is (float32, contiguous, one launch)
    host_desc_layouts: tuple | None = None  # (K/V layouts,) of host-built descriptors, rebuilt per call
    bias_tiles: tuple | None = None  # (launch, elements, dtype) of the per-box RPB tiles (``na_bias_tiles_kernel``)
    hopper: hopper.HopperForward | None = None  # the problem runs on the Hopper kernel instead (``ops/fused/hopper.py``)

    @property
    def launch(self) -> _Launch:
        """The first batch range's launch (the only one unless B * H passes the grid)."""
        return self.launches[0][0]


def _forward_key(q, k, v, rpb, params, scale, need_lse, host_descriptors):
    # k / v alignment decides whether their tiles can be bulk copies (tma_eligible)
    return (params, q.shape, q.stride(), k.shape, k.stride(), v.stride(), v.shape[-1], q.dtype, q.device,
            _rpb_layout(rpb), scale, k.data_ptr() % 16, v.data_ptr() % 16, need_lse, BIAS_TILES, autotune.state(),
            autotune.dot_precision(q.dtype), host_descriptors, hopper.ENABLED)


def forward(q, k, v, rpb, params: NAParams, scale: float, need_lse: bool = True, host_descriptors: bool = True):
    """Returns ``out [B, *spatial, Hq, Dv]`` (input dtype) and ``lse [B, *spatial, Hq]`` (float32), or None for
    lse where ``need_lse`` is False (the kernel then skips its store).  ``host_descriptors``: False keeps the
    launches from building TMA descriptors on the host, where the host bounds the step: they save GPU time but cost
    host time on every launch (the taped NAT block's training path, ``namodels.models.tape``; docs/performance.md)."""
    key = _forward_key(q, k, v, rpb, params, scale, need_lse, host_descriptors)
    plan = _FORWARD.get(key)
    if plan is None:
        plan = remember_plan(_FORWARD, key, plan_forward(q, k, v, rpb, params, scale, need_lse, host_descriptors))
    out = _empty(plan.out_shape, q.dtype, q.device)
    lse = _empty(plan.lse_shape, torch.float32, q.device) if plan.lse_shape is not None else None
    if plan.hopper is not None:  # its kernel takes [B, N, H, D] views whatever ``as_tokens`` says
        b, hq = out.shape[0], out.shape[-2]
        hopper.run(plan.hopper, _tokens(q, plan.tokens), _tokens(k, plan.tokens), _tokens(v, plan.tokens),
                   out.view(b, plan.tokens, hq, -1), None if lse is None else lse.view(b, plan.tokens, hq))
        return out, lse
    table = None if rpb is None else rpb if plan.rpb_direct else _rpb_table(rpb, q.shape[-2])
    if plan.as_tokens:
        q, k, v = _tokens(q, plan.tokens), _tokens(k, plan.tokens), _tokens(v, plan.tokens)
    bias = q if table is None else table  # (a stand-in without RPB: the kernel does not read it)
    tiles = _bias_tiles(plan.bias_tiles, table, q)
    _run_chunks(plan.launches, (q, k, v, bias, out, out if lse is None else lse,
                                *descriptor_args(q, plan.host_desc_layouts, (k, v)), tiles))
    return out, lse


def _bias_tiles(spec, table, stand_in, zeroed=None):
    """The per-box RPB tiles of this call's rpb (``spec``: the plan's ``bias_tiles``), or ``stand_in`` without.
    ``zeroed``: the float32 buffer of the same layout that a generator with ``ZERO_TILES`` zeroes (dQ's dS tiles)."""
    if spec is None:
        return stand_in
    launch, numel, dtype = spec
    tiles = _empty((numel,), dtype, stand_in.device)
    if "ZERO_TILES" in launch.meta:  # na_bias_tiles_kernel (the inverse generator has no buffer to zero)
        launch((table, tiles, tiles if zeroed is None else zeroed))
    else:
        launch((table, tiles))
    return tiles


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


def _boxes_and_tile(params: NAParams, config: autotune.ResolvedConfig, inverse: bool = False) -> tuple[int, int]:
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
    launch = _Launch(kernel, (programs, heads), (heads, 1.0 / (scale * kernels.LOG2E), *window, boxes),
                     tmeta | extra | dict(num_warps=4, num_stages=1))
    return launch, heads * programs * boxes * tile, dtype


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
# kernel run: ``plan_forward`` / ``plan_backward`` build their launches from them, and ``ops.fused.explain`` reports
# them, so the two cannot disagree.

@dataclass(frozen=True)
class ForwardChoices:
    """A forward's decisions that hold for every tile config (``forward_choices``)."""

    hopper_why: str | None  # why the portable kernel runs; None: the Hopper kernel does
    tma_ok: bool  # K/V tiles may be TMA copies (``tma_eligible``)
    host_desc: bool  # ... through descriptors built on the host (``host_descriptors_ok``)
    idx64: bool  # ``IDX64`` (``needs_int64``)
    precision: str  # ``PREC`` (``autotune.dot_precision``)
    bias_tiles: bool  # RPB through bias tiles wherever a launch's table fits (``BIAS_TILES``, positive scale)


def forward_choices(q4, k4, v4, rpb, params: NAParams, scale: float, dtype: torch.dtype,
                    host_descriptors: bool) -> ForwardChoices:
    """``q4`` / ``k4`` / ``v4``: the kernels' ``[B, N, H, D]`` views (``_tokens``); ``dtype``: the inputs' dtype."""
    b, hq = q4.shape[0], q4.shape[-2]
    tma_ok = tma_eligible(k4, v4)
    out4 = torch.empty((b, params.num_tokens, hq, v4.shape[-1]), device="meta")
    return ForwardChoices(
        hopper_why=hopper.unsupported(q4, k4, v4, rpb, params, scale) if host_descriptors else NO_HOST_DESCRIPTORS,
        tma_ok=tma_ok, host_desc=host_descriptors and tma_ok and host_descriptors_ok(params, k4, v4, b, hq),
        idx64=needs_int64(q4, k4, v4, out4), precision=autotune.dot_precision(dtype),
        bias_tiles=BIAS_TILES and rpb is not None and scale > 0)


def forward_flags(choices: ForwardChoices, params: NAParams, config: autotune.ResolvedConfig, scale: float,
                  has_rpb: bool, heads: int, need_lse: bool) -> dict:
    """The forward kernel's decided constexprs for a resolved config (the others: ``_constexprs``)."""
    _, programs = _window_args(params, config.outer_tile)
    flags = {"BIAS_TILES": choices.bias_tiles and bias_tiles_fit(heads, programs, *_boxes_and_tile(params, config))}
    # the row max is taken before scaling, which needs a positive scale
    flags["FOLD_SCALE"] = scale > 0 and (not has_rpb or flags["BIAS_TILES"])
    flags["MASK_IN_DOT"] = flags["BIAS_TILES"] or (flags["FOLD_SCALE"] and mask_in_dot(params, config, scale))
    flags["TMA"] = config.tma and choices.tma_ok
    flags["HOST_DESC"] = flags["TMA"] and choices.host_desc
    flags["STORE_LSE"] = need_lse
    return flags


def plan_forward(q, k, v, rpb, params: NAParams, scale: float, need_lse: bool,
                 host_descriptors: bool = True) -> ForwardPlan:
    """The forward's launches for these inputs' problem and layout: tiles (defaults, cache or tuner), TMA and
    host descriptors, masking mode, index width, batch chunks."""
    b, n, hq, hkv = q.shape[0], params.num_tokens, q.shape[-2], k.shape[-2]
    d, dv = q.shape[-1], v.shape[-1]
    spatial = tuple(q.shape[1:-2])
    q4, k4, v4 = _tokens(q, n), _tokens(k, n), _tokens(v, n)
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
                           hopper=on_hopper)

    @functools.cache  # the tuner runs each candidate many times
    def decide(config: autotune.ResolvedConfig):
        window, programs = _window_args(params, config.outer_tile)
        meta = _constexprs(params, config, config.outer_tile, config.inner_tile, d, dv, has_rpb, choices.idx64,
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
        return (_rpb_table(rpb, hq) if has_rpb else q4, torch.empty((b, n, hq, dv), dtype=q.dtype, device=q.device),
                torch.empty((b, n, hq), dtype=torch.float32, device=q.device))

    def run_candidate(config: autotune.ResolvedConfig):
        launches, layouts, tiles = decide(config)
        table, out, lse = tuning_outputs()
        _run_chunks(launches, (q4, k4, v4, table, out, lse, *descriptor_args(q4, layouts, (k4, v4)),
                               _bias_tiles(tiles, table, q4)))

    config = autotune.pick("fwd", q, k, v, params, has_rpb, run_candidate, tma=choices.tma_ok,
                           host_descriptors=choices.host_desc)
    launches, layouts, tiles = decide(config)
    direct = _same_memory(((q4, q), (k4, k), (v4, v)))
    return ForwardPlan(launches, n, (b, *spatial, hq, dv), (b, *spatial, hq) if need_lse else None,
                       as_tokens=not direct, rpb_direct=_rpb_direct(rpb) and len(launches) == 1,
                       host_desc_layouts=layouts, bias_tiles=tiles)


# --- backward -------------------------------------------------------------------------------------------------------

@dataclass
class BackwardPlan:
    """Every launch parameter of a backward problem and input layout (``plan_backward``): dQ (which also writes
    delta), dK/dV and the dRPB path (dQ's dS summed by ``na_drpb_tiles_kernel`` or ``na_drpb_window_kernel``, or the
    offset pass)."""

    dq_launches: Chunks
    dkdv_launches: Chunks
    shapes: tuple  # (B, N, Hq, Hkv, D, Dv)
    params: NAParams
    as_tokens: bool  # the inputs need ``_tokens`` copies (see ``ForwardPlan``), lse / d_lse float32 copies
    rpb_direct: bool
    ds_window: tuple | None = None  # shape of dQ's window-layout dS (``rpb_grad``) where it gives dRPB
    ds_atomic: bool = False  # that buffer is summed over the batch by the dQ kernel's atomics (``window_ds_atomic``)
    reduce: _Launch | None = None  # na_drpb_window_kernel over that buffer
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

    @property
    def dq(self) -> _Launch:
        return self.dq_launches[0][0]

    @property
    def dkdv(self) -> _Launch:
        return self.dkdv_launches[0][0]


def _backward_key(q, k, v, rpb, out, lse, d_out, d_lse, params, scale, deterministic, want_drpb, grads,
                  host_descriptors):
    d_lse_layout = None if d_lse is None else (d_lse.dtype, d_lse.stride())
    alignment = tuple(t.data_ptr() % 16 for t in (q, k, v, d_out))  # decides TMA eligibility
    grads_layout = None if grads is None else tuple(g.stride() for g in grads)
    return (params, q.shape, q.stride(), k.shape, k.stride(), v.stride(), v.shape[-1], out.stride(), d_out.stride(),
            d_out.dtype, lse.dtype, lse.stride(), d_lse_layout, q.dtype, q.device, _rpb_layout(rpb), scale,
            deterministic, want_drpb, alignment, grads_layout, BIAS_TILES, autotune.state(),
            autotune.dot_precision(q.dtype), host_descriptors, hopper.ENABLED)


def backward(q, k, v, rpb, out, lse, d_out, d_lse, params: NAParams, scale: float, deterministic: bool,
             want_drpb: bool = True, grads=None, host_descriptors: bool = True):
    """Gradients ``(dq, dk, dv, drpb)`` of ``(out, lse)``; ``drpb`` is ``None`` without RPB or when
    ``want_drpb`` is False (the bias still enters the recomputed scores).  ``grads``: ``(dq, dk, dv)`` to write
    into (e.g. views of one packed ``[B, *spatial, 3, H, D]`` gradient, as ``unbind`` gives them), each shaped like
    its input with flat-token views; else they are allocated.  ``host_descriptors``: False keeps the launches from
    building TMA descriptors on the host (see ``forward``)."""
    key = _backward_key(q, k, v, rpb, out, lse, d_out, d_lse, params, scale, deterministic, want_drpb, grads,
                        host_descriptors)
    plan = _BACKWARD.get(key)
    if plan is None:
        plan = remember_plan(_BACKWARD, key, plan_backward(q, k, v, rpb, out, lse, d_out, d_lse, params, scale,
                                                           deterministic, want_drpb, grads, host_descriptors))
    b, n, hq, hkv, d, dv = plan.shapes
    dev = q.device
    if grads is None:
        dq = _empty(q.shape, q.dtype, dev)
        dk = _empty(k.shape, k.dtype, dev)
        dvv = _empty((*k.shape[:-1], dv), v.dtype, dev)
    else:
        dq, dk, dvv = grads
    table = None if rpb is None else rpb if plan.rpb_direct else _rpb_table(rpb, hq)
    if plan.as_tokens:
        q, k, v, out, d_out = (_tokens(t, n) for t in (q, k, v, out, d_out))
        lse = lse.reshape(b, n, hq).float().contiguous()
        d_lse = None if d_lse is None else d_lse.reshape(b, n, hq).float().contiguous()
    if table is None:
        table = q  # a stand-in: without RPB the kernels do not read it
    delta = _empty((b, n, hq), torch.float32, dev)  # written by dQ, read by dK/dV
    ds = None if plan.ds_window is None else _window_ds_buffer(plan.ds_window, plan.ds_atomic, dev)
    if plan.ds_tiles:  # zeroed by dQ's tile generator, at the boxes dQ adds to
        ds = _empty((plan.ds_tiles,), torch.float32, dev)
    if plan.hopper_dq is not None:  # (pointers and the plan's strides: the tensors' shapes do not matter)
        hopper_dq.run(plan.hopper_dq, q, k, v, d_out, out, lse, d_lse, delta, dq)
    else:
        _run_chunks(plan.dq_launches, (q, k, v, table, d_out, lse, delta, dq,
                                       *descriptor_args(q, plan.dq_layouts, (k, v)), q if ds is None else ds,
                                       _bias_tiles(plan.dq_bias_tiles, table, q, ds if plan.ds_tiles else None), out,
                                       delta if d_lse is None else d_lse))
    if plan.hopper_dkdv is not None:
        hopper_dkdv.run(plan.hopper_dkdv, q, k, v, d_out, lse, delta, dk, dvv)
    else:
        _run_chunks(plan.dkdv_launches, (q, k, v, table, d_out, lse, delta, dk, dvv,
                                         *descriptor_args(q, plan.dkdv_layouts, (k, v), (q, d_out)),
                                         _bias_tiles(plan.dkdv_bias_tiles, table, q)))
    total = None
    if plan.ds_tiles:
        total = rpb_grad.reduce_tile_ds(ds, plan.tile_index, hq, plan.reduce)
    elif plan.reduce is not None:
        total = rpb_grad.reduce_window_ds(ds.view(plan.ds_window), plan.params, plan.reduce)
    elif plan.drpb_launches is not None:
        partial = torch.zeros(plan.drpb_buffer, dtype=torch.float32, device=dev)
        _run_chunks(plan.drpb_launches, (q, k, v, table, d_out, lse, delta, partial))
        total = _drpb_total(partial, plan.drpb_atomic)
    return dq, dk, dvv, _as_rpb_grad(total, rpb)


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
        dq_hopper_why=(hopper_dq.unsupported(q4, k4, v4, do4, o4, rpb, params, scale) if host_descriptors
                       else NO_HOST_DESCRIPTORS),
        dkdv_hopper_why=(hopper_dkdv.unsupported(q4, k4, v4, do4, rpb, params, scale) if host_descriptors
                         else NO_HOST_DESCRIPTORS),
        dq_tma_ok=dq_tma_ok, dkdv_tma_ok=dkdv_tma_ok, dq_host=kv_host and dq_tma_ok,
        dkdv_host=kv_host and dkdv_tma_ok and host_descriptors_ok(params, q4, do4, b, hq),
        idx64=needs_int64(q4, k4, v4, do4, o4, *grads4, *ds_meta), precision=autotune.dot_precision(dtype),
        bias_tiles=bias_tiles, ds_atomic=ds_atomic,
        ds_tiles=bias_tiles and want_drpb and ds_atomic,  # where the chosen dQ launch's tiles fit (``dq_flags``)
        ds_shape=ds_shape)


def dq_flags(choices: BackwardChoices, params: NAParams, config: autotune.ResolvedConfig, scale: float, heads: int,
             has_dlse: bool) -> dict:
    """The dQ kernel's decided constexprs for a resolved config (the others: ``_constexprs``)."""
    _, programs = _window_args(params, config.outer_tile)
    flags = {"TMA": config.tma and choices.dq_tma_ok}
    flags["HOST_DESC"] = flags["TMA"] and choices.dq_host
    flags["BIAS_TILES"] = choices.bias_tiles and bias_tiles_fit(heads, programs, *_boxes_and_tile(params, config))
    flags["DS_BOXES"] = choices.ds_tiles and flags["BIAS_TILES"]
    flags["STORE_DS"] = choices.ds_shape is not None and not flags["DS_BOXES"]
    flags["DS_ATOMIC"] = choices.ds_atomic
    flags["MASK_IN_DOT"] = flags["BIAS_TILES"] or mask_in_dot(params, config, scale)
    flags["HAS_DLSE"] = has_dlse
    return flags


def dkdv_flags(choices: BackwardChoices, params: NAParams, config: autotune.ResolvedConfig, scale: float,
               heads: int) -> dict:
    """The dK/dV kernel's decided constexprs for a resolved config (outer tile: keys; the others: ``_constexprs``)."""
    _, programs = _window_args(params, config.outer_tile)
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


def plan_backward(q, k, v, rpb, out, lse, d_out, d_lse, params: NAParams, scale: float, deterministic: bool,
                  want_drpb: bool, grads=None, host_descriptors: bool = True) -> BackwardPlan:
    """The backward's launches for these inputs' problem and layout (see ``plan_forward``), and its dRPB path."""
    b, n, hq, hkv = q.shape[0], params.num_tokens, q.shape[-2], k.shape[-2]
    d, dv = q.shape[-1], v.shape[-1]
    q4, k4, v4 = _tokens(q, n), _tokens(k, n), _tokens(v, n)
    o4, do4 = _tokens(out, n), _tokens(d_out, n)
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
        window, programs = _window_args(params, config.outer_tile)
        meta = _constexprs(params, config, config.outer_tile, config.inner_tile, d, dv, has_rpb, choices.idx64,
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
        window, programs = _window_args(params, config.outer_tile)
        meta = _constexprs(params, config, config.inner_tile, config.outer_tile, d, dv, has_rpb, choices.idx64,
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
        return dict(delta=delta, table=_rpb_table(rpb, hq) if has_rpb else q4,
                    # the caller's gradient outputs where given (their strides are in the launches' scalars)
                    dq=grads[0] if given else torch.empty((b, n, hq, d), dtype=q.dtype, device=q.device),
                    dk=grads[1] if given else torch.empty((b, n, hkv, d), dtype=k.dtype, device=q.device),
                    dv=grads[2] if given else torch.empty((b, n, hkv, dv), dtype=v.dtype, device=q.device),
                    ds=None if ds_shape is None else _window_ds_buffer(ds_shape, ds_atomic, q.device))

    def run_dq(config):
        launches, layouts, tiles, _ = decide_dq(config)
        s = tuning_inputs()
        ds = s["ds"]
        ds_boxes = launches[0][0].meta["DS_BOXES"]
        if ds_boxes:  # the tile-layout buffer's size follows the candidate's tiles; its tile generator zeroes it
            ds = torch.empty(tiles[1], dtype=torch.float32, device=q.device)
        elif ds_atomic and ds is not None:  # each candidate run adds from zero
            ds.zero_()
        _run_chunks(launches, (q4, k4, v4, s["table"], do4, lse3, s["delta"], s["dq"],
                               *descriptor_args(q4, layouts, (k4, v4)), q4 if ds is None else ds,
                               _bias_tiles(tiles, s["table"], q4, ds if ds_boxes else None), o4,
                               s["delta"] if dlse is None else dlse))

    def run_dkdv(config):
        launches, layouts, tiles = decide_dkdv(config)
        s = tuning_inputs()
        _run_chunks(launches, (q4, k4, v4, s["table"], do4, lse3, s["delta"], s["dk"], s["dv"],
                               *descriptor_args(q4, layouts, (k4, v4), (q4, do4)), _bias_tiles(tiles, s["table"], q4)))

    dq_on_hopper = (hopper_dq.build_launches(q4, k4, v4, do4, o4, params, scale, grads[0])
                    if _takes_hopper("dQ", choices.dq_hopper_why) else None)
    dq_config = autotune.pick("dq", q, k, v, params, has_rpb, run_dq, tunable=dq_on_hopper is None,
                              tma=choices.dq_tma_ok, host_descriptors=choices.dq_host)
    dq_launches, dq_layouts, dq_tiles, dq_offsets = decide_dq(dq_config)
    on_hopper = (hopper_dkdv.build_launches(q4, k4, v4, do4, params, scale, grads[1:])
                 if _takes_hopper("dK/dV", choices.dkdv_hopper_why) else None)
    config = autotune.pick("dkdv", q, k, v, params, has_rpb, run_dkdv, tunable=on_hopper is None,
                           tma=choices.dkdv_tma_ok, host_descriptors=choices.dkdv_host)
    dkdv_launches, dkdv_layouts, dkdv_tiles = decide_dkdv(config)
    pairs = ((q4, q), (k4, k), (v4, v), (o4, out), (do4, d_out), (lse3, lse))
    if d_lse is not None:
        pairs += ((dlse, d_lse),)
    dq_meta = dq_launches[0][0].meta
    mode = drpb_mode(dq_meta, has_rpb, want_drpb)
    plan = BackwardPlan(dq_launches, dkdv_launches, (b, n, hq, hkv, d, dv), params,
                        as_tokens=not _same_memory(pairs),
                        rpb_direct=_rpb_direct(rpb) and len(dq_launches) == 1 == len(dkdv_launches),
                        ds_window=ds_shape if dq_meta["STORE_DS"] else None, ds_atomic=ds_atomic,
                        dq_layouts=dq_layouts, dkdv_layouts=dkdv_layouts, dq_bias_tiles=dq_tiles,
                        dkdv_bias_tiles=dkdv_tiles, hopper_dq=dq_on_hopper, hopper_dkdv=on_hopper)
    if mode == "tile-layout dS":
        n_rel = math.prod(rpb.shape[1:])
        plan.ds_tiles = dq_tiles[1]
        plan.tile_index = rpb_grad.tile_index((params, dq_config.outer_tile, dq_config.inner_tile), dq_offsets[0],
                                              dq_offsets[1], n_rel, q.device)
        plan.reduce = _Launch(kernels.na_drpb_tiles_kernel, (n_rel, hq),
                              (dq_tiles[1] // hq, plan.tile_index.shape[1], n_rel),
                              dict(BLOCK=rpb_grad.TILE_REDUCE_BLOCK, num_warps=4))
    elif mode == "window-layout dS":
        grid, scalars = rpb_grad.reduce_arguments(params, hq, rpb_grad.slot_tables(params, q.device)[1])
        plan.reduce = _Launch(kernels.na_drpb_window_kernel, grid, scalars,
                              dict(BLOCK_N=rpb_grad.REDUCE_BLOCK, num_warps=4))
    elif mode == "offset pass":
        plan.drpb_launches, plan.drpb_buffer, plan.drpb_atomic = _drpb_launch(q4, k4, v4, rpb, common, params,
                                                                               scale, deterministic, q, k, v,
                                                                               choices.idx64)
        plan.rpb_direct = False  # the offset pass reads the [H, R] table: the chunks keep it whole
    return plan


def window_ds_atomic(deterministic: bool) -> bool:
    """Whether dQ sums its window-layout dS over the batch with float32 atomics (one [N, H, slots] buffer, summation
    order free) rather than storing one buffer per batch element for the host to sum (bitwise reproducible, B times
    the memory traffic; taken under ``deterministic``)."""
    return not deterministic


def _window_ds_buffer(shape, atomic: bool, device):
    """dQ's window-layout dS buffer.  The atomic one starts at zero and is flat, so that batch chunks
    (``_run_chunks``) pass it whole; the stored one is ``[B, N, H, slots]``, sliced by batch like the gradients,
    and written in full (non-causal windows are full): an allocation the tests poison like the outputs."""
    if atomic:
        return torch.zeros(math.prod(shape), dtype=torch.float32, device=device)
    return _empty(shape, torch.float32, device)


def _window_ds_strides(shape, atomic: bool) -> tuple:
    """(batch, token, head) strides of the window-layout buffer ``[B, N, H, slots]``; every batch element adds into
    the same memory when it is atomic."""
    if shape is None:
        return 0, 0, 0
    _, n, h, slots = shape
    return (0 if atomic else n * h * slots), h * slots, slots


def _drpb_launch(q4, k4, v4, rpb, common, params, scale, deterministic, q, k, v, idx64):
    """The offset pass's dRPB launches (one grid row per batch element and head), the shape of its zeroed
    accumulator, and whether it adds with atomics."""
    b, hq, hkv = q4.shape[0], q4.shape[2], k4.shape[2]
    d, dv = q4.shape[-1], v4.shape[-1]
    n_rel = math.prod(rpb.shape[1:])
    config = autotune.pick("drpb", q, k, v, params, True, None, tunable=False)
    window, programs = _window_args(params, config.outer_tile)
    _, _, _, _, C = _axes3(params)
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
    return _chunked(kernels.na_bwd_drpb_kernel, programs, hq, b, scalars, meta), buffer, atomic


def _drpb_total(partial, atomic: bool):
    """dRPB [Hq, R]: the atomic accumulator as it is, or the per-program rows summed (deterministic)."""
    return partial if atomic else partial.sum(dim=(0, 2))


def _as_rpb_grad(total, rpb):
    """The float32 dRPB sum of either path in the shape and dtype of ``rpb``; None where none was computed."""
    return None if total is None else total.reshape(rpb.shape).to(rpb.dtype)
