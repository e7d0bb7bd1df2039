"""Neighborhood attention whose window covers the map, as dense attention per dilation group.

Where ``kernel_size * dilation == spatial size`` on every axis and no axis is causal, every dilation group holds
exactly ``K`` positions per axis and every query's window is its whole group (``ops.window``: ``start`` is 0 for
every query, whatever the stride).  The attention is then exact dense attention inside each group: the tokens are
regrouped into ``[B * groups, heads, prod(K), D]`` sequences and handed to ``scaled_dot_product_attention``, the
relative positional bias becoming one additive ``[heads, prod(K), prod(K)]`` matrix (axis index ``j' - i' + K - 1``)
shared by every group.  NAT's last stage (7x7 map, 7x7 window) and every dilated DiNAT block at its training size
(dilation = map / window) are such problems.

Plain tensor ops: autograd (the bias gradient included, through the gather), ``torch.compile`` and the
``torch.func`` transforms follow them.  No lse: callers that need it use the kernels.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .window import NAParams

__all__ = ["covers", "attention"]


def covers(params: NAParams) -> bool:
    """Whether every query's window is its whole dilation group (on every axis ``K * d == L``, not causal)."""
    return all(K * d == L and not causal for L, K, d, causal in
               zip(params.spatial, params.kernel_size, params.dilation, params.is_causal))


def _to_groups(t: torch.Tensor, params: NAParams) -> torch.Tensor:
    """``[B, *spatial, H, X]`` -> ``[B * prod(d), H, prod(K), X]``: position ``i = i' * d + g`` on each axis."""
    rank, b = params.rank, t.shape[0]
    split = [n for K, d in zip(params.kernel_size, params.dilation) for n in (K, d)]
    t = t.reshape(b, *split, *t.shape[-2:])  # [B, K0, d0, K1, d1, ..., H, X]
    order = [0, *(2 + 2 * a for a in range(rank)), 1 + 2 * rank, *(1 + 2 * a for a in range(rank)), 2 + 2 * rank]
    return t.permute(order).reshape(b * math.prod(params.dilation), t.shape[-2], params.window_size, t.shape[-1])


def _from_groups(t: torch.Tensor, params: NAParams, batch: int) -> torch.Tensor:
    """The inverse of ``_to_groups``: ``[B * prod(d), H, prod(K), X]`` -> ``[B, *spatial, H, X]``."""
    rank = params.rank
    t = t.reshape(batch, *params.dilation, t.shape[1], *params.kernel_size, t.shape[-1])
    order = [0, *(n for a in range(rank) for n in (rank + 2 + a, 1 + a)), rank + 1, 2 * rank + 2]
    return t.permute(order).reshape(batch, *params.spatial, t.shape[rank + 1], t.shape[-1])


@functools.lru_cache(maxsize=64)
def _bias_index(kernel_size: tuple, device: torch.device) -> tuple:
    """Per axis, the rpb index of every (query slot, key slot) pair, shaped to broadcast into ``[W, W]``."""
    rank = len(kernel_size)
    index = []
    for a, K in enumerate(kernel_size):
        slots = torch.arange(K, device=device)
        rel = slots[None, :] - slots[:, None] + (K - 1)  # [query slot, key slot]
        shape = [1] * (2 * rank)
        shape[a], shape[rank + a] = K, K
        index.append(rel.reshape(shape))
    return tuple(index)


def _bias(rpb: torch.Tensor, params: NAParams, dtype: torch.dtype) -> torch.Tensor:
    index = _bias_index(params.kernel_size, rpb.device)
    W = params.window_size
    return rpb[(slice(None), *index)].reshape(rpb.shape[0], W, W).to(dtype)


def attention(q, k, v, params: NAParams, rpb, scale: float) -> torch.Tensor:
    """``out [B, *spatial, Hq, Dv]`` of a problem ``covers`` accepts (heads-last inputs, GQA allowed)."""
    if not covers(params):
        raise ValueError(f"params: the window does not cover the map ({params}); ops.dense_window.covers says when")
    b = q.shape[0]
    gq, gk, gv = (_to_groups(t, params) for t in (q, k, v))
    bias = None if rpb is None else _bias(rpb, params, q.dtype)
    out = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=bias, scale=scale,
                                         enable_gqa=q.shape[-2] != k.shape[-2])
    return _from_groups(out, params, b)
