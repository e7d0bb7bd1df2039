"""Autograd for the unfused operators: ``qk`` (PN), ``av`` (NN) and fused-in-spirit ``attention``.

Every backward is again PN / NN / IN (the paper's operator algebra):

* ``logits = PN(q, k)``:   ``dq = NN(dlogits, k)``, ``dk = IN(dlogits, q)``, ``drpb`` = bias-index sums;
* ``out = NN(attn, v)``:   ``dattn = PN(dout, v)``, ``dv = IN(attn, dout)``;
* attention (backend ``gemm``): forward PN (+RPB) -> log-sum-exp -> NN on ``exp(logits - lse)``
  (the softmax normalisation is applied where NN reads the weights, so only the float32 logits are
  kept for backward); backward ``dv = IN(P, dout)``, ``dS = PN(dout, v)`` with the epilogue
  ``P * (dP - delta)`` (written over the logits where the precisions agree), ``dq = NN(dS, k)``,
  ``dk = IN(dS, q)``, ``delta = rowsum(dout * out) - dlse``.

Tensors here are flat over space: ``[B, N, heads, dim]``.
"""
from __future__ import annotations

import torch

from ..autodiff import first_order_only, refuse_jvp
from . import operators as op
from .torch_tiled import compute_dtype


# who the refusals of ``ops.autodiff`` name
UNFUSED = "na_qk / na_av (gemm operators)"
BACKEND = "gemm backend"


class QK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, rpb, params):
        ctx.save_for_backward(q, k, rpb)
        ctx.params = params
        return op.pn(q, k, params, rpb=rpb, out_dtype=q.dtype)

    @staticmethod
    @first_order_only(UNFUSED)
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

    jvp = refuse_jvp(UNFUSED)


class AV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, v, params):
        ctx.save_for_backward(attn, v)
        ctx.params = params
        return op.nn(attn, v, params, out_dtype=v.dtype)

    @staticmethod
    @first_order_only(UNFUSED)
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

    jvp = refuse_jvp(UNFUSED)


class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rpb, params, scale):
        ct = compute_dtype(q.dtype)
        logits = op.pn(q, k, params, scale=scale, rpb=rpb, out_dtype=ct)
        lse = op.row_logsumexp(logits)
        out = op.nn(logits, v, params, lse=lse, out_dtype=q.dtype)
        ctx.save_for_backward(q, k, v, rpb, logits, lse, out)
        ctx.params, ctx.scale = params, scale
        return out, lse

    @staticmethod
    @first_order_only(BACKEND)
    def backward(ctx, d_out, d_lse):
        q, k, v, rpb, logits, lse, out = ctx.saved_tensors
        params, scale = ctx.params, ctx.scale
        ct = lse.dtype
        # dS is written over the saved logits (below).  A further backward over a retained graph (retain_graph=True,
        # gradcheck) recomputes them first: one PN, bitwise the forward's.
        logits = logits.data  # (writes through .data leave the saved tensor's version, so it can be unpacked again)
        if getattr(ctx, "logits_consumed", False):
            op.pn(q, k, params, scale=scale, rpb=rpb, out_dtype=ct, out=logits)
        if d_out is None:
            d_out = torch.zeros_like(out)
        d_out = d_out.contiguous()
        delta = (d_out.to(ct) * out.to(ct)).sum(-1)
        if d_lse is not None:
            delta = delta - d_lse.to(ct)
        dv = op.inn(logits, d_out, params, v.shape[2], lse=lse, out_dtype=v.dtype)
        # dS feeds tensor-core GEMMs in the input precision anyway: store it in that precision there.
        ds_dtype = q.dtype if op.uses_triton(q, q.shape[-1], v.shape[-1]) else ct
        # Where dS has the logits' precision it overwrites them (nothing else reads them in this backward).
        in_place = ds_dtype == logits.dtype
        ds = op.pn(d_out, v, params, ds=(logits, lse, delta), out_dtype=ds_dtype, out=logits if in_place else None)
        ctx.logits_consumed = in_place
        del logits
        dq = op.nn(ds, k, params, scale=scale, out_dtype=q.dtype)
        dk = op.inn(ds, q, params, k.shape[2], scale=scale, out_dtype=k.dtype)
        drpb = op.rpb_grad(ds, params, rpb) if rpb is not None else None
        return dq, dk, dv, drpb, None, None

    jvp = refuse_jvp(BACKEND)
