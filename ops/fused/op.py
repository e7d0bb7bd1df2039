"""The fused kernels as ``torch.library`` custom ops (forward and backward) with fake impls.

``torch.compile(fullgraph=True)`` sees two opaque ops whose output shapes come from the fake
implementations, and the autograd formula registered on the forward op (so compiled training
graphs include the fused backward).  Autograd saves only q, k, v, rpb, out and lse.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import launch
from ..window import NAParams

# dRPB sums over the batch in a free order (float32 atomics, like torch's own scatter-add backward) unless this is
# True or torch.use_deterministic_algorithms(True) is on; the reproducible path moves B times the bytes.
DRPB_DETERMINISTIC_DEFAULT = False


def _params(q: torch.Tensor, kernel_size, stride, dilation, is_causal) -> NAParams:
    return NAParams(tuple(q.shape[1:-2]), tuple(kernel_size), tuple(stride), tuple(dilation), tuple(is_causal))


@torch.library.custom_op("namodels::fused_na_forward", mutates_args=())
def fused_na_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rpb: Optional[torch.Tensor],
    kernel_size: list[int], stride: list[int], dilation: list[int], is_causal: list[bool], scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    params = _params(q, kernel_size, stride, dilation, is_causal)
    return launch.forward(q, k, v, rpb, params, scale)


@fused_na_forward.register_fake
def _forward_fake(q, k, v, rpb, kernel_size, stride, dilation, is_causal, scale):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("namodels::fused_na_backward", mutates_args=())
def fused_na_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rpb: Optional[torch.Tensor], out: torch.Tensor,
    lse: torch.Tensor, d_out: torch.Tensor, d_lse: Optional[torch.Tensor],
    kernel_size: list[int], stride: list[int], dilation: list[int], is_causal: list[bool], scale: float,
    deterministic: bool, want_drpb: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    params = _params(q, kernel_size, stride, dilation, is_causal)
    dq, dk, dv, drpb = launch.backward(q, k, v, rpb, out, lse, d_out, d_lse, params, scale, deterministic, want_drpb)
    if drpb is None:  # custom ops return tensors only: an empty one stands for "no rpb gradient"
        drpb = q.new_empty((0,))
    return dq, dk, dv, drpb


@fused_na_backward.register_fake
def _backward_fake(q, k, v, rpb, out, lse, d_out, d_lse, kernel_size, stride, dilation, is_causal, scale,
                   deterministic, want_drpb):
    # The real op returns contiguous gradients whatever the input strides (q/k/v are often views).
    drpb = rpb.new_empty(rpb.shape) if rpb is not None and want_drpb else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), drpb


def _setup_context(ctx, inputs, output):
    q, k, v, rpb, kernel_size, stride, dilation, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, rpb, out, lse)
    ctx.window = (kernel_size, stride, dilation, is_causal, scale)


def _gradients(saved, d_out, d_lse, needs_input_grad, compute):
    """(dq, dk, dv, drpb or None) from the saved tensors: the part both autograd paths share.
    ``compute(q, k, v, rpb, out, lse, d_out, d_lse, deterministic, want_drpb)`` runs the backward
    kernels.  dRPB is skipped when the bias needs no gradient (a frozen RPB while fine-tuning), which saves the
    dQ kernel's dS stores and their reduction, a large share of a small-window backward."""
    q, k, v, rpb, out, lse = saved
    if d_out is None:
        d_out = torch.zeros_like(out)
    deterministic = DRPB_DETERMINISTIC_DEFAULT or torch.are_deterministic_algorithms_enabled()
    want_drpb = rpb is not None and needs_input_grad[3]
    dq, dk, dv, drpb = compute(q, k, v, rpb, out, lse, d_out, d_lse, deterministic, want_drpb)
    return dq, dk, dv, (drpb if want_drpb else None)


def _backward(ctx, d_out, d_lse):
    kernel_size, stride, dilation, is_causal, scale = ctx.window

    def compute(q, k, v, rpb, out, lse, d_out, d_lse, deterministic, want_drpb):
        return fused_na_backward(q, k, v, rpb, out, lse, d_out, d_lse, kernel_size, stride, dilation, is_causal,
                                 scale, deterministic, want_drpb)

    return (*_gradients(ctx.saved_tensors, d_out, d_lse, ctx.needs_input_grad, compute), None, None, None, None,
            None)


fused_na_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerFusedNA(torch.autograd.Function):
    """The same forward and backward as the custom ops, without their dispatch.

    A custom op call costs tens of microseconds of Python (schema checks, dispatcher, dynamo guards);
    a NAT-Tiny forward makes 30 NA calls, and at 14x14 / 7x7 maps the kernels take less time than
    that, so eager models were host-bound (docs/fused.md, "Launch planning").  Eager calls take this
    path; traced code (torch.compile, export, functorch transforms) takes the custom ops.
    """

    @staticmethod
    def forward(ctx, q, k, v, rpb, params: NAParams, scale: float):
        out, lse = launch.forward(q, k, v, rpb, params, scale)
        ctx.save_for_backward(q, k, v, rpb, out, lse)
        ctx.params, ctx.scale = params, scale
        ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        def compute(q, k, v, rpb, out, lse, d_out, d_lse, deterministic, want_drpb):
            return launch.backward(q, k, v, rpb, out, lse, d_out, d_lse, ctx.params, ctx.scale, deterministic,
                                   want_drpb)

        return (*_gradients(ctx.saved_tensors, d_out, d_lse, ctx.needs_input_grad, compute), None, None)


def _traced() -> bool:
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def _needs_grad(q, k, v, rpb) -> bool:
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (rpb is not None and rpb.requires_grad))


def attention(q, k, v, params: NAParams, rpb, scale: float, need_lse: bool = True):
    """``(out, lse)``; lse is None where ``need_lse`` is False and no backward will need it."""
    if not _traced():
        if not _needs_grad(q, k, v, rpb):  # inference: no autograd node to build
            return launch.forward(q, k, v, rpb, params, float(scale), need_lse)
        return _EagerFusedNA.apply(q, k, v, rpb, params, float(scale))
    return fused_na_forward(
        q, k, v, rpb, list(params.kernel_size), list(params.stride), list(params.dilation),
        [bool(c) for c in params.is_causal], float(scale),
    )
