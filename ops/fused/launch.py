"""The launcher of the fused kernels: runs the plan ``decide`` made for a call.

``forward`` / ``backward`` look the call's plan up (``decide.forward_plan`` / ``backward_plan``: one lookup once the
problem and layout were seen), allocate the outputs and run the plan's launches; no launch parameter is chosen here.
The rest is the launch machinery: flat-token views, host-built TMA descriptors for each call's tensors, the
per-stream scratch of device-built ones, and ``_Launch``, which calls a compiled kernel directly once Triton compiled
it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import carveout, hopper, hopper_dkdv, hopper_dq, kernels, rpb_grad
from ..window import NAParams


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



def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _rpb_table(rpb, heads):
    return rpb.detach().reshape(heads, -1).float().contiguous() if rpb is not None else None



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



def _run_chunks(chunks: "decide.Chunks", tensors) -> None:
    """Runs a kernel's launches; a chunk sees the tensors of rank above 2 (the ``[B, ...]`` ones) sliced to its batch
    range, and the tables (rpb ``[H, R]``, an atomic accumulator) whole."""
    if len(chunks) == 1:
        chunks[0][0](tensors)
        return
    for launch, lo, hi in chunks:
        launch(tuple(t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 2 else t for t in tensors))


# ``ops.layer_norm`` keeps its launches per LayerNorm problem in dicts of at most this many entries
MAX_PLANS = 1024


def remember_plan(plans: dict, key: tuple, plan, limit: int = MAX_PLANS):
    """Keeps ``plan`` under ``key`` while ``plans`` holds fewer than ``limit`` entries (a process that makes endless
    layouts keeps deciding rather than growing); returns ``plan``."""
    if len(plans) < limit:
        plans[key] = plan
    return plan


def forward(q, k, v, rpb, params: NAParams, scale: float, need_lse: bool = True, host_descriptors: bool = True):
    """Returns ``out [B, *spatial, Hq, Dv]`` (input dtype) and ``lse [B, *spatial, Hq]`` (float32), or None for
    lse where ``need_lse`` is False (the kernel then skips its store).  ``host_descriptors``: False keeps the
    launches from building TMA descriptors on the host, where the host bounds the step: they save GPU time but cost
    host time on every launch (the taped NAT block's training path, ``namodels.models.tape``; docs/performance.md)."""
    plan = decide.forward_plan(q, k, v, rpb, params, scale, need_lse, host_descriptors)
    out = _empty(plan.out_shape, q.dtype, q.device)
    lse = _empty(plan.lse_shape, torch.float32, q.device) if plan.lse_shape is not None else None
    if plan.hopper is not None:  # its kernel takes [B, N, H, D] views whatever ``as_tokens`` says
        b, hq = out.shape[0], out.shape[-2]
        _run_hopper_forward(plan.hopper, _tokens(q, plan.tokens), _tokens(k, plan.tokens), _tokens(v, plan.tokens),
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



def backward(q, k, v, rpb, out, lse, d_out, d_lse, params: NAParams, scale: float, deterministic: bool,
             want_drpb: bool = True, grads=None, host_descriptors: bool = True):
    """Gradients ``(dq, dk, dv, drpb)`` of ``(out, lse)``; ``drpb`` is ``None`` without RPB or when
    ``want_drpb`` is False (the bias still enters the recomputed scores).  ``grads``: ``(dq, dk, dv)`` to write
    into (e.g. views of one packed ``[B, *spatial, 3, H, D]`` gradient, as ``unbind`` gives them), each shaped like
    its input with flat-token views; else they are allocated.  ``host_descriptors``: False keeps the launches from
    building TMA descriptors on the host (see ``forward``)."""
    plan = decide.backward_plan(q, k, v, rpb, out, lse, d_out, d_lse, params, scale, deterministic, want_drpb,
                                grads, host_descriptors)
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
        _run_hopper_dq(plan.hopper_dq, q, k, v, d_out, out, lse, d_lse, delta, dq)
    else:
        _run_chunks(plan.dq_launches, (q, k, v, table, d_out, lse, delta, dq,
                                       *descriptor_args(q, plan.dq_layouts, (k, v)), q if ds is None else ds,
                                       _bias_tiles(plan.dq_bias_tiles, table, q, ds if plan.ds_tiles else None), out,
                                       delta if d_lse is None else d_lse))
    if plan.hopper_dkdv is not None:
        _run_hopper_dkdv(plan.hopper_dkdv, q, k, v, d_out, lse, delta, dk, dvv)
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



def _window_ds_buffer(shape, atomic: bool, device):
    """dQ's window-layout dS buffer.  The atomic one starts at zero and is flat, so that batch chunks
    (``_run_chunks``) pass it whole; the stored one is ``[B, N, H, slots]``, sliced by batch like the gradients,
    and written in full (non-causal windows are full): an allocation the tests poison like the outputs."""
    if atomic:
        return torch.zeros(math.prod(shape), dtype=torch.float32, device=device)
    return _empty(shape, torch.float32, device)



def _drpb_total(partial, atomic: bool):
    """dRPB [Hq, R]: the atomic accumulator as it is, or the per-program rows summed (deterministic)."""
    return partial if atomic else partial.sum(dim=(0, 2))


def _as_rpb_grad(total, rpb):
    """The float32 dRPB sum of either path in the shape and dtype of ``rpb``; None where none was computed."""
    return None if total is None else total.reshape(rpb.shape).to(rpb.dtype)


# --- the Hopper kernels' records ------------------------------------------------------------------------------------
# A Hopper record (``hopper.HopperForward``, ``hopper_dq.HopperDq``, ``hopper_dkdv.HopperDkDv``) holds the arguments of
# two launches, the main kernel's and its non-finite fixup's; the main kernel reads its tiles through Gluon descriptors,
# which are built here per call from the record's layouts, as the portable launches' host-built descriptors are.

def _run_hopper_forward(fw: hopper.HopperForward, q4, k4, v4, out4, lse) -> None:
    """``out4`` (``[B, N, H, D]``) and ``lse`` (``[B, N, H]`` float32, or None) for the problem of ``fw``."""
    q_desc = hopper._descriptor(q4, *fw.q_layout)
    k_desc = hopper._descriptor(k4, *fw.kv_layouts[0])
    v_desc = hopper._descriptor(v4, *fw.kv_layouts[1])
    if not out4.is_contiguous():
        raise ValueError("out4: the Hopper forward writes a contiguous [B, N, H, D] output")
    o_desc = hopper._descriptor(out4, *fw.o_layout)
    flags = torch.empty(fw.programs * hopper.ROWS, dtype=torch.int8, device=q4.device)
    lse_arg = out4 if lse is None else lse
    hopper.na_fwd_hopper_kernel[fw.main_grid(q4.device)](q_desc, k_desc, v_desc, o_desc, lse_arg, flags, fw.starts,
                                                         fw.spans, fw.order, fw.row_offsets, *fw.scalars, **fw.meta)
    hopper.na_fwd_nonfinite_kernel[fw.grid](q4, k4, v4, out4, lse_arg, flags, *fw.fixup_scalars, **fw.fixup_meta)


def _run_hopper_dq(bw: hopper_dq.HopperDq, q4, k4, v4, do4, o4, lse, dlse, delta, dq) -> None:
    """``dq`` (``[B, N, Hq, D]``) and ``delta`` (``[B, N, Hq]`` float32, read by dK/dV next) from ``lse`` and, where
    given, ``dlse`` (both ``[B, N, Hq]`` float32) for the problem of ``bw``."""
    q_desc = hopper._descriptor(q4, *bw.q_layouts[0])
    do_desc = hopper._descriptor(do4, *bw.q_layouts[1])
    k_desc = hopper._descriptor(k4, *bw.kv_layouts[0])
    v_desc = hopper._descriptor(v4, *bw.kv_layouts[1])
    flags = torch.empty(bw.programs * hopper.ROWS, dtype=torch.int8, device=q4.device)
    scalars = (*bw.scalars[:-1], int(dlse is not None), bw.scalars[-1])
    hopper_dq.na_bwd_dq_hopper_kernel[bw.grid](q_desc, do_desc, k_desc, v_desc, o4, delta if dlse is None else dlse,
                                               lse, delta, dq, flags, bw.starts, bw.spans, bw.order, bw.row_offsets,
                                               *scalars, **bw.meta)
    hopper_dq.na_bwd_dq_nonfinite_kernel[bw.grid](q4, k4, v4, do4, lse, delta, dq, flags, *bw.fixup_scalars,
                                                  **bw.fixup_meta)


def _run_hopper_dkdv(bw: hopper_dkdv.HopperDkDv, q4, k4, v4, do4, lse, delta, dk, dv) -> None:
    """``dk`` and ``dv`` (``[B, N, Hkv, D]``) from ``lse`` and ``delta`` (``[B, N, Hq]`` float32) for the problem of
    ``bw``."""
    k_desc = hopper._descriptor(k4, *bw.kv_layouts[0])
    v_desc = hopper._descriptor(v4, *bw.kv_layouts[1])
    q_desc = hopper._descriptor(q4, *bw.q_layouts[0])
    do_desc = hopper._descriptor(do4, *bw.q_layouts[1])
    flags = torch.empty(bw.programs * hopper_dkdv.KEYS, dtype=torch.int8, device=q4.device)
    compiled = hopper_dkdv.na_bwd_dkdv_hopper_kernel[bw.grid](k_desc, v_desc, q_desc, do_desc, dk, dv, lse, delta,
                                                              flags, bw.query_ranges, bw.spans, bw.order,
                                                              bw.key_offsets, *bw.scalars, **bw.meta)
    # the consumers spill (``docs/fused.md``, "What holds dK/dV back"): L1 for their reloads
    carveout.fit_shared_memory(compiled, 1)
    hopper_dkdv.na_bwd_dkdv_nonfinite_kernel[bw.grid](q4, k4, v4, do4, lse, delta, dk, dv, flags, *bw.fixup_scalars,
                                                      **bw.fixup_meta)


from . import decide  # noqa: E402  (decide builds ``_Launch`` records: imported once they are defined)
