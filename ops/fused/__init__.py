"""Backend ``fused``: flash-style neighborhood attention in Triton (forward and backward).

Query tiles are N-D boxes (e.g. 8x16 in 2-D, 2x8x8 in 3-D) in dilation-group coordinates; each
program visits only the key/value tiles covering the union of its queries' windows, masks only
tiles partly outside a window, and keeps the attention weights on chip (online softmax, lse).
The backward computes dQ the same way, dK/dV by looping each key/value tile over the query tiles
whose windows reach it (the inverse neighborhood), and dRPB from the dS that dQ adds up per window
slot (``rpb_grad.py``; reproducible under ``torch.use_deterministic_algorithms``).  Kernels: ``kernels.py``; window formulas: ``window_jit.py``; every launch
decision of a call (one plan per problem and layout): ``decide.py``; the launcher that runs plans: ``launch.py``; tile
search and tuner: ``tiles.py`` / ``autotune.py``; torch.library ops: ``op.py``; the launch decisions for
one problem, with their reasons: ``explain.py`` (``explain``); the warp-specialised
Gluon kernels that sm_90 GPUs run for large windows: the forward in ``hopper.py``, dQ in ``hopper_dq.py``, dK/dV
in ``hopper_dkdv.py``.

Runs on CUDA tensors, and on any tensor under ``TRITON_INTERPRET=1`` (Triton's interpreter, for
tests on CPU).  float16, bfloat16, float32 (matmuls at torch's float32 precision setting); head dims up to 256.
"""
from __future__ import annotations

import os

import torch

from . import kernels, op
from .explain import Explanation, KernelDecision, explain
from .. import dense_window
from ..autodiff import forward_mode
from ..window import NAParams

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


interpreted = kernels.interpreted


class FusedBackend:
    name = "fused"
    # torch.func transforms served by the kernels, each on its own (ops.autodiff.reference_reason): vmap runs the
    # registered custom ops per batch element, jvp (and dual tensors) the tangent kernel; the rest run the reference
    functorch_transforms = ("vmap", "jvp")

    def unsupported(self, problem) -> str | None:
        # (meta tensors: shapes only, from the custom ops' fake implementations)
        if problem.device.type not in ("cuda", "meta") and not interpreted():
            if os.environ.get("TRITON_INTERPRET") == "1":
                return ("the fused kernels were imported before TRITON_INTERPRET=1 was set, so they are compiled "
                        "for CUDA; set it before importing ops.fused to run them on CPU")
            return (f"needs CUDA tensors (Triton GPU kernels), got device {problem.device}; set TRITON_INTERPRET=1 "
                    "before importing ops.fused to run the kernels through Triton's (slow) interpreter on CPU")
        if problem.dtype not in SUPPORTED_DTYPES:
            return f"dtype {problem.dtype} not supported (float16, bfloat16, float32; use naive for float64)"
        if max(problem.head_dim, problem.value_dim) > MAX_HEAD_DIM:
            return f"head dim {max(problem.head_dim, problem.value_dim)} > {MAX_HEAD_DIM} (register budget)"
        return None

    def debug_only(self, problem) -> bool:
        """CPU tensors run through Triton's interpreter: correct but slow, so never chosen automatically."""
        return problem.device.type != "cuda"

    def attention(self, q, k, v, params: NAParams, rpb, scale, need_lse=True):
        if _dense(params, need_lse, (q, k, v, rpb)):
            return dense_window.attention(q, k, v, params, rpb, scale), None
        return op.attention(q, k, v, params, rpb, scale, need_lse)

    def attention_qkvpacked(self, qkv, params: NAParams, rpb, scale, need_lse=True):
        if _dense(params, need_lse, (qkv, rpb)):
            return dense_window.attention(*qkv.unbind(-3), params, rpb, scale), None
        return op.attention_qkvpacked(qkv, params, rpb, scale, need_lse)


# Problems whose window covers the map (``ops.dense_window``) run as dense attention per dilation group through
# ``scaled_dot_product_attention`` when this is True (env ``NAMODELS_DENSE_WINDOW=1``), the caller needs no lse and
# no forward-mode AD is active (SDPA's GPU kernels define no tangent).  Off by default, until a GPU benchmark shows
# SDPA's kernels beating the fused ones on these problems (docs/fused.md, "Windows that cover the map").
DENSE_WINDOW = os.environ.get("NAMODELS_DENSE_WINDOW", "0") == "1"


def _dense(params: NAParams, need_lse: bool, tensors) -> bool:
    return DENSE_WINDOW and not need_lse and dense_window.covers(params) and not forward_mode(tensors)


BACKEND = FusedBackend()
