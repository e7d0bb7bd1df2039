"""Autograd for the unfused operators: ``qk`` (PN), ``av`` (NN) and fused-in-spirit ``attention``.

Every backward is again PN / NN / IN (the paper's operator algebra):

* ``logits = PN(q, k)``:   ``dq = NN(dlogits, k)``, ``dk = IN(dlogits, q)``, ``drpb`` = bias-index sums;
* ``out = NN(attn, v)``:   ``dattn = PN(dout, v)``, ``dv = IN(attn, dout)``;
* attention (backend ``gemm``): forward PN (+RPB) -> log-sum-exp -> NN on ``exp(logits - lse)``
  (the softmax normalisation is applied where NN reads the weights, so only the float32 logits are
  kept for backward); backward ``dv = IN(P, dout)``, ``dS = PN(dout, v)`` with the epilogue
  ``P * (dP - delta)`` (written over the logits where the precisions agree), ``dq = NN(dS, k)``,
  ``dk = IN(dS, q)``, ``delta = rowsum(dout * out) - dlse``.

A backward with ``create_graph=True`` through ``Attention``, ``QK`` or ``AV`` recomputes through ``_PN`` /
``_NN`` / ``_IN``, the same operators made differentiable to any order (``ops.autodiff.second_order``).  Tensors
here are flat over space: ``[B, N, heads, dim]``.
"""
from __future__ import annotations

import functools

import torch

from ..autodiff import saved_inputs, second_order
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
    @second_order(saved_inputs)
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


# ---------------------------------------------------------------------------------------------------------------
# The operator algebra, differentiable to any order: each operator's gradients are the other two operators, so a
# composition of them is differentiated by autograd through the same kernels however often, holding the
# [B, N, H, prod(K)] weights and never the neighbors' gathered rows.  What a backward with create_graph=True
# recomputes (``ops.autodiff.second_order``).
# ---------------------------------------------------------------------------------------------------------------
class _PN(torch.autograd.Function):
    """``a [B, N, Ha, D]``, ``b [B, N, Hb, D]`` -> ``[B, N, Ha, W]`` dot products, 0 in empty causal slots."""

    @staticmethod
    def forward(ctx, a, b, params, out_dtype):
        ctx.save_for_backward(a, b)
        ctx.params = params
        if a.dtype != b.dtype:  # (a float32 gradient against 16-bit rows, in a higher derivative: the wider type)
            wide = torch.promote_types(a.dtype, b.dtype)
            a, b = a.to(wide), b.to(wide)
        return op.pn(a, b, params, fill=0.0, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        da = _NN.apply(g, b, ctx.params, a.dtype) if ctx.needs_input_grad[0] else None
        db = _IN.apply(g, a, ctx.params, b.shape[2], b.dtype) if ctx.needs_input_grad[1] else None
        return da, db, None, None


class _NN(torch.autograd.Function):
    """``w [B, N, Ha, W]``, ``b [B, N, Hb, Dv]`` -> ``[B, N, Ha, Dv]``: weights times the neighbors' rows."""

    @staticmethod
    def forward(ctx, w, b, params, out_dtype):
        ctx.save_for_backward(w, b)
        ctx.params = params
        return op.nn(w, b, params, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, g):
        w, b = ctx.saved_tensors
        dw = _PN.apply(g, b, ctx.params, w.dtype) if ctx.needs_input_grad[0] else None
        db = _IN.apply(w, g, ctx.params, b.shape[2], b.dtype) if ctx.needs_input_grad[1] else None
        return dw, db, None, None


class _IN(torch.autograd.Function):
    """``w [B, N, Ha, W]``, ``x [B, N, Ha, D]`` -> ``[B, N, heads, D]``: each weight times its query's row, added up
    at the key of its slot."""

    @staticmethod
    def forward(ctx, w, x, params, heads, out_dtype):
        ctx.save_for_backward(w, x)
        ctx.params = params
        return op.inn(w, x, params, heads, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, g):
        w, x = ctx.saved_tensors
        dw = _PN.apply(x, g, ctx.params, w.dtype) if ctx.needs_input_grad[0] else None
        dx = _NN.apply(w, g, ctx.params, x.dtype) if ctx.needs_input_grad[1] else None
        return dw, dx, None, None, None


def differentiable_attention(q, k, v, rpb, params, scale):
    """``(out, lse)`` of flat ``[B, N, H, D]`` inputs from the differentiable operators: softmax of
    ``PN(q * scale, k)`` plus the gathered RPB, masked at empty slots, then ``NN`` with the values."""
    logits = _logits(q * scale, k, rpb, params, compute_dtype(q.dtype))
    lse = torch.logsumexp(logits, dim=-1)
    out = _NN.apply(torch.exp(logits - lse.unsqueeze(-1)), v, params, q.dtype)
    return out, lse


def _logits(q, k, rpb, params, dtype):
    """``QK``'s logits from ``_PN`` in ``dtype``: the gathered RPB added, ``-inf`` in empty causal slots."""
    from ..naive import _constant_tables

    logits = _PN.apply(q, k, params, dtype)
    _, valid, rel, all_valid = _constant_tables(params, torch.device(q.device), 0, q.shape[1])
    if rpb is not None:
        logits = logits + rpb.flatten(1)[:, rel].permute(1, 0, 2).to(dtype)  # [N, H, W]
    if not all_valid:
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return logits


def _plain_qk(params, q, k, rpb):
    """``QK`` from the differentiable operators (its recompute under ``create_graph=True``)."""
    return (_logits(q, k, rpb, params, q.dtype),)


def _plain_av(params, attn, v):
    return (_NN.apply(attn, v, params, v.dtype),)
