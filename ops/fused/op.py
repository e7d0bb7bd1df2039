"""The fused kernels as ``torch.library`` custom ops (forward and backward) with fake impls.

``torch.compile(fullgraph=True)`` sees two opaque ops whose output shapes come from the fake
implementations, and the autograd formula registered on the forward op (so compiled training
graphs include the fused backward).  Autograd saves only q, k, v, rpb, out and lse.  The fake
implementations also serve meta tensors (shapes only).

Beyond first order (``ops.autodiff``): every backward here, the registered formulas and the eager
``autograd.Function`` alike, is ``second_order`` (with ``create_graph=True`` the gradients come from
``ops.autodiff.recompute_attention``, so a double backward is exact).  Forward mode runs ``_ForwardMode``: the forward
kernel for the primal, the tangent kernel (``jvp.py``) for the tangents; dual tensors that reach the registered ops'
kernels directly raise.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import launch
from ..autodiff import (forward_mode, recompute_attention, recompute_with, recomputed_gradients, refuse_forward_ad,
                        saved_inputs, second_order)
from ..window import NAParams
from .jvp import forward_tangent

WHO = "fused backend"  # (named by the refusals of ops.autodiff)

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
    refuse_forward_ad(WHO, (q, k, v, rpb))  # the op has no tangent rule: a dual input would lose its tangent
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
    refuse_forward_ad(WHO, (q, k, v, rpb, d_out, d_lse))
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
    ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient (one kernel and one read saved)


def drpb_deterministic() -> bool:
    """dRPB summed in a fixed order (``DRPB_DETERMINISTIC_DEFAULT`` or torch's deterministic mode)."""
    return DRPB_DETERMINISTIC_DEFAULT or torch.are_deterministic_algorithms_enabled()


def _gradients(saved, d_out, d_lse, needs_input_grad, compute):
    """(dq, dk, dv, drpb or None) from the saved tensors: the part both autograd paths share.
    ``compute(q, k, v, rpb, out, lse, d_out, d_lse, deterministic, want_drpb)`` runs the backward
    kernels.  dRPB is skipped when the bias needs no gradient (a frozen RPB while fine-tuning), which saves the
    dQ kernel's dS stores and their reduction, a large share of a small-window backward."""
    q, k, v, rpb, out, lse = saved
    if d_out is None:
        d_out = torch.zeros_like(out)
    deterministic = drpb_deterministic()
    want_drpb = rpb is not None and needs_input_grad[3]
    dq, dk, dv, drpb = compute(q, k, v, rpb, out, lse, d_out, d_lse, deterministic, want_drpb)
    return dq, dk, dv, (drpb if want_drpb else None)


def _recompute_inputs(ctx):
    """``ops.autodiff.second_order``'s view of the registered op: its tensors and their differentiable recompute."""
    q, k, v, rpb = ctx.saved_tensors[:4]
    kernel_size, stride, dilation, is_causal, scale = ctx.window
    params = _params(q, kernel_size, stride, dilation, is_causal)
    return (q, k, v, rpb), recompute_with(params, scale)


def _plain_attend_packed(params, scale, qkv, rpb):
    return recompute_attention(*qkv.unbind(-3), params, rpb, scale)


@second_order(_recompute_inputs)
def _backward(ctx, d_out, d_lse):
    kernel_size, stride, dilation, is_causal, scale = ctx.window

    def compute(q, k, v, rpb, out, lse, d_out, d_lse, deterministic, want_drpb):
        return fused_na_backward(q, k, v, rpb, out, lse, d_out, d_lse, kernel_size, stride, dilation, is_causal,
                                 scale, deterministic, want_drpb)

    return (*_gradients(ctx.saved_tensors, d_out, d_lse, ctx.needs_input_grad, compute), None, None, None, None,
            None)


fused_na_forward.register_autograd(_backward, setup_context=_setup_context)


# Packed q/k/v: ``qkv [B, *spatial, 3, H, D]`` as a qkv projection gives it.  Autograd then has one input and one
# gradient, which the dQ and dK/dV kernels write in place as the three slices of one buffer; with separate q, k, v
# views it would stack three gradients into the projection's (a copy of three activations per block, eager and
# compiled alike).


@torch.library.custom_op("namodels::fused_na_packed_forward", mutates_args=())
def fused_na_packed_forward(
    qkv: torch.Tensor, rpb: Optional[torch.Tensor],
    kernel_size: list[int], stride: list[int], dilation: list[int], is_causal: list[bool], scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    refuse_forward_ad(WHO, (qkv, rpb))
    q, k, v = qkv.unbind(-3)
    return launch.forward(q, k, v, rpb, _params(q, kernel_size, stride, dilation, is_causal), scale)


@fused_na_packed_forward.register_fake
def _packed_forward_fake(qkv, rpb, kernel_size, stride, dilation, is_causal, scale):
    shape = (*qkv.shape[:-3], *qkv.shape[-2:])
    return qkv.new_empty(shape), qkv.new_empty(shape[:-1], dtype=torch.float32)


@torch.library.custom_op("namodels::fused_na_packed_backward", mutates_args=())
def fused_na_packed_backward(
    qkv: torch.Tensor, rpb: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor,
    d_lse: Optional[torch.Tensor], kernel_size: list[int], stride: list[int], dilation: list[int],
    is_causal: list[bool], scale: float, deterministic: bool, want_drpb: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    refuse_forward_ad(WHO, (qkv, rpb, d_out, d_lse))
    d_qkv, drpb = packed_gradients(qkv, rpb, out, lse, d_out, d_lse,
                                   _params(qkv.unbind(-3)[0], kernel_size, stride, dilation, is_causal), scale,
                                   deterministic, want_drpb)
    return d_qkv, qkv.new_empty((0,)) if drpb is None else drpb  # custom ops return tensors only


@fused_na_packed_backward.register_fake
def _packed_backward_fake(qkv, rpb, out, lse, d_out, d_lse, kernel_size, stride, dilation, is_causal, scale,
                          deterministic, want_drpb):
    drpb = rpb.new_empty(rpb.shape) if rpb is not None and want_drpb else qkv.new_empty((0,))
    return qkv.new_empty(qkv.shape), drpb


def packed_gradients(qkv, rpb, out, lse, d_out, d_lse, params, scale, deterministic, want_drpb,
                     host_descriptors: bool = True):
    """``(d_qkv, drpb or None)``: the backward kernels write dq, dk and dv straight into one contiguous buffer
    (``host_descriptors``: see ``launch.forward``)."""
    d_qkv = launch._empty(qkv.shape, qkv.dtype, qkv.device)  # (the tests poison it like every kernel output)
    q, k, v = qkv.unbind(-3)
    if d_out is None:
        d_out = torch.zeros_like(out)
    _, _, _, drpb = launch.backward(q, k, v, rpb, out, lse, d_out, d_lse, params, scale, deterministic, want_drpb,
                                    grads=d_qkv.unbind(-3), host_descriptors=host_descriptors)
    return d_qkv, drpb


def _packed_setup_context(ctx, inputs, output):
    qkv, rpb, kernel_size, stride, dilation, is_causal, scale = inputs
    ctx.save_for_backward(qkv, rpb, *output)
    ctx.window = (kernel_size, stride, dilation, is_causal, scale)
    ctx.set_materialize_grads(False)


def _packed_recompute_inputs(ctx):
    qkv, rpb = ctx.saved_tensors[:2]
    kernel_size, stride, dilation, is_causal, scale = ctx.window
    params = _params(qkv.unbind(-3)[0], kernel_size, stride, dilation, is_causal)
    return (qkv, rpb), functools.partial(_plain_attend_packed, params, scale)


@second_order(_packed_recompute_inputs)
def _packed_backward(ctx, d_out, d_lse):
    qkv, rpb, out, lse = ctx.saved_tensors
    kernel_size, stride, dilation, is_causal, scale = ctx.window
    want_drpb = rpb is not None and ctx.needs_input_grad[1]
    if d_out is None:
        d_out = torch.zeros_like(out)
    d_qkv, drpb = fused_na_packed_backward(qkv, rpb, out, lse, d_out, d_lse, kernel_size, stride, dilation,
                                           is_causal, scale, drpb_deterministic(), want_drpb)
    return d_qkv, (drpb if want_drpb else None), None, None, None, None, None


fused_na_packed_forward.register_autograd(_packed_backward, setup_context=_packed_setup_context)


class _EagerFusedNA(torch.autograd.Function):
    """The same forward and backward as the custom ops, without their dispatch.

    A custom op call costs Python time (schema checks, dispatcher, dynamo guards) on every NA call of a
    model, and on small maps the kernels take less time than that, so eager models were host-bound
    (docs/fused.md, "Launch planning and the host path").  Eager calls take this
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
    @second_order(saved_inputs)
    def backward(ctx, d_out, d_lse):
        def compute(q, k, v, rpb, out, lse, d_out, d_lse, deterministic, want_drpb):
            return launch.backward(q, k, v, rpb, out, lse, d_out, d_lse, ctx.params, ctx.scale, deterministic,
                                   want_drpb)

        return (*_gradients(ctx.saved_tensors, d_out, d_lse, ctx.needs_input_grad, compute), None, None)


class _EagerFusedNAPacked(torch.autograd.Function):
    """``_EagerFusedNA`` for packed ``qkv [B, *spatial, 3, H, D]`` (see the packed custom ops)."""

    @staticmethod
    def forward(ctx, qkv, rpb, params: NAParams, scale: float):
        q, k, v = qkv.unbind(-3)
        out, lse = launch.forward(q, k, v, rpb, params, scale)
        ctx.save_for_backward(qkv, rpb, out, lse)
        ctx.params, ctx.scale = params, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @second_order(lambda ctx: (ctx.saved_tensors[:2], functools.partial(_plain_attend_packed, ctx.params, ctx.scale)))
    def backward(ctx, d_out, d_lse):
        qkv, rpb, out, lse = ctx.saved_tensors
        want_drpb = rpb is not None and ctx.needs_input_grad[1]
        d_qkv, drpb = packed_gradients(qkv, rpb, out, lse, d_out, d_lse, ctx.params, ctx.scale,
                                       drpb_deterministic(), want_drpb)
        return d_qkv, (drpb if want_drpb else None), None, None


class _ForwardMode(torch.autograd.Function):
    """Fused attention under forward-mode AD (``torch.func.jvp``, dual tensors): the primal from the forward kernel,
    the tangents of out and lse from the tangent kernel (``ops/fused/jvp.py``) in one pass over each window.  A
    reverse-mode pass through the same call (``jacrev`` of a ``jvp``, or a backward) recomputes
    (``ops.autodiff.recompute_attention``)."""

    @staticmethod
    def forward(q, k, v, rpb, params: NAParams, scale: float):
        return launch.forward(q, k, v, rpb, params, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, rpb, params, scale = inputs
        ctx.save_for_forward(q, k, v, rpb, *output)
        ctx.save_for_backward(q, k, v, rpb)
        ctx.params, ctx.scale = params, scale

    @staticmethod
    def jvp(ctx, tq, tk, tv, trpb, _params, _scale):
        # under torch.func.jvp these are functorch wrappers, which the kernel cannot address: it reads their data
        tensors = [_unwrapped(t) for t in (*ctx.saved_tensors, tq, tk, tv, trpb)]
        q, k, v, rpb, out, lse, tq, tk, tv, trpb = tensors
        with torch._C._DisableFuncTorch():  # (and its buffers plain tensors too)
            return forward_tangent(q, k, v, rpb, tq, tk, tv, trpb, out, lse, ctx.params, ctx.scale)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        tensors = ctx.saved_tensors
        return recomputed_gradients(ctx.needs_input_grad, tensors,
                                    recompute_with(ctx.params, ctx.scale), (d_out, d_lse))


def _unwrapped(t):
    """The plain tensor under ``torch.func``'s wrappers (``t`` itself outside any transform)."""
    while isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _traced(t: torch.Tensor) -> bool:
    """Whether the call takes the custom ops: traced code, functorch transforms, and meta tensors (shapes from the
    fake implementations; the kernels need data)."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() or t.is_meta


def _needs_grad(q, k, v, rpb) -> bool:
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (rpb is not None and rpb.requires_grad))


def attention(q, k, v, params: NAParams, rpb, scale: float, need_lse: bool = True):
    """``(out, lse)``; lse is None where ``need_lse`` is False and no backward will need it."""
    if not torch.compiler.is_compiling() and forward_mode((q, k, v, rpb)):
        return _ForwardMode.apply(q, k, v, rpb, params, float(scale))
    if not _traced(q):
        if not _needs_grad(q, k, v, rpb):  # inference: no autograd node to build
            return launch.forward(q, k, v, rpb, params, float(scale), need_lse)
        return _EagerFusedNA.apply(q, k, v, rpb, params, float(scale))
    return fused_na_forward(
        q, k, v, rpb, list(params.kernel_size), list(params.stride), list(params.dilation),
        [bool(c) for c in params.is_causal], float(scale),
    )


def attention_qkvpacked(qkv, params: NAParams, rpb, scale: float, need_lse: bool = True):
    """``attention`` for packed ``qkv [B, *spatial, 3, H, D]``: ``(out, lse)``, lse None where not needed."""
    if not torch.compiler.is_compiling() and forward_mode((qkv, rpb)):
        return _ForwardMode.apply(*qkv.unbind(-3), rpb, params, float(scale))
    if not _traced(qkv):
        if not _needs_grad(qkv, qkv, qkv, rpb):
            q, k, v = qkv.unbind(-3)
            return launch.forward(q, k, v, rpb, params, float(scale), need_lse)
        return _EagerFusedNAPacked.apply(qkv, rpb, params, float(scale))
    return fused_na_packed_forward(
        qkv, rpb, list(params.kernel_size), list(params.stride), list(params.dilation),
        [bool(c) for c in params.is_causal], float(scale),
    )
