"""A backend's attention as ``torch.library`` custom ops, for ``torch.compile``.

Eagerly the ``naive`` and ``gemm`` backends run Python (chunk loops, index tables, tiling) behind an
``autograd.Function``; dynamo would either trace all of it or split the graph at each call.  Registered as a
forward op and a backward op with fake implementations (output shapes only) and an autograd formula, a call is
one opaque node of the compiled graph, forward and backward, as the fused backend's ops are (``ops/fused/op.py``).
Eager calls keep the ``autograd.Function`` (no dispatcher cost); the backends take these ops only while dynamo traces.

The formula's backward is ``ops.autodiff.second_order``: a backward with ``create_graph=True`` outside a compiled
graph recomputes through ``ops.autodiff.recompute_attention``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .autodiff import recompute_with, second_order
from .backends import run_on_token_rows
from .window import NAParams


def _params(q: torch.Tensor, kernel_size, stride, dilation, is_causal) -> NAParams:
    return NAParams(tuple(q.shape[1:-2]), tuple(kernel_size), tuple(stride), tuple(dilation), tuple(is_causal))


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def register(name: str, forward: Callable, backward: Callable) -> Callable:
    """Registers ``namodels::{name}_na_forward`` / ``_backward`` and returns ``call(q, k, v, rpb, params, scale) ->
    (out, lse)`` on heads-last ``[B, *spatial, H, D]`` tensors.

    ``forward(q, k, v, rpb, params, scale) -> (out, lse)`` and ``backward(q, k, v, rpb, out, lse, d_out, d_lse,
    params, scale) -> (dq, dk, dv, drpb or None)`` take flat-space ``[B, N, H, D]`` tensors, as the backends'
    kernels do; ``d_lse`` may be None, ``d_out`` never is."""

    @torch.library.custom_op(f"namodels::{name}_na_forward", mutates_args=())
    def forward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rpb: Optional[torch.Tensor],
        kernel_size: list[int], stride: list[int], dilation: list[int], is_causal: list[bool], scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        params = _params(q, kernel_size, stride, dilation, is_causal)
        out, lse = run_on_token_rows(forward, q, k, v, rpb, params, scale)
        return out.contiguous(), lse.contiguous()

    @forward_op.register_fake
    def _(q, k, v, rpb, kernel_size, stride, dilation, is_causal, scale):
        return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q.dtype))

    @torch.library.custom_op(f"namodels::{name}_na_backward", mutates_args=())
    def backward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rpb: Optional[torch.Tensor], out: torch.Tensor,
        lse: torch.Tensor, d_out: torch.Tensor, d_lse: Optional[torch.Tensor],
        kernel_size: list[int], stride: list[int], dilation: list[int], is_causal: list[bool], scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        params = _params(q, kernel_size, stride, dilation, is_causal)
        b, n = q.shape[0], params.num_tokens
        flat = lambda t: t.reshape(b, n, t.shape[-2], t.shape[-1])  # noqa: E731  ([B, *spatial, H, X] -> [B, N, H, X])
        rows = lambda t: None if t is None else t.reshape(b, n, -1)  # noqa: E731  (lse and its gradient)
        dq, dk, dv, drpb = backward(flat(q), flat(k), flat(v), rpb, flat(out), rows(lse), flat(d_out), rows(d_lse),
                                    params, scale)
        drpb = q.new_empty((0,)) if drpb is None else drpb  # custom ops return tensors only
        return (dq.reshape(q.shape).contiguous(), dk.reshape(k.shape).contiguous(), dv.reshape(v.shape).contiguous(),
                drpb)

    @backward_op.register_fake
    def _(q, k, v, rpb, out, lse, d_out, d_lse, kernel_size, stride, dilation, is_causal, scale):
        drpb = rpb.new_empty(rpb.shape) if rpb is not None else q.new_empty((0,))
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), drpb

    def setup_context(ctx, inputs, output):
        q, k, v, rpb, kernel_size, stride, dilation, is_causal, scale = inputs
        ctx.save_for_backward(q, k, v, rpb, *output)
        ctx.window = (kernel_size, stride, dilation, is_causal, scale)

    def recompute_inputs(ctx):
        q, k, v, rpb = ctx.saved_tensors[:4]
        *window, scale = ctx.window
        return (q, k, v, rpb), recompute_with(_params(q, *window), scale)

    @second_order(recompute_inputs)
    def backward_formula(ctx, d_out, d_lse):
        q, k, v, rpb, out, lse = ctx.saved_tensors
        dq, dk, dv, drpb = backward_op(q, k, v, rpb, out, lse, d_out, d_lse, *ctx.window)
        return dq, dk, dv, (drpb if rpb is not None else None), None, None, None, None, None

    forward_op.register_autograd(backward_formula, setup_context=setup_context)

    def call(q, k, v, rpb, params: NAParams, scale: float):
        return forward_op(q, k, v, rpb, list(params.kernel_size), list(params.stride), list(params.dilation),
                          [bool(c) for c in params.is_causal], float(scale))

    return call
