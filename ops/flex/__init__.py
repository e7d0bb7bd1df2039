"""Backend ``flex``: torch ``flex_attention`` with a neighborhood ``mask_mod`` and an RPB ``score_mod``.

The peer anyone can reach: the window rules from ``ops.window`` evaluated per (query, key) pair,
and a block mask (cached per problem) so fully-masked 128x128 blocks are skipped.  Generic
block sparsity wastes most of its work on 2-D/3-D windows, which is what the ``fused`` backend
fixes.  On CUDA the attention runs through ``torch.compile`` (flex's fast path); on CPU it runs
eagerly unless ``ops.flex.COMPILE_ON_CPU`` is set (compiling costs seconds per new shape).

Gradients (CUDA): an eager call sits behind one autograd node (``_Recorded``) whose first-order backward is flex's
own and whose backward with ``create_graph=True`` recomputes through ``ops.autodiff.recompute_attention``;
flex's backward is not differentiable.  A model compiled by the user traces flex inline.

flex multiplies whole blocks (CUDA) or the whole score matrix (CPU's eager reference) by the values, where a
zero weight outside a window times a NaN (or infinite) value is NaN; a call whose values hold one runs again
with them left out and marks the outputs whose windows hold one (``_contain_nonfinite``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch

from ..autodiff import saved_inputs, second_order
from ..window import NAParams, admits

log = logging.getLogger(__name__)

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch without flex attention: the registry reports the backend unavailable
    raise ImportError("torch.nn.attention.flex_attention is not available in this torch build")

import torch.nn.attention.flex_attention as _flex_module

try:  # torch >= 2.9 returns auxiliary outputs through AuxRequest; older releases use return_lse
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None

COMPILE_ON_CPU = False
BLOCK_SIZE = 128
# Check every call's values for NaN / inf (one reduction over them; on CUDA a wait for the device, so that the rare
# call holding one can be run again); off, such a value reaches every row of the blocks that load it.  Skipped while
# torch.compile traces the call or a CUDA graph captures it (neither can branch on data).
CONTAIN_NONFINITE = True
# Compiled variants of flex_attention this backend lets dynamo keep.  Every NA problem (shape, window,
# dtype, grad mode) is its own compiled graph (``dynamic=False``): a 4-stage NAT used for training and
# evaluation already needs 8, dynamo's default limit, past which it silently runs flex *uncompiled*
# (the full score matrix in memory, orders of magnitude slower).
RECOMPILE_LIMIT = 1024


def _unravel(flat, spatial):
    """Flat row-major token index -> per-axis coordinates (works on vmapped tensors)."""
    coords = []
    for L in reversed(spatial):
        coords.append(flat % L)
        flat = flat // L
    return coords[::-1]


def make_mask_mod(params: NAParams):
    def na_mask(b, h, q_idx, kv_idx):
        return admits(_unravel(q_idx, params.spatial), _unravel(kv_idx, params.spatial), params)

    return na_mask


def make_rpb_score_mod(params: NAParams, rpb_flat: torch.Tensor):
    """score + rpb[h, j'-i'+K-1 per axis], with the N-D index flattened row-major into rpb_flat [H, R]."""

    def rpb_mod(score, b, h, q_idx, kv_idx):
        index = 0
        for qi, kj, (L, K, s, d, c) in zip(_unravel(q_idx, params.spatial), _unravel(kv_idx, params.spatial),
                                           params.axes()):
            # Outside the window the index may fall out of range: clamp; the mask removes those pairs.
            rel = (kj // d - qi // d + (K - 1)).clamp(0, 2 * K - 2)
            index = index * (2 * K - 1) + rel
        return score + rpb_flat[h, index].to(score.dtype)

    return rpb_mod


@functools.lru_cache(maxsize=32)
def group_order(params: NAParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Token order that makes dilation groups contiguous, and its inverse; ``None`` without dilation.

    With dilation d a window spans d*K tokens per axis, so in row-major order nearly every 128-token
    block pair holds some admitted pair and flex's block mask is almost dense (docs/fused.md, "Other
    backends"). A query only attends keys of its own group
    (i % d equal on every axis), so ordering tokens by (group, coordinate inside the group) turns the
    problem into an undilated one per group, and the block mask sparse again.
    """
    if all(d == 1 for d in params.dilation):
        return None
    grids = torch.meshgrid(*(torch.arange(L, device=device) for L in params.spatial), indexing="ij")
    key = torch.zeros(params.spatial, dtype=torch.int64, device=device)
    for axis_index, d in zip(grids, params.dilation):  # group ids first (most significant) ...
        key = key * d + axis_index % d
    for axis_index, L, d in zip(grids, params.spatial, params.dilation):  # ... then in-group coordinates
        key = key * -(-L // d) + axis_index // d
    order = torch.argsort(key.flatten(), stable=True)
    return order, torch.argsort(order)


def _mask_in_group_order(mask_mod, order):
    """A mask_mod written for row-major token indices, taking group-order indices instead."""
    if order is None:
        return mask_mod
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, order[q_idx], order[kv_idx])


