"""NATTEN 0.17's ``NeighborhoodAttention1D/2D/3D`` on ``ops``' modules: the same constructor arguments, parameter
names and shapes (``qkv``, ``rpb [heads, 2k - 1 per axis]``, ``proj``), so NATTEN state dicts load, and the same
forward (channels-last input, query scaled by ``qk_scale`` or ``head_dim ** -0.5``, relative positional bias,
softmax, attention dropout, projection)."""
from __future__ import annotations

from .. import modules as _modules

_IS_NAMODELS_COMPAT = True


class _NattenConstructor:
    """NATTEN 0.17's constructor arguments, mapped onto the ``ops`` module that follows in the class's bases."""

    def __init__(self, dim, num_heads, kernel_size, dilation=1, is_causal=False, rel_pos_bias=False, qkv_bias=True,
                 qk_scale=None, attn_drop=0.0, proj_drop=0.0, use_experimental_ops=False, *, bias=None):
        if use_experimental_ops:
            raise ValueError("use_experimental_ops: NATTEN's experimental ops have no counterpart here; our backends "
                             "are chosen automatically (ops.use_backend to pin one)")
        if bias is not None:  # NATTEN <= 0.15 named the relative positional bias switch ``bias`` (on by default)
            rel_pos_bias = bool(bias)
        super().__init__(dim=dim, num_heads=num_heads, kernel_size=kernel_size, stride=1, dilation=dilation,
                         is_causal=is_causal, qkv_bias=qkv_bias, rel_pos_bias=rel_pos_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, scale=qk_scale)
        self.attn_drop_rate = attn_drop


class NeighborhoodAttention1D(_NattenConstructor, _modules.NeighborhoodAttention1D):
    """``natten.NeighborhoodAttention1D`` of NATTEN 0.17 over ``[B, L, C]``."""


class NeighborhoodAttention2D(_NattenConstructor, _modules.NeighborhoodAttention2D):
    """``natten.NeighborhoodAttention2D`` of NATTEN 0.17 over ``[B, H, W, C]``."""


class NeighborhoodAttention3D(_NattenConstructor, _modules.NeighborhoodAttention3D):
    """``natten.NeighborhoodAttention3D`` of NATTEN 0.17 over ``[B, D, H, W, C]``."""
