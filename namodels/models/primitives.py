"""The primitives of a NAT block, each defined once: its torch form and its tape form (forward, backward).

``ops`` is the primitive as ordinary differentiable torch ops and module calls (what ``torch.compile``, export,
``jit.trace`` and functorch record, and what eager mode runs where the tape cannot, see ``tape.py``).  ``forward``
and ``backward`` are the same math for the tape: ``forward(...)`` returns ``(outputs, saved, meta)`` (``saved``: the
tensors its backward reads, None where nothing is recorded), ``backward(meta, saved, grads, needs)`` the gradients of
its tensor inputs in order (None where ``needs`` says none is wanted).  A primitive with ``ACCUMULATES`` also takes
the gradient its first input already has (and whether the tape owns that buffer) and returns the sum, so that a
kernel can add it in.

Tape precision (as the hand-written block had it): LayerNorm statistics in float32 with the normalised rows written
in the compute dtype, residual joins and layer scales in float32, weight and bias gradients reduced in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.functional import neighborhood_attention_qkvpacked
from ops.layer_norm import layer_norm_backward, layer_norm_forward
from ops.unfused import na_av, na_qk

try:
    from ops.fused import launch as fused_launch
    from ops.fused import op as fused_op
except ImportError:  # torch without Triton: no fused kernels, the tape never runs
    fused_launch = fused_op = None

_gelu_backward = torch.ops.aten.gelu_backward.default


def branch_scale(y, mask, gamma):
    """A residual branch ``y`` times its layer scale ``gamma [C]`` and per-sample stochastic-depth ``mask [B]``."""
    if gamma is not None:
        y = gamma * y
    if mask is not None:
        y = y * mask.view(-1, *([1] * (y.dim() - 1)))
    return y


class LayerNorm:
    """``norm(x)``; with ``add``: ``s = x + mask[sample] * gamma * add`` (a pre-norm block's residual join, fused
    into the next norm), returns ``(norm(s), s)``.  Tape inputs: ``(x, weight, bias[, add[, gamma]])``."""

    ACCUMULATES = True

    @staticmethod
    def ops(norm, x, add=None, mask=None, gamma=None):
        if add is None:
            return norm(x)
        x = x + branch_scale(add, mask, gamma)
        return norm(x), x

    @staticmethod
    def forward(x, weight, bias, eps, dtype, add, mask, gamma, save: bool, gamma_grad: bool):
        shape, C = x.shape, x.shape[-1]
        x2d = x.view(-1, C)
        if add is None:
            y, stats = layer_norm_forward(x2d, weight, bias, eps, dtype)
            return (y.view(shape),), ((x2d, weight, stats) if save else None), (shape, None)
        y, stats, total = layer_norm_forward(x2d, weight, bias, eps, dtype, add=add.view(-1, C), add_scale=mask,
                                             add_gamma=gamma)
        saved = (total, weight, stats, mask, gamma, add.view(-1, C) if gamma_grad else None) if save else None
        return (y.view(shape), total.view(shape)), saved, (shape, add.dtype)

    @staticmethod
    def backward(meta, saved, grads, needs, acc, acc_owned: bool):
        shape, add_dtype = meta
        C = shape[-1]
        dy = grads[0]
        if add_dtype is None:
            x2d, weight, stats = saved
            dy = torch.zeros(x2d.shape, dtype=torch.float32, device=x2d.device) if dy is None else dy.reshape(-1, C)
            residual = None if acc is None else acc.view(-1, C)
            dx, dw, db = layer_norm_backward(dy, x2d, weight, stats, compute_dx=needs[0], compute_dweight=needs[1],
                                             compute_dbias=needs[2], residual=residual,
                                             out=residual if acc_owned else None)
            return None if dx is None else dx.view(shape), dw, db
        total, weight, stats, mask, gamma, add = saved
        if dy is None:
            dy = torch.zeros(total.shape, dtype=torch.float32, device=total.device)
        # the gradient of the sum s reaches x and, scaled, the branch; what s already got (the next residual's
        # skip connection) and what x already has are added in by the kernel
        residual = grads[1]
        if acc is not None:
            residual = acc if residual is None else residual + acc
        want_branch = needs[3] or (len(needs) > 4 and needs[4])
        want_dgamma = len(needs) > 4 and needs[4]
        result = layer_norm_backward(dy.reshape(-1, C), total, weight, stats, compute_dx=needs[0] or want_branch,
                                     compute_dweight=needs[1], compute_dbias=needs[2],
                                     residual=None if residual is None else residual.reshape(-1, C),
                                     copy_dtype=add_dtype if want_branch else None, copy_scale=mask,
                                     copy_gamma=gamma, gamma_input=add if want_dgamma else None)
        dx, dw, db = result[:3]
        d_add = result[3].view(shape) if want_branch and needs[3] else None
        dgamma = result[4] if want_dgamma else None
        return (dx.view(shape) if needs[0] else None), dw, db, d_add, dgamma


# per CUDA device: whether torch's mm writes float32 from 16-bit inputs (``out_dtype=``)
_MM_OUT_DTYPE: dict = {}


def mm_float32(a, b):
    """``a @ b`` as float32: written so by the GEMM where torch has ``mm(..., out_dtype=)`` (CUDA), else cast."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        ok = _MM_OUT_DTYPE.get(a.device)
        if ok is None:
            try:
                torch.mm(a[:1, :1], b[:1, :1], out_dtype=torch.float32)
                ok = True
            except (TypeError, RuntimeError, NotImplementedError):
                ok = False
            _MM_OUT_DTYPE[a.device] = ok
        if ok:
            return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b).float()


