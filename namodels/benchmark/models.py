"""The dense-attention baseline of the throughput benchmark: a model's neighborhood attention swapped
for dense attention (torch SDPA over all tokens).  The swap replaces module instances, sharing their
``qkv`` / ``rpb`` / ``proj`` parameters, and touches neither ``ops`` nor the rest of the model.  (Setting
a model's NA backend: :func:`namodels.set_backend`.)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import ops

__all__ = ["DenseSelfAttention", "swap_dense_attention", "dense_rpb_bias"]

RPB_MODES = ("drop", "bias")
_OPS_NA = (ops.NeighborhoodAttention1D, ops.NeighborhoodAttention2D, ops.NeighborhoodAttention3D)


def _swappable(module: nn.Module) -> bool:
    """Plain NA self-attention ``forward(x)`` on ``[B, *spatial, C]`` (the video attention takes rotary
    tables as well and is not swapped)."""
    if not isinstance(module, _OPS_NA):
        return False
    return getattr(type(module).forward, "__code__", None) is not None and \
        type(module).forward.__code__.co_argcount == 2


def dense_rpb_bias(rpb: torch.Tensor, spatial, kernel_size) -> torch.Tensor:
    """``[H, N, N]`` additive bias: NA's relative positional bias extended to every pair of tokens by
    clamping the per-axis offset to the table (``j - i + K - 1`` in ``[0, 2K - 2]``).  Where the window
    covers the whole map (``K == L``, no dilation) this is exactly the bias NA adds."""
    index = None
    for axis, (L, K) in enumerate(zip(spatial, kernel_size)):
        pos = torch.arange(L, device=rpb.device)
        rel = (pos[None, :] - pos[:, None] + K - 1).clamp(0, 2 * K - 2)  # [L_q, L_k]
        stride = math.prod(2 * k - 1 for k in kernel_size[axis + 1:])
        part = rel * stride
        # outer sum over axes, row-major flattening of both the query and the key coordinates
        index = part if index is None else (index[:, None, :, None] + part[None, :, None, :]).reshape(
            index.shape[0] * L, index.shape[1] * L)
    return rpb.flatten(1)[:, index]


class DenseSelfAttention(nn.Module):
    """Self-attention over ALL tokens of the map with the parameters of an NA module.

    ``rpb='drop'`` (the throughput baseline): plain SDPA (flash / memory-efficient kernels), the NA
    module's ``rpb`` stays registered (same parameter count) but is unused.  ``rpb='bias'``: the
    relative positional bias is extended to every pair (:func:`dense_rpb_bias`) and passed as an
    additive mask (slower: SDPA falls back to kernels that take a mask).  Causal axes keep their
    order: a key is admitted iff it is not after the query on every causal axis.
    """

    def __init__(self, na: nn.Module, rpb: str = "drop"):
        super().__init__()
        if rpb not in RPB_MODES:
            raise ValueError(f"rpb: expected one of {RPB_MODES}, got {rpb!r}")
        self.dim, self.num_heads, self.head_dim = na.dim, na.num_heads, na.head_dim
        self.kernel_size, self.is_causal = na.kernel_size, na.is_causal
        self.rpb_mode = rpb
        self.qkv, self.proj, self.proj_drop = na.qkv, na.proj, na.proj_drop
        self.rpb = na.rpb  # shared; used only with rpb='bias'
        self.attn_drop_p = na.attn_drop.p

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, rpb={self.rpb_mode!r}, causal={self.is_causal}"

    def _mask(self, spatial, device, dtype):
        mask = None
        if self.rpb_mode == "bias" and self.rpb is not None:
            mask = dense_rpb_bias(self.rpb, spatial, self.kernel_size).to(dtype)
        if any(self.is_causal):
            coords = torch.stack(torch.meshgrid(*[torch.arange(L, device=device) for L in spatial], indexing="ij"),
                                 -1).reshape(-1, len(spatial))
            admit = torch.ones(coords.shape[0], coords.shape[0], dtype=torch.bool, device=device)
            for axis, causal in enumerate(self.is_causal):
                if causal:
                    admit &= coords[None, :, axis] <= coords[:, None, axis]
            if mask is None:
                mask = admit
            else:
                mask = mask.masked_fill(~admit, float("-inf"))
        return mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, *spatial, c = x.shape
        if c != self.dim:
            raise ValueError(f"x: expected {self.dim} channels last, got {tuple(x.shape)}")
        n = math.prod(spatial)
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        mask = self._mask(spatial, x.device, q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.attn_drop_p if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, *spatial, c)))


def swap_dense_attention(model: nn.Module, rpb: str = "drop") -> int:
    """Replaces (in place) every plain NA self-attention module of ``model`` by :class:`DenseSelfAttention`
    and returns how many were replaced (raises ``ValueError`` if none: the model has no swappable NA)."""
    targets = [(name, m) for name, m in model.named_modules() if _swappable(m)]
    if any(name == "" for name, _ in targets):
        raise ValueError("model: is itself an NA module; wrap it (e.g. nn.Sequential(model)) to swap it in place")
    if not targets:
        raise ValueError("model: no neighborhood self-attention module with forward(x) to swap for dense SDPA")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, DenseSelfAttention(module, rpb=rpb))
    return len(targets)
