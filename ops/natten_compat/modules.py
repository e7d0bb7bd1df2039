"""NATTEN 0.17's ``NeighborhoodAttention1D/2D/3D`` on ``ops``' modules: the same constructor arguments, parameter
names and shapes (``qkv``, ``rpb [heads, 2k - 1 per axis]``, ``proj``), so NATTEN state dicts load, and the same
forward (channels-last input, query scaled by ``qk_scale`` or ``head_dim ** -0.5``, relative positional bias,
softmax, attention dropout, projection)."""
from __future__ import annotations

from .. import modules as _modules

_IS_NAMODELS_COMPAT = True


def _base_arguments(dim, num_heads, kernel_size, dilation, is_causal, rel_pos_bias, qkv_bias, qk_scale, attn_drop,
                    proj_drop, use_experimental_ops, bias) -> dict:
    """The ``ops`` module's constructor arguments for NATTEN 0.17's."""
    if use_experimental_ops:
        raise ValueError("use_experimental_ops: NATTEN's experimental ops have no counterpart here; our backends "
                         "are chosen automatically (ops.use_backend to pin one)")
    if bias is not None:  # NATTEN <= 0.15 named the relative positional bias switch ``bias`` (on by default)
        rel_pos_bias = bool(bias)
    return dict(dim=dim, num_heads=num_heads, kernel_size=kernel_size, stride=1, dilation=dilation,
                is_causal=is_causal, qkv_bias=qkv_bias, rel_pos_bias=rel_pos_bias, attn_drop=attn_drop,
                proj_drop=proj_drop, scale=qk_scale)


class NeighborhoodAttention1D(_modules.NeighborhoodAttention1D):
    """``natten.NeighborhoodAttention1D`` of NATTEN 0.17 over ``[B, L, C]``."""

    def __init__(self, dim, num_heads, kernel_size, dilation=1, is_causal=False, rel_pos_bias=False, qkv_bias=True,
                 qk_scale=None, attn_drop=0.0, proj_drop=0.0, use_experimental_ops=False, *, bias=None):
        super().__init__(**_base_arguments(dim, num_heads, kernel_size, dilation, is_causal, rel_pos_bias, qkv_bias,
                                           qk_scale, attn_drop, proj_drop, use_experimental_ops, bias))
        self.attn_drop_rate = attn_drop


class NeighborhoodAttention2D(_modules.NeighborhoodAttention2D):
    """``natten.NeighborhoodAttention2D`` of NATTEN 0.17 over ``[B, H, W, C]``."""

    def __init__(self, dim, num_heads, kernel_size, dilation=1, is_causal=False, rel_pos_bias=False, qkv_bias=True,
                 qk_scale=None, attn_drop=0.0, proj_drop=0.0, use_experimental_ops=False, *, bias=None):
        super().__init__(**_base_arguments(dim, num_heads, kernel_size, dilation, is_causal, rel_pos_bias, qkv_bias,
                                           qk_scale, attn_drop, proj_drop, use_experimental_ops, bias))
        self.attn_drop_rate = attn_drop


class NeighborhoodAttention3D(_modules.NeighborhoodAttention3D):
    """``natten.NeighborhoodAttention3D`` of NATTEN 0.17 over ``[B, D, H, W, C]``."""

    def __init__(self, dim, num_heads, kernel_size, dilation=1, is_causal=False, rel_pos_bias=False, qkv_bias=True,
                 qk_scale=None, attn_drop=0.0, proj_drop=0.0, use_experimental_ops=False, *, bias=None):
        super().__init__(**_base_arguments(dim, num_heads, kernel_size, dilation, is_causal, rel_pos_bias, qkv_bias,
                                           qk_scale, attn_drop, proj_drop, use_experimental_ops, bias))
        self.attn_drop_rate = attn_drop