class Linear:
    """``x @ weight.T + bias`` over the last dim.  Tape inputs: ``(x, weight, bias)``; the tape's weight and bias
    may be casts of the parameters (their gradients, float32, are the parameters')."""

    ACCUMULATES = False

    @staticmethod
    def ops(layer, x):
        return layer(x)

    @staticmethod
    def forward(x, weight, bias, save: bool):
        x2d = x.reshape(-1, x.shape[-1])
        out = torch.addmm(bias, x2d, weight.t())
        return (out.view(*x.shape[:-1], out.shape[-1]),), ((x2d, weight) if save else None), x.shape

    @staticmethod
    def backward(shape, saved, grads, needs):
        x2d, weight = saved
        dy = grads[0].reshape(-1, weight.shape[0])
        d_in = torch.mm(dy, weight).view(shape) if needs[0] else None
        d_weight = mm_float32(dy.t(), x2d) if needs[1] else None
        d_bias = dy.sum(0, dtype=torch.float32) if needs[2] else None
        return d_in, d_weight, d_bias


class Gelu:
    """Exact GELU.  Tape inputs: ``(x,)``."""

    ACCUMULATES = False

    @staticmethod
    def ops(act, x):
        return act(x)

    @staticmethod
    def forward(x, save: bool):
        return (F.gelu(x),), ((x,) if save else None), None

    @staticmethod
    def backward(meta, saved, grads, needs):
        return (_gelu_backward(grads[0], saved[0]),)


class Pad:
    """A ``[B, H, W, C]`` map zero-padded after its end to ``[B, Hp, Wp, C]``.  Tape inputs: ``(x,)``."""

    ACCUMULATES = False

    @staticmethod
    def ops(x, Hp: int, Wp: int):
        return F.pad(x, (0, 0, 0, Wp - x.shape[2], 0, Hp - x.shape[1]))

    @staticmethod
    def forward(x, Hp: int, Wp: int, save: bool):
        return (Pad.ops(x, Hp, Wp),), (), (x.shape[1], x.shape[2])

    @staticmethod
    def backward(size, saved, grads, needs):
        H, W = size
        return (grads[0][:, :H, :W].contiguous(),)


class Crop:
    """The ``[B, H, W, C]`` start of a padded map.  Tape inputs: ``(x,)``."""

    ACCUMULATES = False

    @staticmethod
    def ops(x, H: int, W: int):
        return x[:, :H, :W]

    @staticmethod
    def forward(x, H: int, W: int, save: bool):
        return (x[:, :H, :W].contiguous(),), (), (x.shape[1], x.shape[2])

    @staticmethod
    def backward(size, saved, grads, needs):
        return (Pad.ops(grads[0], *size),)


