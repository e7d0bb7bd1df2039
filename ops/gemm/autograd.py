"""Autograd for the unfused operators: ``qk`` (PN), ``av`` (NN) and fused-in-spirit ``attention``.

Every backward is again PN / NN / IN (the paper's operator algebra):

* ``logits = PN(q, k)``:   ``dq = NN(dlogits, k)``, ``dk = IN(dlogits, q)``, ``drpb`` = bias-index sums;
* ``out = NN(attn, v)``:   ``dattn = PN(dout, v)``, ``dv = IN(attn, dout)``;
* attention (backend ``gemm``): forward PN (+RPB) -> log-sum-exp -> NN on ``exp(logits - lse)``
  (the softmax normalisation is applied where NN reads the weights, so only the float32 logits are
  kept for backward); backward ``dv = IN(P, dout)``, ``dS = PN(dout, v)`` with the epilogue
  ``P * (dP - delta)`` (written over the logits where the precisions agree), ``dq = NN(dS, k)``,
  ``dk = IN(dS, q)``, ``delta = rowsum(dout * out) - dlse``.

A backward with ``create_graph=True`` through ``Attention`` recomputes through the plain-op reference
(``ops.autodiff.second_order``), as does one through ``QK`` / ``AV`` (through ``ops.naive``'s plain forms of the
operators).  Tensors here are flat over space: ``[B, N, heads, dim]``.
"""
from __future__ import annotations

import functools

import torch

from ..autodiff import second_order
from ..naive import plain_av, plain_forward, plain_qk
from . import operators as op
from .torch_tiled import compute_dtype




class QK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, rpb, params):
        ctx.save_for_backward(q, k, rpb)
        ctx.params = params
        return op.pn(q, k, params, rpb=rpb, out_dtype=q.dtype)

    @staticmethod
    @second_order(lambda ctx: (ctx.saved_tensors, functools.partial(_plain_qk, ctx.params)))
    def backward(ctx, d_logits):
        q, k, rpb = ctx.saved_tensors
        params = ctx.params
        dq = dk = drpb = None
        if ctx.needs_input_grad[0]:
            dq = op.nn(d_logits, k, params, out_dtype=q.dtype)
        if ctx.needs_input_grad[1]:
            dk = op.inn(d_logits, q, params, k.shape[2], out_dtype=k.dtype)
        if rpb is not None and ctx.needs_input_grad[2]:
            drpb = op.rpb_grad(d_logits, params, rpb)
        return dq, dk, drpb, None


class AV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, v, params):
        ctx.save_for_backward(attn, v)
        ctx.params = params
        return op.nn(attn, v, params, out_dtype=v.dtype)

    @staticmethod
    @second_order(lambda ctx: (ctx.saved_tensors, functools.partial(_plain_av, ctx.params)))
    def backward(ctx, d_out):
        attn, v = ctx.saved_tensors
        params = ctx.params
        d_attn = dv = None
        if ctx.needs_input_grad[0]:
            # Empty causal slots carry no gradient: 0 there.
            d_attn = op.pn(d_out, v, params, fill=0.0, out_dtype=attn.dtype)
        if ctx.needs_input_grad[1]:
            dv = op.inn(attn, d_out, params, v.shape[2], out_dtype=v.dtype)
        return d_attn, dv, None


def attention_forward(q, k, v, rpb, params, scale):
    """``(out, lse, logits)``: the float32 logits are what the backward reads (``attention_backward``)."""
    ct = compute_dtype(q.dtype)
    logits = op.pn(q, k, params, scale=scale, rpb=rpb, out_dtype=ct)
    lse = op.row_logsumexp(logits)
    out = op.nn(logits, v, params, lse=lse, out_dtype=q.dtype)
    return out, lse, logits


def attention_backward(q, k, v, rpb, logits, lse, out, d_out, d_lse, params, scale, overwrite: bool):
    """``(dq, dk, dv, drpb or None)``.  ``overwrite``: dS may be written over ``logits`` where the precisions agree
    (nothing else reads them in this backward); otherwise it gets its own buffer."""
    ct = lse.dtype
    d_out = d_out.contiguous()
    delta = (d_out.to(ct) * out.to(ct)).sum(-1)
    if d_lse is not None:
        delta = delta - d_lse.to(ct)
    dv = op.inn(logits, d_out, params, v.shape[2], lse=lse, out_dtype=v.dtype)
    # dS feeds tensor-core GEMMs in the input precision anyway: store it in that precision there.
    ds_dtype = q.dtype if op.uses_triton(q, q.shape[-1], v.shape[-1]) else ct
    in_place = overwrite and ds_dtype == logits.dtype
    ds = op.pn(d_out, v, params, ds=(logits, lse, delta), out_dtype=ds_dtype, out=logits if in_place else None)
    del logits
    dq = op.nn(ds, k, params, scale=scale, out_dtype=q.dtype)
    dk = op.inn(ds, q, params, k.shape[2], scale=scale, out_dtype=k.dtype)
    drpb = op.rpb_grad(ds, params, rpb) if rpb is not None else None
    return dq, dk, dv, drpb


def attention_rows(q, k, v, rpb, params, scale):
    """``(out, lse)`` without autograd (``ops.registered``'s forward)."""
    return attention_forward(q, k, v, rpb, params, scale)[:2]


def attention_gradients(q, k, v, rpb, out, lse, d_out, d_lse, params, scale):
    """The backward from the inputs alone (``ops.registered``'s backward): the logits are computed again (one PN)."""
    logits = op.pn(q, k, params, scale=scale, rpb=rpb, out_dtype=lse.dtype)
    return attention_backward(q, k, v, rpb, logits, lse, out, d_out, d_lse, params, scale, overwrite=True)


class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rpb, params, scale):
        out, lse, logits = attention_forward(q, k, v, rpb, params, scale)
        ctx.save_for_backward(q, k, v, rpb, logits, lse, out)
        ctx.params, ctx.scale = params, scale
        return out, lse

    @staticmethod
    @second_order(lambda ctx: (ctx.saved_tensors[:4], functools.partial(_plain_attend, ctx.params, ctx.scale)))
    def backward(ctx, d_out, d_lse):
        q, k, v, rpb, logits, lse, out = ctx.saved_tensors
        params, scale = ctx.params, ctx.scale
        # dS is written over the saved logits.  A further backward over a retained graph (retain_graph=True,
        # gradcheck) recomputes them first: one PN, bitwise the forward's.
        logits = logits.data  # (writes through .data leave the saved tensor's version, so it can be unpacked again)
        if getattr(ctx, "logits_consumed", False):
            op.pn(q, k, params, scale=scale, rpb=rpb, out_dtype=lse.dtype, out=logits)
        if d_out is None:
            d_out = torch.zeros_like(out)
        ds_dtype = q.dtype if op.uses_triton(q, q.shape[-1], v.shape[-1]) else lse.dtype
        ctx.logits_consumed = ds_dtype == logits.dtype
        dq, dk, dv, drpb = attention_backward(q, k, v, rpb, logits, lse, out, d_out, d_lse, params, scale,
                                              overwrite=True)
        return dq, dk, dv, drpb, None, None


def _plain_qk(params, q, k, rpb):
    return (plain_qk(q, k, rpb, params),)


def _plain_av(params, attn, v):
    return (plain_av(attn, v, params),)


def _plain_attend(params, scale, q, k, v, rpb):
    return plain_forward(q, k, v, rpb, params, scale)