def _score_in_group_order(score_mod, order):
    """A score_mod written for row-major token indices, taking group-order indices instead."""
    if order is None:
        return score_mod
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, order[q_idx], order[kv_idx])


@functools.lru_cache(maxsize=32)
def _block_mask(params: NAParams, device: torch.device):
    n = params.num_tokens
    # Compiling the mask construction avoids materialising the [N, N] mask on large problems.
    compile_mask = device.type == "cuda" and n > 4096
    ordering = group_order(params, device)
    mask_mod = _mask_in_group_order(make_mask_mod(params), None if ordering is None else ordering[0])
    # One mask_mod object per problem (cached with the block mask) so compiled code is reused.
    return create_block_mask(mask_mod, None, None, n, n, device=device, BLOCK_SIZE=BLOCK_SIZE,
                             _compile=compile_mask)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _recompile_room():
    """Raises dynamo's recompile limits (never lowers them) for the compiled flex call only.

    Scoped rather than set at import, so the user's own compiled functions keep their limits.  Inside
    a model the user compiles, flex is traced inline and this is not used.
    """
    import torch._dynamo

    config = torch._dynamo.config
    raised = {}
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        current = getattr(config, name, None)
        if isinstance(current, int) and current < RECOMPILE_LIMIT:
            raised[name] = RECOMPILE_LIMIT
    return config.patch(raised) if raised else contextlib.nullcontext()


def _run_flex(q, k, v, score_mod, block_mask, scale, gqa):
    if torch.compiler.is_compiling():  # the user's compiled model traces flex inline
        return _call(flex_attention, q, k, v, score_mod, block_mask, scale, gqa)
    use_compile = q.device.type == "cuda" or COMPILE_ON_CPU
    if not use_compile:
        return _run_flex_eager_cpu(q, k, v, score_mod, block_mask, scale, gqa)
    with _recompile_room():
        return _call(_compiled_flex(), q, k, v, score_mod, block_mask, scale, gqa)


def _call(fn, q, k, v, score_mod, block_mask, scale, gqa):
    """flex_attention returning (out, lse) on every torch release that has it."""
    # Inductor picks its "decoding" kernel for short queries (< 128 tokens) with GQA; NA queries are
    # as many as keys, and on torch 2.11 that kernel found no valid config for some small problems
    # (NoValidChoicesError, seen on an H100). The main kernel serves every NA problem.
    options = {"kernel_options": {"FORCE_USE_FLEX_ATTENTION": True}} if q.device.type == "cuda" else {}
    if AuxRequest is not None:
        out, aux = fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                      return_aux=AuxRequest(lse=True), **options)
        return out, aux.lse
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True,
              **options)


def _run_flex_eager_cpu(q, k, v, score_mod, block_mask, scale, gqa):
    """CPU forward without torch.compile.

    Uncompiled flex_attention still traces every call with dynamo, and our mask/score closures are
    new per problem, so each call would re-trace (about a second).  flex's debug switch runs the
    plain PyTorch reference instead, which is exactly what the eager CPU path computes anyway; it
    has no backward, which CPU flex lacks regardless (``unsupported`` refuses gradients on CPU).
    With the switch on, flex does not warn about running uncompiled either.
    """
    with _reference_mode():
        with torch.no_grad():  # flex refuses CPU inputs that require grad, even under no_grad
            q, k, v = q.detach(), k.detach(), v.detach()
            return _call(flex_attention, q, k, v, score_mod, block_mask, scale, gqa)


_reference_lock = threading.Lock()
_reference_users = 0
_reference_flag_before = False


@contextlib.contextmanager
def _reference_mode():
    """flex's debug switch on for the calls inside.  The switch is one flag for the whole process, so calls from
    several threads share it: the first to enter sets it, the last to leave puts back the value the first found (a
    set-and-restore per call would leave it on when two calls overlap and the earlier one leaves first)."""
    global _reference_users, _reference_flag_before
    with _reference_lock:
        if _reference_users == 0:
            _reference_flag_before = _flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
            _flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        _reference_users += 1
    try:
        yield
    finally:
        with _reference_lock:
            _reference_users -= 1
            if _reference_users == 0:
                _flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = _reference_flag_before


def _holds_nonfinite(v: torch.Tensor) -> bool:
    """Whether ``v`` holds a NaN or an infinity, where the answer may steer the call (see ``CONTAIN_NONFINITE``)."""
    if not CONTAIN_NONFINITE or torch.compiler.is_compiling():
        return False
    if v.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return not bool(torch.isfinite(v).all())