class Attention:
    """Neighborhood attention of packed ``qkv [B, H, W, 3C]`` (q, k, v, heads, head dim), output ``[B, H, W, C]``.
    Tape inputs: ``(qkv, rpb)``; the tape runs the fused kernels."""

    ACCUMULATES = False

    @staticmethod
    def ops(parts, qkv, dilation):
        attn = parts.attn
        B, H, W, _ = qkv.shape
        qkv = qkv.reshape(B, H, W, 3, attn.num_heads, attn.head_dim)
        if attn.training and parts.attn_drop.p > 0:
            # dropout needs the attention weights: unfused qk -> softmax -> dropout -> av
            q, k, v = qkv.unbind(-3)
            logits = na_qk(2, q * attn.head_dim ** -0.5, k, attn.kernel_size, attn.stride, dilation, attn.is_causal,
                           rpb=attn.rpb)
            weights = parts.attn_drop(torch.softmax(logits.float(), dim=-1).to(q.dtype))
            out = na_av(2, weights, v, attn.kernel_size, attn.stride, dilation, attn.is_causal)
        else:
            out = neighborhood_attention_qkvpacked(2, qkv, attn.kernel_size, attn.stride, dilation, attn.is_causal,
                                                   rpb=attn.rpb, backend=attn.backend)
        return out.reshape(B, H, W, attn.dim)

    @staticmethod
    def forward(qkv, rpb, params, scale: float, heads: int, save: bool):
        B, H, W, C3 = qkv.shape
        packed = qkv.view(B, H, W, 3, heads, C3 // (3 * heads))
        if save:
            # training: no host-built TMA descriptors, whose host time an eager training step cannot hide (their GPU
            # saving is smaller there; docs/performance.md)
            q, k, v = packed.unbind(-3)
            out, lse = fused_launch.forward(q, k, v, rpb, params, scale, host_descriptors=False)
            saved = (packed, rpb, out, lse)
        else:
            out, _ = fused_op.attention_qkvpacked(packed, params, rpb, scale, need_lse=False)
            saved = None
        return (out.view(B, H, W, C3 // 3),), saved, (params, scale)

    @staticmethod
    def backward(meta, saved, grads, needs):
        params, scale = meta
        packed, rpb, out, lse = saved
        want_drpb = rpb is not None and needs[1]
        d_qkv, d_rpb = fused_op.packed_gradients(packed, rpb, out, lse, grads[0].reshape(out.shape), None, params,
                                                 scale, fused_op.drpb_deterministic(), want_drpb,
                                                 host_descriptors=False)
        B, H, W = packed.shape[:3]
        return d_qkv.view(B, H, W, -1), (d_rpb if want_drpb else None)


class Residual:
    """``x + mask[sample] * gamma * y``: a residual join (x float32 for the tape, y in the compute dtype).  Tape
    inputs: ``(x, y[, gamma])``."""

    ACCUMULATES = False

    @staticmethod
    def ops(x, y, mask, gamma):
        return x + branch_scale(y, mask, gamma)

    @staticmethod
    def forward(x, y, mask, gamma, save: bool, gamma_grad: bool):
        B, C = x.shape[0], x.shape[-1]
        if mask is None and gamma is None:
            out, scale = torch.add(x, y), None
        else:
            # one float32 factor per sample and channel (or per sample, or per channel)
            scale = mask.view(B, 1, 1) if gamma is None else gamma if mask is None else \
                (mask.view(B, 1) * gamma).view(B, 1, C)
            out = torch.addcmul(x.view(B, -1, C), y.view(B, -1, C), scale).view(x.shape)
        saved = (scale, mask, y if gamma_grad else None) if save else None
        return (out,), saved, (x.shape, y.dtype)

    @staticmethod
    def backward(meta, saved, grads, needs):
        (shape, dtype), (scale, mask, y) = meta, saved
        d = grads[0]
        B, C = shape[0], shape[-1]
        dy = None
        if needs[1]:
            if scale is None:
                dy = d.to(dtype)
            else:
                dy = torch.empty(shape, dtype=dtype, device=d.device)
                torch.mul(d.view(B, -1, C), scale, out=dy.view(B, -1, C))  # product and cast: one op
        dgamma = None
        if len(needs) > 2 and needs[2]:
            per_sample = (d.view(B, -1, C) * y.view(B, -1, C)).sum(1, dtype=torch.float32)
            dgamma = per_sample.sum(0) if mask is None else torch.mv(per_sample.t(), mask)
        return d, dy, dgamma
