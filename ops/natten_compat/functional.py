"""``natten.functional`` as NATTEN 0.14-0.17 had it, on our operators.

Layouts follow those releases: the unfused operators (``na{1,2,3}d_qk`` / ``_av`` and the older
``natten{1,2,3}d{qk,qkrpb,av}``) take heads-first tensors ``[B, heads, *spatial, D]`` and attention weights
``[B, heads, *spatial, prod(kernel_size)]`` (window slots row-major over the window offsets, then one slot per
additional key); the fused ``na{1,2,3}d`` take heads-last ``[B, *spatial, heads, D]``.  Relative positional bias
is ``[heads, 2k - 1 per axis]``.  The unfused logits are not scaled: the caller scales the query, as NATTEN's
modules did.  Semantics are ``ops``' (docs/semantics.md), which are NATTEN's.
"""
from __future__ import annotations

import math

import torch

from .. import functional as _functional
from .. import unfused as _unfused

_IS_NAMODELS_COMPAT = True  # what ops.natten_compat.uninstall() removes from sys.modules


def _heads_last(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.movedim(1, rank + 1)


def _heads_first(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.movedim(rank + 1, 1)


def _check_heads_first(name: str, t, rank: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != rank + 3:
        axes = ", ".join(f"L{a}" for a in range(rank))
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a heads-first tensor [B, heads, {axes}, D] for {rank}-D attention "
                         f"(NATTEN <= 0.17's layout), got {shape}")


def _window_slots(kernel_size, rank: int) -> int:
    sizes = (kernel_size,) * rank if isinstance(kernel_size, int) else tuple(kernel_size)
    return math.prod(sizes)


def _nested(*tensors) -> bool:
    return any(t is not None and t.is_nested for t in tensors)


def _per_element(op, names, tensors, rank, *window):
    """NATTEN 0.17's nested-tensor rule for the unfused operators: every tensor argument nested (one element per
    image size, each a heads-first batch of its own), no autograd; ``op(rank, *elements, *window)`` runs element by
    element and the results are nested again."""
    given = [(n, t) for n, t in zip(names, tensors) if t is not None]
    flat = [n for n, t in given if not t.is_nested]
    if flat:
        raise ValueError(f"{flat[0]}: {', '.join(n for n, _ in given)} must all be nested tensors when one is "
                         f"(NATTEN's rule)")
    if any(t.requires_grad for _, t in given):
        raise ValueError(f"{given[0][0]}: autograd is not supported for nested tensors (NATTEN's rule); pass "
                         f"tensors that do not require grad")
    sizes = {n: t.size(0) for n, t in given}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{given[1][0]}: nested tensors with different numbers of elements: {sizes}")
    elements = [t.unbind() if t is not None else [None] * sizes[given[0][0]] for t in tensors]
    return torch.nested.nested_tensor([op(rank, *parts, *window) for parts in zip(*elements)])


def _qk(rank, query, key, kernel_size, dilation, additional_keys, is_causal, rpb):
    if _nested(query, key, additional_keys):
        if rpb is not None and rpb.is_nested:
            raise ValueError("rpb: the positional bias cannot be nested")
        return _per_element(lambda r, q, k, extra, *w: _qk(r, q, k, w[0], w[1], extra, w[2], rpb),
                            ("query", "key", "additional_keys"), (query, key, additional_keys), rank, kernel_size,
                            dilation, is_causal)
    _check_heads_first("query", query, rank)
    _check_heads_first("key", key, rank)
    logits = _unfused.na_qk(rank, _heads_last(query, rank), _heads_last(key, rank), kernel_size, 1, dilation,
                            is_causal, rpb)
    logits = _heads_first(logits, rank)
    if additional_keys is None:
        return logits
    # every query against every additional key: [B, heads, N, D] x [B, heads, X, D]
    b, h = query.shape[:2]
    flat = query.reshape(b, h, -1, query.shape[-1])
    extra = (flat @ additional_keys.transpose(-1, -2)).reshape(*query.shape[:-1], additional_keys.shape[-2])
    return torch.cat([logits, extra.to(logits.dtype)], dim=-1)


def _av(rank, attn, value, kernel_size, dilation, additional_values, is_causal):
    if _nested(attn, value, additional_values):
        return _per_element(lambda r, a, v, extra, *w: _av(r, a, v, w[0], w[1], extra, w[2]),
                            ("attn", "value", "additional_values"), (attn, value, additional_values), rank,
                            kernel_size, dilation, is_causal)
    _check_heads_first("attn", attn, rank)
    _check_heads_first("value", value, rank)
    slots = _window_slots(kernel_size, rank)
    local = attn[..., :slots] if additional_values is not None else attn
    out = _unfused.na_av(rank, _heads_last(local, rank), _heads_last(value, rank), kernel_size, 1, dilation,
                         is_causal)
    out = _heads_first(out, rank)
    if additional_values is None:
        return out
    b, h = attn.shape[:2]
    weights = attn[..., slots:].reshape(b, h, -1, additional_values.shape[-2])
    extra = (weights @ additional_values.to(weights.dtype)).reshape(out.shape)
    return out + extra.to(out.dtype)


def na1d_qk(query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False, rpb=None):
    return _qk(1, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na2d_qk(query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False, rpb=None):
    return _qk(2, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na3d_qk(query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False, rpb=None):
    return _qk(3, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na1d_av(attn, value, kernel_size, dilation=1, additional_values=None, is_causal=False):
    return _av(1, attn, value, kernel_size, dilation, additional_values, is_causal)


def na2d_av(attn, value, kernel_size, dilation=1, additional_values=None, is_causal=False):
    return _av(2, attn, value, kernel_size, dilation, additional_values, is_causal)


def na3d_av(attn, value, kernel_size, dilation=1, additional_values=None, is_causal=False):
    return _av(3, attn, value, kernel_size, dilation, additional_values, is_causal)


def _fused(rank, query, key, value, kernel_size, dilation, is_causal, rpb, scale, additional_keys,
           additional_values):
    return _functional.neighborhood_attention(rank, query, key, value, kernel_size, 1, dilation, is_causal, rpb,
                                              scale, additional_keys, additional_values)


def na1d(query, key, value, kernel_size, dilation=1, is_causal=False, rpb=None, scale=None, additional_keys=None,
         additional_values=None, xformers_kwargs=None):
    """Fused 1-D neighborhood attention, heads-last ``[B, L, heads, D]`` (``xformers_kwargs`` is ignored)."""
    return _fused(1, query, key, value, kernel_size, dilation, is_causal, rpb, scale, additional_keys,
                  additional_values)


def na2d(query, key, value, kernel_size, dilation=1, is_causal=False, rpb=None, scale=None, additional_keys=None,
         additional_values=None, xformers_kwargs=None):
    """Fused 2-D neighborhood attention, heads-last ``[B, H, W, heads, D]`` (``xformers_kwargs`` is ignored)."""
    return _fused(2, query, key, value, kernel_size, dilation, is_causal, rpb, scale, additional_keys,
                  additional_values)


def na3d(query, key, value, kernel_size, dilation=1, is_causal=False, rpb=None, scale=None, additional_keys=None,
         additional_values=None, xformers_kwargs=None):
    """Fused 3-D neighborhood attention, heads-last ``[B, T, H, W, heads, D]`` (``xformers_kwargs`` is ignored)."""
    return _fused(3, query, key, value, kernel_size, dilation, is_causal, rpb, scale, additional_keys,
                  additional_values)


# The names of NATTEN <= 0.16 (kernel and dilation last; 3-D with separate depth arguments)
def natten1dqkrpb(query, key, rpb, kernel_size, dilation):
    return na1d_qk(query, key, kernel_size, dilation, rpb=rpb)


def natten1dqk(query, key, kernel_size, dilation):
    return na1d_qk(query, key, kernel_size, dilation)


def natten1dav(attn, value, kernel_size, dilation):
    return na1d_av(attn, value, kernel_size, dilation)


def natten2dqkrpb(query, key, rpb, kernel_size, dilation):
    return na2d_qk(query, key, kernel_size, dilation, rpb=rpb)


def natten2dqk(query, key, kernel_size, dilation):
    return na2d_qk(query, key, kernel_size, dilation)


def natten2dav(attn, value, kernel_size, dilation):
    return na2d_av(attn, value, kernel_size, dilation)


def natten3dqkrpb(query, key, rpb, kernel_size_d, kernel_size, dilation_d, dilation):
    return na3d_qk(query, key, (kernel_size_d, kernel_size, kernel_size), (dilation_d, dilation, dilation), rpb=rpb)


def natten3dqk(query, key, kernel_size_d, kernel_size, dilation_d, dilation):
    return na3d_qk(query, key, (kernel_size_d, kernel_size, kernel_size), (dilation_d, dilation, dilation))


def natten3dav(attn, value, kernel_size_d, kernel_size, dilation_d, dilation):
    return na3d_av(attn, value, (kernel_size_d, kernel_size, kernel_size), (dilation_d, dilation, dilation))


# NATTEN 0.15's bias variants (integer kernel size and dilation; 3-D with separate depth arguments)
def na1d_qk_with_bias(query, key, bias, kernel_size, dilation, additional_keys=None):
    return na1d_qk(query, key, kernel_size, dilation, additional_keys, rpb=bias)


def na2d_qk_with_bias(query, key, bias, kernel_size, dilation, additional_keys=None):
    return na2d_qk(query, key, kernel_size, dilation, additional_keys, rpb=bias)


def na3d_qk_with_bias(query, key, bias, kernel_size_d, kernel_size, dilation_d, dilation, additional_keys=None):
    return na3d_qk(query, key, (kernel_size_d, kernel_size, kernel_size), (dilation_d, dilation, dilation),
                   additional_keys, rpb=bias)
