"""Public functional API: argument checking in one place, then backend dispatch.

Layout is heads-last: ``query, key, value: [B, *spatial, H, D]``.  See ``ops.window`` for the
exact window rules.
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch

from . import autodiff
from .backends import Problem, log, select_backend, tracing
from .window import NAParams

IntOrTuple = Union[int, Sequence[int]]
BoolOrTuple = Union[bool, Sequence[bool]]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _per_axis(value, rank: int, name: str, kind: type) -> tuple:
    """Expands an int/bool or a per-axis sequence into a tuple of ``rank`` entries."""
    if isinstance(value, (list, tuple)):
        values = tuple(value)
        if len(values) != rank:
            raise ValueError(f"{name}: expected one value per spatial axis ({rank}), got {len(values)}: {value!r}")
    else:
        values = (value,) * rank
    for axis, v in enumerate(values):
        if kind is bool:
            if not isinstance(v, (bool, int)) or isinstance(v, int) and v not in (0, 1):
                raise ValueError(f"{name}: axis {axis}: expected a bool, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: axis {axis}: expected an int, got {v!r}")
    return tuple(kind(v) for v in values)


# Validated parameters per argument tuple: models repeat the same few calls, and validating them costs about as
# much host time as the fused kernels of a small map run (docs/fused.md, "Launch planning and the host path").
_PARAMS_CACHE: dict[tuple, NAParams] = {}


def _cache_key(value):
    """Hashable key that keeps types apart (``True`` and ``1`` hash alike but validate differently)."""
    if isinstance(value, (list, tuple)):
        return tuple((type(v), v) for v in value)
    return type(value), value


def make_params(spatial: Sequence[int], kernel_size, stride=1, dilation=1, is_causal=False) -> NAParams:
    """Validates window arguments against a spatial shape (the constraints of ``docs/semantics.md``)."""
    if torch.compiler.is_compiling():  # traced once; a cache lookup would add a guard on the cache's size
        return _validate_params(spatial, kernel_size, stride, dilation, is_causal)
    try:
        key = (tuple(spatial), _cache_key(kernel_size), _cache_key(stride), _cache_key(dilation),
               _cache_key(is_causal))
        cached = _PARAMS_CACHE.get(key)
    except TypeError:  # unhashable arguments: validate them (and let validation name the problem)
        key, cached = None, None
    if cached is None:
        cached = _validate_params(spatial, kernel_size, stride, dilation, is_causal)
        if key is not None and len(_PARAMS_CACHE) < 4096:
            _PARAMS_CACHE[key] = cached
    return cached


def _validate_params(spatial, kernel_size, stride, dilation, is_causal) -> NAParams:
    rank = len(spatial)
    kernel_size = _per_axis(kernel_size, rank, "kernel_size", int)
    stride = _per_axis(stride, rank, "stride", int)
    dilation = _per_axis(dilation, rank, "dilation", int)
    is_causal = _per_axis(is_causal, rank, "is_causal", bool)
    for axis, (L, K, s, d) in enumerate(zip(spatial, kernel_size, stride, dilation)):
        if K < 1:
            raise ValueError(f"kernel_size: axis {axis}: must be >= 1, got {K}")
        if not 1 <= s <= K:
            raise ValueError(f"stride: axis {axis}: must satisfy 1 <= stride <= kernel_size ({K}), got {s}")
        if d < 1:
            raise ValueError(f"dilation: axis {axis}: must be >= 1, got {d}")
        if K * d > L:
            raise ValueError(
                f"kernel_size: axis {axis}: kernel_size * dilation = {K} * {d} = {K * d} exceeds the "
                f"spatial size {L}"
            )
    return NAParams(tuple(int(L) for L in spatial), kernel_size, stride, dilation, is_causal)


def window_params(t: torch.Tensor, rank: int, kernel_size, stride=1, dilation=1, is_causal=False,
                  name: str = "query") -> NAParams:
    """``make_params`` for the spatial axes of a heads-last tensor ``t``; a window that does not fit names the
    heads-last layout when ``t`` would fit read heads-first (``[B, heads, *spatial, D]``, SDPA's layout)."""
    try:
        return make_params(tuple(t.shape[1: rank + 1]), kernel_size, stride, dilation, is_causal)
    except ValueError as err:
        hint = _heads_first_hint(t, rank, (kernel_size, stride, dilation, is_causal), name)
        raise ValueError(f"{err}{hint}") from None


def _heads_first_hint(t: torch.Tensor, rank: int, window_args, name: str) -> str:
    """The fix, when the window arguments fit axes 2.. of ``t`` (its spatial axes if it is heads-first)."""
    shape = tuple(t.shape)
    if len(shape) != rank + 3:
        return ""
    try:
        _validate_params(shape[2: rank + 2], *window_args)
    except (ValueError, TypeError):
        return ""
    axes = ", ".join(f"L{a}" for a in range(rank))
    return (f". The tensors are read heads-last, [B, {axes}, heads, D]; {name} of shape {shape} looks heads-first "
            f"[B, heads, {axes}, D] (SDPA's layout): pass x.movedim(1, -2) (and move the output back with "
            f"out.movedim(-2, 1))")


def check_heads_last(name: str, t, rank: int) -> None:
    """A tensor in the heads-last layout ``[B, *spatial, H, D]`` of a ``rank``-D problem."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dim() != rank + 3:
        raise ValueError(
            f"{name}: expected a {rank + 3}-D tensor [B, {', '.join('L%d' % a for a in range(rank))}, H, D] "
            f"for {rank}-D attention, got shape {tuple(t.shape)}"
        )


def check_rpb(rpb, query: torch.Tensor, params: NAParams) -> None:
    """Relative positional bias: ``[heads of query, 2K-1 per axis]``, floating point, non-causal only."""
    if rpb is None:
        return
    if not isinstance(rpb, torch.Tensor):
        raise ValueError(f"rpb: expected a tensor, got {type(rpb).__name__}")
    if any(params.is_causal):
        raise ValueError(
            f"rpb: relative positional bias is not defined on causal axes (is_causal={params.is_causal})"
        )
    expected = (query.shape[-2], *params.rpb_shape)
    if tuple(rpb.shape) != expected:
        raise ValueError(f"rpb: expected shape {expected} [heads, 2K-1 per axis], got {tuple(rpb.shape)}")
    if rpb.device != query.device:
        raise ValueError(f"rpb: is on {rpb.device}, query on {query.device}")
    if not rpb.is_floating_point():
        raise ValueError(f"rpb: expected a floating-point tensor, got {rpb.dtype}")


def check_tensor_pair(rank: int, first, second, names) -> None:
    """Checks shared by every pair of tensors the ops take together ((query, key), (query, value),
    (attn, value)): heads-last layout, a supported dtype, same dtype, device and batch/spatial shape."""
    for name, t in zip(names, (first, second)):
        check_heads_last(name, t, rank)
    if first.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype: {names[0]} dtype {first.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if second.dtype != first.dtype:
        raise ValueError(f"dtype: {names[1]} dtype {second.dtype} differs from {names[0]} dtype {first.dtype}")
    if second.device != first.device:
        raise ValueError(f"device: {names[1]} is on {second.device}, {names[0]} on {first.device}")
    if second.shape[: rank + 1] != first.shape[: rank + 1]:
        raise ValueError(
            f"spatial shape: {names[1]} batch/spatial shape {tuple(second.shape[:rank + 1])} differs from "
            f"{names[0]}'s {tuple(first.shape[:rank + 1])}"
        )


def _check_tensors(rank, query, key, value, rpb, params_args, additional_keys, additional_values):
    check_tensor_pair(rank, query, key, ("query", "key"))
    check_tensor_pair(rank, query, value, ("query", "value"))
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"head dim: key head dim {key.shape[-1]} differs from query head dim {query.shape[-1]}")
    if query.shape[-1] < 1 or value.shape[-1] < 1:
        raise ValueError("head dim: must be >= 1")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"heads: key has {key.shape[-2]} heads, value {value.shape[-2]}")
    if key.shape[-2] < 1 or query.shape[-2] % key.shape[-2] != 0:
        raise ValueError(
            f"heads: key/value heads ({key.shape[-2]}) must divide query heads ({query.shape[-2]}) (GQA/MQA)"
        )
    if any(n == 0 for n in query.shape):
        raise ValueError(f"query: empty tensor of shape {tuple(query.shape)}")

    params = window_params(query, rank, *params_args)

    check_rpb(rpb, query, params)

    if (additional_keys is None) != (additional_values is None):
        raise ValueError("additional_keys: additional_keys and additional_values must be given together")
    if additional_keys is not None:
        b, hkv, d, dv = query.shape[0], key.shape[-2], key.shape[-1], value.shape[-1]
        for name, t, last in (("additional_keys", additional_keys, d), ("additional_values", additional_values, dv)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected a 4-D tensor [B, N_extra, H_kv, D]")
            if t.shape[0] != b or t.shape[2] != hkv or t.shape[3] != last:
                raise ValueError(f"{name}: expected shape [{b}, N_extra, {hkv}, {last}], got {tuple(t.shape)}")
            if t.dtype != query.dtype or t.device != query.device:
                raise ValueError(f"{name}: dtype/device must match query ({query.dtype}, {query.device})")
        if additional_keys.shape[1] != additional_values.shape[1]:
            raise ValueError("additional_values: must have as many tokens as additional_keys")
    return params


# Arguments that passed the checks, by everything the checks look at (types, shapes, dtypes, devices,
# window arguments): a model repeats a few calls, and the checks cost more host time than the fused
# kernel of a small map takes on the GPU.  Only the checks are skipped: the backend is chosen per call.
_VALIDATED: dict[tuple, NAParams] = {}


def _signature(rank, query, key, value, rpb, window_args):
    """Hashable summary of the checked arguments, or None when one is not a plain tensor / value."""
    try:
        rpb_sig = None if rpb is None else (type(rpb), rpb.shape, rpb.dtype, rpb.device)
        signature = (rank, type(query), type(key), type(value), query.shape, key.shape, value.shape, query.dtype,
                     key.dtype, value.dtype, query.device, key.device, value.device, rpb_sig,
                     *(_cache_key(a) for a in window_args))
        hash(signature)
        return signature
    except (AttributeError, TypeError):  # not tensors, unhashable window arguments: the checks will say
        return None


def _dense_attention(query, keys, values, scale):
    """Attention of every query over a small set of extra keys: ``(out, lse)``, float32 math."""
    b, *spatial, hq, d = query.shape
    hkv = keys.shape[2]
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.reshape(b, -1, hkv, hq // hkv, d).to(compute)
    logits = torch.einsum("bnkgd,bxkd->bnkgx", q, keys.to(compute)) * scale
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("bnkgx,bxkd->bnkgd", torch.softmax(logits, dim=-1), values.to(compute))
    return out.reshape(b, *spatial, hq, values.shape[-1]), lse.reshape(b, *spatial, hq)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combines two attentions over disjoint key sets through their log-sum-exps."""
    lse = torch.logaddexp(lse_a.to(lse_b.dtype), lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    out = out_a.to(w_a.dtype) * w_a + out_b * w_b
    return out, lse


def _checked_call(rank, query, key, value, kernel_size, stride, dilation, is_causal, rpb, scale, additional_keys,
                  additional_values, backend):
    """The checks every NA call shares, then the backend: ``(params, scale, backend)``."""
    window_args = (kernel_size, stride, dilation, is_causal)
    # (traced code runs the checks once at trace time: no cache lookups for dynamo to follow)
    cacheable = additional_keys is None and not torch.compiler.is_compiling()
    signature = _signature(rank, query, key, value, rpb, window_args) if cacheable else None
    params = _VALIDATED.get(signature) if signature is not None else None
    if params is None:
        params = _check_tensors(rank, query, key, value, rpb, window_args, additional_keys, additional_values)
        if signature is not None and len(_VALIDATED) < 4096:
            _VALIDATED[signature] = params
    if scale is None:
        scale = query.shape[-1] ** -0.5
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    problem = Problem(
        params=params,
        dtype=query.dtype,
        device=query.device,
        head_dim=query.shape[-1],
        value_dim=value.shape[-1],
        heads_q=query.shape[-2],
        heads_kv=key.shape[-2],
        has_rpb=rpb is not None,
        requires_grad=torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (query, key, value, rpb)),
    )
    impl = select_backend(problem, backend)
    # forward-mode AD and torch.func transforms the backend does not serve run the exact plain-op composition
    reason = autodiff.reference_reason((query, key, value, rpb), getattr(impl, "functorch_transforms", ()))
    if reason is not None:
        log.debug("NA call runs ops.autodiff.reference_attention instead of backend %r: %s", impl.name, reason)
        impl = autodiff.REFERENCE
    return params, float(scale), impl


def neighborhood_attention_qkvpacked(
    rank: int,
    qkv: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple = 1,
    dilation: IntOrTuple = 1,
    is_causal: BoolOrTuple = False,
    rpb: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """N-D neighborhood self-attention on packed ``qkv [B, *spatial, 3, H, D]`` (a qkv projection's output,
    reshaped): the same result as ``neighborhood_attention(rank, *qkv.unbind(-3), ...)``.  Backends that take the
    packed tensor (``fused``) write its gradient as one buffer, where separate q / k / v would have their three
    gradients stacked into it (a copy of three activations per call)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != rank + 4 or qkv.shape[-3] != 3:
        axes = ", ".join(f"L{a}" for a in range(rank))
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"qkv: expected a {rank + 4}-D tensor [B, {axes}, 3, H, D] for {rank}-D attention, "
                         f"got {shape}")
    query, key, value = qkv.unbind(-3)
    params, scale, impl = _checked_call(rank, query, key, value, kernel_size, stride, dilation, is_causal, rpb, scale,
                                        None, None, backend)
    packed = getattr(impl, "attention_qkvpacked", None)
    if tracing() and hasattr(impl, "traced_attention"):
        out, lse = impl.traced_attention(query, key, value, params, rpb, scale)
    elif packed is not None:
        out, lse = packed(qkv, params, rpb, scale, need_lse=return_lse)
    else:
        out, lse = impl.attention(query, key, value, params, rpb, scale, need_lse=return_lse)
    return (out, lse) if return_lse else out


def neighborhood_attention(
    rank: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple = 1,
    dilation: IntOrTuple = 1,
    is_causal: BoolOrTuple = False,
    rpb: torch.Tensor | None = None,
    scale: float | None = None,
    additional_keys: torch.Tensor | None = None,
    additional_values: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """N-D neighborhood attention (see ``na1d`` / ``na2d`` / ``na3d``)."""
    params, scale, impl = _checked_call(rank, query, key, value, kernel_size, stride, dilation, is_causal, rpb, scale,
                                        additional_keys, additional_values, backend)
    if tracing() and hasattr(impl, "traced_attention"):  # recorded into a graph: the backend's plain tensor ops
        out, lse = impl.traced_attention(query, key, value, params, rpb, scale)
    else:
        out, lse = impl.attention(query, key, value, params, rpb, scale,
                                  need_lse=return_lse or additional_keys is not None)
    if additional_keys is not None:
        out_x, lse_x = _dense_attention(query, additional_keys, additional_values, scale)
        out, lse = merge_attention(out, lse, out_x, lse_x)
        out = out.to(query.dtype)
    return (out, lse) if return_lse else out


def _doc(rank: int) -> str:
    return f"""{rank}-D neighborhood attention.

    Args:
        query, key, value: ``[B, {', '.join('L%d' % a for a in range(rank))}, H, D]`` (key/value may have fewer
            heads than query as long as they divide it: GQA/MQA).
        kernel_size, stride, dilation: int or per-axis tuple.
        is_causal: bool or per-axis tuple.
        rpb: optional relative positional bias ``[H, 2K-1 per axis]`` (non-causal only).
        scale: logit scale, default ``D ** -0.5``.
        additional_keys, additional_values: optional ``[B, N_extra, H_kv, D]`` tokens every query
            attends to, merged with the neighborhood result through the log-sum-exp.
        return_lse: also return the log-sum-exp ``[B, *spatial, H]`` (float32).
        backend: ``"naive" | "gemm" | "fused" | "flex"`` or ``None`` (``ops.use_backend``, else the
            fastest that serves the inputs).
    """


def na1d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, rpb=None, scale=None,
         additional_keys=None, additional_values=None, return_lse=False, backend=None):
    return neighborhood_attention(1, query, key, value, kernel_size, stride, dilation, is_causal, rpb, scale,
                                  additional_keys, additional_values, return_lse, backend)


def na2d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, rpb=None, scale=None,
         additional_keys=None, additional_values=None, return_lse=False, backend=None):
    return neighborhood_attention(2, query, key, value, kernel_size, stride, dilation, is_causal, rpb, scale,
                                  additional_keys, additional_values, return_lse, backend)


def na3d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, rpb=None, scale=None,
         additional_keys=None, additional_values=None, return_lse=False, backend=None):
    return neighborhood_attention(3, query, key, value, kernel_size, stride, dilation, is_causal, rpb, scale,
                                  additional_keys, additional_values, return_lse, backend)


na1d.__doc__, na2d.__doc__, na3d.__doc__ = _doc(1), _doc(2), _doc(3)
