"""The three unfused operators, dispatched to Triton (CUDA) or the tiled PyTorch path, plus helpers.

* ``pn``  (pointwise-neighborhood): ``[.., W]`` weights from two token tensors (QK^T, and dP from dO, V);
* ``nn``  (neighborhood-neighborhood): weights times the neighbors' rows (PV, and dQ from dS, K);
* ``inn`` (inverse-neighborhood): weights scattered back to the keys (dK from dS, Q; dV from P, dO).

All take flat-space tensors ``[B, N, heads, dim]`` and weights ``[B, N, heads, prod(K)]`` (slot order of
``ops.window.neighbor_table``).  ``IMPL`` (env ``NA_GEMM_IMPL``) forces one implementation: ``"torch"``
or ``"triton"`` (the latter on CPU tensors only under ``TRITON_INTERPRET=1``); ``"auto"`` takes Triton
for CUDA tensors of 16/32-bit floats and head dims up to 256, the PyTorch path otherwise (and while tracing:
``ops.backends.tracing()``).
"""
from __future__ import annotations

import functools
import os

import torch

from ..backends import tracing
from ..window import NAParams, neighbor_table
from . import torch_tiled

IMPL = os.environ.get("NA_GEMM_IMPL", "auto")
CHUNK_ELEMS = 16 * 1024 * 1024  # elements per chunk of the row-wise helpers below


@functools.lru_cache(maxsize=1)
def _triton_module():
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def triton_reason(device: torch.device, dtype: torch.dtype, *dims: int) -> str | None:
    """Why the Triton kernels cannot serve these inputs (None = they can)."""
    if IMPL == "torch":
        return "NA_GEMM_IMPL=torch"
    if tracing():
        return "traced calls record the PyTorch path (a graph cannot hold Triton launches)"
    module = _triton_module()
    if module is None:
        return "triton is not installed"
    if IMPL == "triton":
        return None
    if device.type != "cuda":
        return f"Triton kernels run on CUDA, inputs are on {device}"
    if dtype == torch.float64:
        return "float64 has no tensor-core path"
    if max(dims) > module.MAX_HEAD_DIM:
        return f"head dim {max(dims)} > {module.MAX_HEAD_DIM}"
    return None


def _impl(t: torch.Tensor, *dims: int):
    return torch_tiled if triton_reason(t.device, t.dtype, *dims) is not None else _triton_module()


def pn(a, b, params: NAParams, scale=1.0, rpb=None, fill=float("-inf"), out_dtype=None, ds=None, out=None):
    return _impl(a, a.shape[-1], b.shape[-1]).pn(a, b, params, scale, rpb, fill, out_dtype, ds, out)


def nn(w, b, params: NAParams, scale=1.0, lse=None, out_dtype=None):
    return _impl(b, b.shape[-1]).nn(w, b, params, scale, lse, out_dtype)


def inn(w, x, params: NAParams, heads_kv: int, scale=1.0, lse=None, out_dtype=None):
    return _impl(x, x.shape[-1]).inn(w, x, params, heads_kv, scale, lse, out_dtype)


def uses_triton(t: torch.Tensor, *dims: int) -> bool:
    return _impl(t, *dims) is not torch_tiled


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last axis, in row chunks so no temporary of the full size is made."""
    W = logits.shape[-1]
    flat = logits.reshape(-1, W)
    out = torch.empty(flat.shape[0], dtype=logits.dtype, device=logits.device)
    step = max(1, CHUNK_ELEMS // W)
    for lo in range(0, flat.shape[0], step):
        torch.logsumexp(flat[lo: lo + step], dim=-1, out=out[lo: lo + step])
    return out.reshape(logits.shape[:-1])


def rpb_grad(ds: torch.Tensor, params: NAParams, rpb: torch.Tensor) -> torch.Tensor:
    """Gradient of the relative positional bias: ``ds [B, N, H, W]`` summed per head and bias index."""
    B, N, H, W = ds.shape
    ct = torch.float64 if torch.float64 in (ds.dtype, rpb.dtype) else torch.float32
    grad = torch.zeros(H, rpb[0].numel(), dtype=ct, device=ds.device)
    step = max(1, CHUNK_ELEMS // (B * H * W))
    for lo in range(0, N, step):
        hi = min(N, lo + step)
        _, valid, rel = neighbor_table(params, queries=torch.arange(lo, hi, device=ds.device))
        rows = ds[:, lo:hi].sum(0, dtype=ct).masked_fill(~valid[:, None, :], 0.0)  # [n, H, W]
        grad.index_add_(1, rel.reshape(-1), rows.permute(1, 0, 2).reshape(H, -1))
    return grad.reshape(rpb.shape).to(rpb.dtype)
