"""nn.Module wrappers: neighborhood self-attention on channels-last feature maps ``[B, *spatial, C]``.

Parameter names (``qkv``, ``rpb``, ``proj``) follow the official NAT / DiNAT checkpoints.
"""
from __future__ import annotations

import torch
from torch import nn

from .functional import make_params, neighborhood_attention_qkvpacked


class _NeighborhoodAttention(nn.Module):
    rank: int = 0

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kernel_size,
        stride=1,
        dilation=1,
        is_causal=False,
        qkv_bias: bool = True,
        rel_pos_bias: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        backend: str | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"num_heads: dim ({dim}) must be divisible by num_heads ({num_heads})")
        # Validate the window arguments once, against a spatial size large enough for any window.
        probe = make_params((1 << 30,) * self.rank, kernel_size, stride, dilation, is_causal)
        if rel_pos_bias and any(probe.is_causal):
            raise ValueError("rel_pos_bias: relative positional bias is not defined on causal axes")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.scale = float(scale) if scale else self.head_dim ** -0.5  # the logit scale (None or 0: 1/sqrt(D))
        self.kernel_size, self.stride = probe.kernel_size, probe.stride
        self.dilation, self.is_causal = probe.dilation, probe.is_causal
        self.backend = backend
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        if rel_pos_bias:
            self.rpb = nn.Parameter(torch.empty(num_heads, *probe.rpb_shape))
            nn.init.trunc_normal_(self.rpb, std=0.02, a=-2.0, b=2.0)
        else:
            self.register_parameter("rpb", None)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"dilation={self.dilation}, is_causal={self.is_causal}, rel_pos_bias={self.rpb is not None}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != self.rank + 2 or x.shape[-1] != self.dim:
            raise ValueError(
                f"x: expected [B, {', '.join('L%d' % a for a in range(self.rank))}, {self.dim}], got {tuple(x.shape)}"
            )
        spatial = x.shape[1:-1]
        qkv = self.qkv(x).reshape(x.shape[0], *spatial, 3, self.num_heads, self.head_dim)
        if self.attn_drop.p > 0 and self.training:
            out = self._forward_with_weights(*qkv.unbind(-3))
        else:
            out = neighborhood_attention_qkvpacked(
                self.rank, qkv, self.kernel_size, self.stride, self.dilation, self.is_causal,
                rpb=self.rpb, scale=self.scale, backend=self.backend,
            )
        return self.proj_drop(self.proj(out.reshape(*x.shape[:-1], self.dim)))

    def _forward_with_weights(self, q, k, v):
        """Attention dropout needs the attention weights: the unfused (qk -> softmax -> av) path."""
        from .unfused import na_av, na_qk

        logits = na_qk(self.rank, q * self.scale, k, self.kernel_size, self.stride, self.dilation,
                       self.is_causal, rpb=self.rpb)
        attn = self.attn_drop(torch.softmax(logits.float(), dim=-1).to(q.dtype))
        return na_av(self.rank, attn, v, self.kernel_size, self.stride, self.dilation, self.is_causal)


class NeighborhoodAttention1D(_NeighborhoodAttention):
    """Neighborhood self-attention over ``[B, L, C]``."""

    rank = 1


class NeighborhoodAttention2D(_NeighborhoodAttention):
    """Neighborhood self-attention over ``[B, H, W, C]`` (channels last)."""

    rank = 2


class NeighborhoodAttention3D(_NeighborhoodAttention):
    """Neighborhood self-attention over ``[B, T, H, W, C]`` (channels last)."""

    rank = 3
