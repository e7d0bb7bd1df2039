"""Backend ``gemm``: unfused neighborhood attention from the paper's three operators.

Forward: ``PN`` (QK^T of every query tile against its haloed key tile, only the window entries kept,
+ RPB) -> log-sum-exp -> ``NN`` (softmax weights times values).  Backward through ``PN`` / ``NN`` /
``IN`` (``ops.gemm.autograd``).  Triton kernels on CUDA (``ops.gemm.triton_kernels``), a tiled PyTorch
path elsewhere (``ops.gemm.torch_tiled``); both cut queries by their N-D layout (``ops.gemm.tiles``).
The attention weights are materialised (``[B, *spatial, H, prod(K)]`` float32): that is what makes
them available to ``ops.unfused.na_qk`` / ``na_av``, and what bounds the problem sizes it can serve.
"""
from __future__ import annotations

import os

import torch

from ..backends import run_on_token_rows
from ..window import NAParams
from . import operators, torch_tiled
from ..registered import register
from .autograd import AV, QK, Attention, attention_gradients, attention_rows

__all__ = ["BACKEND", "GemmBackend", "QK", "AV", "Attention", "operators"]

# Fraction of the free memory that the weights of ONE batch element may take (the registry's Problem
# carries no batch size, so a large batch can still run out of memory).
MEMORY_FRACTION = 0.9


@torch._dynamo.assume_constant_result  # read once while dynamo traces: the graph keeps the choice it made
def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        # memory PyTorch has cached but not handed out is free for our allocations too
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def weight_bytes(problem) -> int:
    """Bytes of weights per batch element: float32 logits (float64 for float64), and when training on
    the Triton path with 16-bit inputs a separate dS in that precision (otherwise dS overwrites them)."""
    per_slot = 8 if problem.dtype == torch.float64 else 4
    itemsize = problem.dtype.itemsize
    if problem.requires_grad and itemsize < 4:
        per_slot += itemsize
    return problem.params.num_tokens * problem.heads_q * problem.params.window_size * per_slot


class GemmBackend:
    name = "gemm"

    def unsupported(self, problem) -> str | None:
        weights = weight_bytes(problem)
        free = _free_bytes(torch.device(problem.device))
        if free is not None and weights > MEMORY_FRACTION * free:
            return (f"attention weights need {weights / 2**30:.1f} GiB per batch element, "
                    f"{free / 2**30:.1f} GiB free on {problem.device}")
        return None

    def attention(self, q, k, v, params: NAParams, rpb, scale, need_lse=True):
        if torch.compiler.is_compiling():  # one opaque op in the graph (ops.registered)
            return _registered(q, k, v, rpb, params, scale)
        return run_on_token_rows(Attention.apply, q, k, v, rpb, params, scale)

    def traced_attention(self, q, k, v, params: NAParams, rpb, scale):
        # (differentiable by the recorded ops themselves: a traced module can still be trained)
        return run_on_token_rows(_traced_forward, q, k, v, rpb, params, scale)


def _traced_forward(q, k, v, rpb, params: NAParams, scale):
    """``Attention.forward`` as plain tensor ops for a traced graph (``torch_tiled.attention_forward``): the tiled
    PyTorch path on every device (a graph cannot hold the Triton launches), no autograd.Function (the
    TorchScript-based ONNX exporter loses the in-place writes inside one)."""
    return torch_tiled.attention_forward(q, k, v, params, scale, rpb)


_registered = register("gemm", attention_rows, attention_gradients)
BACKEND = GemmBackend()
