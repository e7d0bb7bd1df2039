"""Neighborhood attention operators (heads-last ``[B, *spatial, H, D]``).

>>> import torch, ops
>>> q = k = v = torch.randn(2, 32, 32, 4, 16)
>>> out = ops.na2d(q, k, v, kernel_size=7, dilation=2)
"""
from . import backends as _backends
from .backends import PREFERENCE, available_backends, current_backend, register_backend, use_backend
from .functional import na1d, na2d, na3d, neighborhood_attention, neighborhood_attention_qkvpacked
from .modules import NeighborhoodAttention1D, NeighborhoodAttention2D, NeighborhoodAttention3D
from .unfused import na1d_av, na1d_qk, na2d_av, na2d_qk, na3d_av, na3d_qk, na_av, na_qk
from .window import NAParams

_backends.load_all()

__all__ = [
    "na1d", "na2d", "na3d", "neighborhood_attention", "neighborhood_attention_qkvpacked",
    "NeighborhoodAttention1D", "NeighborhoodAttention2D", "NeighborhoodAttention3D",
    "na_qk", "na_av", "na1d_qk", "na2d_qk", "na3d_qk", "na1d_av", "na2d_av", "na3d_av",
    "use_backend", "current_backend", "available_backends", "register_backend", "PREFERENCE", "NAParams",
]