def _contain_nonfinite(q, k, v, score_mod, block_mask, scale, gqa):
    """The output of a call whose values hold NaN / inf, with each such value reaching exactly the outputs whose
    windows hold it: the attention of the values with those entries zeroed, NaN where a window holds one (found by a
    second call with equal scores, so every admitted key weighs, over a 0 / 1 map of the bad entries)."""
    bad = ~torch.isfinite(v)
    out, _ = _run_flex(q, k, v.masked_fill(bad, 0.0), score_mod, block_mask, scale, gqa)
    hits, _ = _run_flex(torch.zeros_like(q), torch.zeros_like(k), bad.to(v.dtype), None, block_mask, 1.0, gqa)
    return out.masked_fill(hits > 0, float("nan"))


class _Recorded(torch.autograd.Function):
    """A flex call behind one autograd node.  Its forward records flex's own graph on detached inputs; the first-order
    backward runs through that graph (flex's backward kernels), a backward with ``create_graph=True`` recomputes
    through ``ops.autodiff.recompute_attention`` instead (``second_order``: flex's backward is not differentiable).
    The recorded graph is released by the first backward; a further one over a retained graph records it again."""

    @staticmethod
    def forward(ctx, q, k, v, rpb, params, scale, attend):
        ctx.save_for_backward(q, k, v, rpb)
        ctx.params, ctx.scale, ctx.attend = params, scale, attend
        ctx.set_materialize_grads(False)
        ctx.recorded = _record(attend, (q, k, v, rpb))
        _, out, lse = ctx.recorded
        return out.detach(), lse.detach()

    @staticmethod
    @second_order(saved_inputs)
    def backward(ctx, d_out, d_lse):
        leaves, out, lse = ctx.recorded if ctx.recorded is not None else _record(ctx.attend, ctx.saved_tensors)
        ctx.recorded = None
        pairs = [(o, g) for o, g in ((out, d_out), (lse, d_lse)) if g is not None]
        wanted = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad and ctx.needs_input_grad[i]]
        grads = [None] * 7
        if pairs and wanted:
            computed = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wanted],
                                           [g for _, g in pairs], allow_unused=True)
            for i, g in zip(wanted, computed):
                grads[i] = g
        return tuple(grads)


def _record(attend, tensors):
    """``(leaves, out, lse)``: ``attend`` run with grad on detached copies of ``tensors`` (the leaves)."""
    leaves = tuple(None if t is None else t.detach().requires_grad_(t.requires_grad) for t in tensors)
    with torch.enable_grad():
        out, lse = attend(*leaves)
    return leaves, out, lse


class FlexBackend:
    name = "flex"

    def unsupported(self, problem) -> str | None:
        if problem.device.type not in ("cuda", "cpu"):
            return f"flex_attention runs on CUDA and CPU, not {problem.device.type}"
        if problem.requires_grad and problem.device.type == "cpu":
            return "torch's flex_attention has no backward on CPU (forward only there)"
        if problem.dtype == torch.float64 and problem.device.type == "cuda":
            return "float64 is not supported by the compiled flex kernels"
        if problem.device.type == "cuda" and (problem.head_dim < 16 or problem.value_dim < 16):
            return "the compiled flex kernels need head dims >= 16"
        return None

    def attention(self, q, k, v, params: NAParams, rpb, scale, need_lse=True):
        tensors = (q, k, v) if rpb is None else (q, k, v, rpb)
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return _attend(params, scale, q, k, v, rpb)  # (a compiled graph's backward is first order anyway)
        return _Recorded.apply(q, k, v, rpb, params, scale, functools.partial(_attend, params, scale))


def _attend(params: NAParams, scale, q, k, v, rpb):
    """flex_attention over the neighborhoods of heads-last ``q, k, v``: ``(out, lse)``."""
    b, hq, hkv = q.shape[0], q.shape[-2], k.shape[-2]
    n = params.num_tokens
    to_bhnd = lambda t: t.reshape(b, n, t.shape[-2], t.shape[-1]).transpose(1, 2)  # noqa: E731
    ordering = group_order(params, q.device)
    order, inverse = ordering if ordering is not None else (None, None)
    score_mod = None
    if rpb is not None:
        score_mod = _score_in_group_order(make_rpb_score_mod(params, rpb.reshape(rpb.shape[0], -1)), order)
    q, k, v = to_bhnd(q), to_bhnd(k), to_bhnd(v)
    if order is not None:  # tokens in dilation-group order (see group_order); undone on the outputs
        q, k, v = q[:, :, order], k[:, :, order], v[:, :, order]
    block_mask = _block_mask(params, q.device)
    out, lse = _run_flex(q, k, v, score_mod, block_mask, scale, hq != hkv)
    if _holds_nonfinite(v):  # checked after the launch: on CUDA the wait overlaps the attention
        out = _contain_nonfinite(q, k, v, score_mod, block_mask, scale, hq != hkv)
    if order is not None:
        out, lse = out[:, :, inverse], lse[:, :, inverse]
    spatial = params.spatial
    out = out.transpose(1, 2).reshape(b, *spatial, hq, v.shape[-1])
    lse = lse.transpose(1, 2).reshape(b, *spatial, hq)
    return out, lse


BACKEND = FlexBackend()
