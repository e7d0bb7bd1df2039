"""What ``import natten`` gives once :func:`ops.natten_compat.install` has run (also ``natten.context``).

NATTEN 0.17's switches choose among its own kernels; here the backend is chosen per call by ``ops`` (or pinned with
``ops.use_backend``), so the switches are accepted, remembered for their queries and logged at debug level.
"""
from __future__ import annotations

import logging
import sys

import torch

from .. import functional as _functional
from . import VERSION, functional
from .modules import NeighborhoodAttention1D, NeighborhoodAttention2D, NeighborhoodAttention3D

_IS_NAMODELS_COMPAT = True
__version__ = VERSION
log = logging.getLogger(__name__)
context = sys.modules[__name__]  # natten.context: the switches below live in this module too

__all__ = ["__version__", "functional", "NeighborhoodAttention1D", "NeighborhoodAttention2D",
           "NeighborhoodAttention3D", "na1d", "na2d", "na3d"]


# ---- the current API (NATTEN >= 0.20): heads-last, stride, additional keys / values, return_lse ----------------
def _current(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
             additional_values, return_lse, backend):
    if backend is not None:
        log.debug("natten.na%dd: backend=%r is NATTEN's; ops chooses its own", rank, backend)
    return _functional.neighborhood_attention(rank, query, key, value, kernel_size, stride, dilation, is_causal,
                                              None, scale, additional_keys, additional_values, return_lse)


def na1d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None, additional_keys=None,
         additional_values=None, attention_kwargs=None, return_lse=False, backend=None, **options):
    """NATTEN >= 0.20's ``natten.na1d``: ``[B, L, heads, D]`` (kernel configuration ``options`` are ignored)."""
    return _current(1, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
                    additional_values, return_lse, backend)


def na2d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None, additional_keys=None,
         additional_values=None, attention_kwargs=None, return_lse=False, backend=None, **options):
    """NATTEN >= 0.20's ``natten.na2d``: ``[B, H, W, heads, D]`` (kernel configuration ``options`` are ignored)."""
    return _current(2, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
                    additional_values, return_lse, backend)


def na3d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None, additional_keys=None,
         additional_values=None, attention_kwargs=None, return_lse=False, backend=None, **options):
    """NATTEN >= 0.20's ``natten.na3d``: ``[B, T, H, W, heads, D]`` (kernel configuration ``options`` are ignored)."""
    return _current(3, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
                    additional_values, return_lse, backend)


# ---- NATTEN 0.17's switches and queries -------------------------------------------------------------------------
_STATE = {"fused_na": False, "kv_parallelism": True, "deterministic": False, "autotuner": False, "tiled_na": True,
          "gemm_na": True, "tf32_in_gemm_na": True, "memory_usage": "default"}


def _set(name: str, value):
    log.debug("natten switch %s=%r: accepted; ops chooses its backend per call", name, value)
    _STATE[name] = value


def use_fused_na(mode: bool = True, kv_parallel: bool = True, use_flex_attention: bool = False,
                 force_flex_attention: bool = False):
    _set("fused_na", bool(mode))
    _set("kv_parallelism", bool(kv_parallel))


use_fna = use_fused_na


def is_fused_na_enabled() -> bool:
    return _STATE["fused_na"]


is_fna_enabled = is_fused_na_enabled


def use_kv_parallelism_in_fused_na(mode: bool = True):
    _set("kv_parallelism", bool(mode))


def is_kv_parallelism_in_fused_na_enabled() -> bool:
    return _STATE["kv_parallelism"]


def use_deterministic_algorithms(mode: bool = True):
    _set("deterministic", bool(mode))


def are_deterministic_algorithms_enabled() -> bool:
    return _STATE["deterministic"]


def use_autotuner(forward_pass=None, backward_pass=None, thorough_mode_forward=None, thorough_mode_backward=None,
                  warmup_steps_forward=None, warmup_steps_backward=None, steps_forward=None, steps_backward=None):
    _set("autotuner", bool(forward_pass or backward_pass))


def disable_autotuner():
    _set("autotuner", False)


def is_autotuner_enabled() -> bool:
    return _STATE["autotuner"]


is_autotuner_enabled_for_forward = is_autotuner_enabled_for_backward = is_autotuner_enabled


def is_autotuner_thorough_for_forward() -> bool:
    return False


is_autotuner_thorough_for_backward = is_autotuner_thorough_for_forward


def set_memory_usage_preference(pref: str = "default"):
    if pref not in ("default", "strict", "unrestricted"):
        raise ValueError(f"pref: expected 'default', 'strict' or 'unrestricted', got {pref!r}")
    _set("memory_usage", pref)


def get_memory_usage_preference() -> str:
    return _STATE["memory_usage"]


def is_memory_usage_default() -> bool:
    return _STATE["memory_usage"] == "default"


def is_memory_usage_strict() -> bool:
    return _STATE["memory_usage"] == "strict"


def is_memory_usage_unrestricted() -> bool:
    return _STATE["memory_usage"] == "unrestricted"


def _switch(name):
    def use(mode: bool = True):
        _set(name, bool(mode))

    def enabled() -> bool:
        return _STATE[name]

    return use, enabled


use_tiled_na, is_tiled_na_enabled = _switch("tiled_na")
use_gemm_na, is_gemm_na_enabled = _switch("gemm_na")
use_tf32_in_gemm_na, is_tf32_in_gemm_na_enabled = _switch("tf32_in_gemm_na")


def _capability(device_index=None) -> tuple[int, int]:
    if not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(device_index)


def has_cuda() -> bool:
    return torch.cuda.is_available()


def has_half(device_index=None) -> bool:
    return _capability(device_index) >= (5, 0)


def has_bfloat(device_index=None) -> bool:
    return _capability(device_index) >= (8, 0)


def has_gemm(device_index=None) -> bool:
    return _capability(device_index) >= (7, 0)


def has_fna(device_index=None) -> bool:
    return _capability(device_index) >= (5, 0)


has_fused_na = has_fna


def has_tf32_gemm(device_index=None) -> bool:
    return _capability(device_index) >= (8, 0)


has_fp32_gemm = has_fp64_gemm = has_tf32_gemm
