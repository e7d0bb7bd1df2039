"""A NAT block run as one autograd function in eager mode, on the fused NA kernels.

An eager step issues every op of every block from the host, and NAT-Tiny has 30 blocks where Swin-T has 12: at
NAT's small feature maps the host, not the GPU, bounds an eager training step.  Run as modules, a block pays for
about a dozen module calls, autocast's per-tensor casts, timm's drop-path arithmetic and a backward graph of one
autograd node per op.  Here the block is one node:

* forward: two LayerNorms, four GEMMs with the bias added in (``addmm``), GELU, the fused NA kernels, and each
  residual with its stochastic-depth scale as one ``addcmul``;
* backward: the GEMMs write float32 weight gradients directly where torch has ``mm(..., out_dtype=)`` (CUDA), bias
  gradients are float32 sums, and the NA gradient is the fused backward writing the packed qkv gradient.

The math is the modules' under autocast (LayerNorm in float32, GEMMs, GELU and attention in the autocast dtype),
except where this path is more precise: weight and bias gradients reduced in float32, and the stochastic-depth scale
applied in float32.  The random draws of stochastic depth differ from timm's ``DropPath`` (one draw per block for
both residuals), with the same distribution.

:func:`plan` decides per call whether a block can take this path; every other case runs the modules: traced code
(``torch.compile`` fuses the modules better), attention or MLP dropout while training, layer scale, feature maps
that need padding, submodules with hooks or of other types (``fast_norm``'s LayerNorm, a parametrised Linear),
another NA backend.  ``ENABLED = False`` turns the path off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp
from torch import nn
from torch.nn.modules import module as _module_hooks

from ops.backends import Problem, current_backend, select_backend
from ops.functional import make_params
from ops.layer_norm import layer_norm_backward, layer_norm_forward
from ops.window import NAParams

try:
    from ops.fused import launch as fused_launch
    from ops.fused import op as fused_op
except ImportError:  # torch without Triton: no fused kernels, every block runs its modules
    fused_launch = fused_op = None

from . import layers  # (imports this module first: fit_window is looked up per decision)

ENABLED = fused_op is not None

_gelu_backward = torch.ops.aten.gelu_backward.default


@dataclass(frozen=True)
class BlockPlan:
    """What one block call runs with: the NA window (dilation after ``fit_window``), the compute dtype of the GEMMs
    and attention (the autocast dtype, or the input's), and whether it builds an autograd node."""

    params: NAParams
    scale: float
    heads: int
    dtype: torch.dtype
    autocast: bool
    grad: bool


def _no_hooks(modules) -> bool:
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
    return not (_module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks
                or _module_hooks._global_backward_hooks or _module_hooks._global_backward_pre_hooks)


def _inactive(dropout: nn.Module) -> bool:
    return isinstance(dropout, nn.Identity) or (type(dropout) in (nn.Dropout, DropPath) and (
        not dropout.training or getattr(dropout, "p", getattr(dropout, "drop_prob", 0.0)) == 0))


def _is_linear(m, bias_needed: bool = True) -> bool:
    return type(m) is nn.Linear and (m.bias is not None or not bias_needed)


def _is_layer_norm(m, dim: int) -> bool:
    return (type(m) is nn.LayerNorm and m.elementwise_affine and m.bias is not None
            and tuple(m.normalized_shape) == (dim,))


def _structure_fits(block) -> bool:
    """The block is the plain pre-norm NAT block this path computes (no layer scale, no active dropout, exact
    module types, no hooks, no parametrisations)."""
    attn, mlp = block.attn, block.mlp
    if block.layer_scale or attn.is_causal != (False, False) or not isinstance(mlp, Mlp):
        return False
    if not (_is_layer_norm(block.norm1, attn.dim) and _is_layer_norm(block.norm2, attn.dim)):
        return False
    if not (_is_linear(attn.qkv) and _is_linear(attn.proj) and _is_linear(mlp.fc1) and _is_linear(mlp.fc2)):
        return False
    if type(mlp.act) is not nn.GELU or mlp.act.approximate != "none" or not isinstance(mlp.norm, nn.Identity):
        return False
    if not all(_inactive(d) for d in (attn.attn_drop, attn.proj_drop, mlp.drop1, mlp.drop2)):
        return False
    if not (isinstance(block.drop_path, nn.Identity) or type(block.drop_path) is DropPath):
        return False
    modules = (block.norm1, attn, attn.qkv, attn.proj, attn.attn_drop, attn.proj_drop, block.drop_path, block.norm2,
               mlp, mlp.fc1, mlp.act, mlp.drop1, mlp.norm, mlp.fc2, mlp.drop2)
    return _no_hooks(modules) and not any(getattr(m, "parametrizations", None) for m in modules)


def _parameters(block) -> tuple:
    attn, mlp = block.attn, block.mlp
    return (block.norm1.weight, block.norm1.bias, attn.qkv.weight, attn.qkv.bias, attn.rpb, attn.proj.weight,
            attn.proj.bias, block.norm2.weight, block.norm2.bias, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight,
            mlp.fc2.bias)


def plan(block, x: torch.Tensor) -> BlockPlan | None:
    """How ``block`` runs ``x`` on this path, or None where it must run its modules."""
    if not ENABLED or torch._C._are_functorch_transforms_active():
        return None
    if x.dim() != 4 or not x.is_contiguous() or not _structure_fits(block):
        return None
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    grad = torch.is_grad_enabled() and (x.requires_grad or any(
        p is not None and p.requires_grad for p in _parameters(block)))
    key = (x.shape, x.dtype, x.device, autocast, torch.get_autocast_dtype(device) if autocast else None, grad,
           block.attn.backend, current_backend(), block.norm1.weight.dtype)
    cache = block.__dict__.setdefault("_eager_plans", {})
    if key not in cache:
        cache[key] = _decide(block, x, autocast, grad) if len(cache) < 64 else None
    return cache[key]


def _decide(block, x, autocast: bool, grad: bool) -> BlockPlan | None:
    attn = block.attn
    param_dtype = block.norm1.weight.dtype
    if any(p is not None and p.dtype != param_dtype for p in _parameters(block)):
        return None
    if autocast:
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != torch.float32 or param_dtype != torch.float32:
            return None
    else:
        dtype = x.dtype
        if param_dtype != dtype:
            return None
    H, W = x.shape[1], x.shape[2]
    dilation, padded = layers.fit_window((H, W), attn.kernel_size, attn.dilation, attn.dilation_mode)
    if padded != (H, W) or attn.stride != (1, 1):
        return None
    params = make_params((H, W), attn.kernel_size, 1, dilation, False)
    problem = Problem(params=params, dtype=dtype, device=x.device, head_dim=attn.head_dim, value_dim=attn.head_dim,
                      heads_q=attn.num_heads, heads_kv=attn.num_heads, has_rpb=attn.rpb is not None,
                      requires_grad=grad)
    try:
        backend = select_backend(problem, attn.backend)
    except ValueError:  # the module path raises it with the call's context
        return None
    if backend.name != "fused":
        return None
    return BlockPlan(params, attn.head_dim ** -0.5, attn.num_heads, dtype, autocast, grad)


def run(block, x: torch.Tensor, block_plan: BlockPlan) -> torch.Tensor:
    """The block's output for ``x`` along ``block_plan`` (from :func:`plan`)."""
    masks = None
    if block.training and type(block.drop_path) is DropPath and block.drop_path.drop_prob > 0:
        keep = 1.0 - block.drop_path.drop_prob
        masks = torch.empty((2, x.shape[0]), dtype=torch.float32, device=x.device).bernoulli_(keep)
        if block.drop_path.scale_by_keep:
            masks.div_(keep)
    weights = _parameters(block)
    eps = (block.norm1.eps, block.norm2.eps)
    device = x.device.type
    if block_plan.autocast:  # the body casts explicitly; autocast would also widen addcmul's bf16 input
        torch.set_autocast_enabled(device, False)
    try:
        if block_plan.grad:
            return _BlockFunction.apply(x, masks, block_plan, eps, *weights)
        return _forward(x, masks, block_plan, eps, weights, save=False)[0]
    finally:
        if block_plan.autocast:
            torch.set_autocast_enabled(device, True)


def _residual(x2d, y, mask, batch: int):
    """``x + mask[b] * y`` per sample (float32 out), or ``x + y`` without stochastic depth."""
    if mask is None:
        return torch.add(x2d, y)
    C = x2d.shape[-1]
    return torch.addcmul(x2d.view(batch, -1, C), y.view(batch, -1, C), mask.view(batch, 1, 1)).view(-1, C)


def _cast(tensors, dtype):
    """The tensors in ``dtype``: one multi-tensor copy where torch's per-tensor casts would be one op each."""
    if all(t.dtype == dtype for t in tensors):
        return tensors
    out = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in tensors]
    torch._foreach_copy_(out, list(tensors))
    return out


def _forward(x, masks, block_plan: BlockPlan, eps, weights, save: bool):
    (n1_w, n1_b, qkv_w, qkv_b, rpb, proj_w, proj_b, n2_w, n2_b, fc1_w, fc1_b, fc2_w, fc2_b) = weights
    dtype = block_plan.dtype
    B, H, W, C = x.shape
    heads = block_plan.heads
    qkv_w, qkv_b, proj_w, proj_b, fc1_w, fc1_b, fc2_w, fc2_b = _cast(
        (qkv_w, qkv_b, proj_w, proj_b, fc1_w, fc1_b, fc2_w, fc2_b), dtype)
    x2d = x.view(-1, C)
    # LayerNorm statistics in float32, the normalised rows written in the GEMMs' dtype by the same kernel
    n1, stats1 = layer_norm_forward(x2d, n1_w, n1_b, eps[0], dtype)
    qkv = torch.addmm(qkv_b, n1, qkv_w.t()).view(B, H, W, 3, heads, C // heads)
    q, k, v = qkv.unbind(-3)
    if save:
        out, lse = fused_launch.forward(q, k, v, rpb, block_plan.params, block_plan.scale)
    else:
        out, lse = fused_op.attention_qkvpacked(qkv, block_plan.params, rpb, block_plan.scale, need_lse=False)
    out2d = out.view(-1, C)
    x1 = _residual(x2d, torch.addmm(proj_b, out2d, proj_w.t()), None if masks is None else masks[0], B)
    n2, stats2 = layer_norm_forward(x1, n2_w, n2_b, eps[1], dtype)
    h = torch.addmm(fc1_b, n2, fc1_w.t())
    g = F.gelu(h)
    x2 = _residual(x1, torch.addmm(fc2_b, g, fc2_w.t()), None if masks is None else masks[1], B).view(B, H, W, C)
    saved = (x2d, stats1, n1, qkv_w, qkv, out, lse, proj_w, x1, stats2, n2, fc1_w, h, g, fc2_w) if save else None
    return x2, saved


# mm writing float32 from bfloat16 / float16 inputs (CUDA in torch >= 2.8): weight gradients without a cast
_MM_OUT_DTYPE: dict[torch.device, bool] = {}


def _mm_float32(a, b):
    """``a @ b`` as float32."""
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


def _linear_grads(dy, inp, weight, needs_weight: bool, needs_bias: bool):
    """``(d input, d weight, d bias)`` of ``inp @ weight.T + bias``; the parameter gradients float32."""
    d_inp = torch.mm(dy, weight)
    d_weight = _mm_float32(dy.t(), inp) if needs_weight else None
    d_bias = dy.sum(0, dtype=torch.float32) if needs_bias else None
    return d_inp, d_weight, d_bias


def _branch_grad(d, mask, dtype, batch: int):
    """The gradient reaching a residual branch's output: ``d * mask[b]``, in the compute dtype."""
    if mask is None:
        return d.to(dtype)
    C = d.shape[-1]
    out = torch.empty(d.shape, dtype=dtype, device=d.device)
    torch.mul(d.view(batch, -1, C), mask.view(batch, 1, 1), out=out.view(batch, -1, C))  # product and cast: one op
    return out


class _BlockFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, masks, block_plan: BlockPlan, eps, *weights):
        x2, saved = _forward(x, masks, block_plan, eps, weights, save=True)
        n1_w, _, _, _, rpb, _, _, n2_w, _ = weights[:9]
        ctx.save_for_backward(*saved, masks, rpb, n1_w, n2_w)
        ctx.block_plan, ctx.shape = block_plan, x.shape
        return x2

    @staticmethod
    def backward(ctx, d_x2):
        (x2d, stats1, n1, qkv_w, qkv, out, lse, proj_w, x1, stats2, n2, fc1_w, h, g, fc2_w, masks, rpb, n1_w,
         n2_w) = ctx.saved_tensors
        block_plan = ctx.block_plan
        needs = ctx.needs_input_grad[4:]  # per weight, in _parameters' order
        dtype, (B, H, W, C) = block_plan.dtype, ctx.shape
        mask1, mask2 = (None, None) if masks is None else (masks[0], masks[1])
        d = d_x2.reshape(-1, C)

        # MLP branch: x2 = x1 + mask2 * fc2(gelu(fc1(norm2(x1))))
        dy2 = _branch_grad(d, mask2, dtype, B)
        dg, d_fc2_w, d_fc2_b = _linear_grads(dy2, g, fc2_w, needs[11], needs[12])
        dh = _gelu_backward(dg, h)
        dn2, d_fc1_w, d_fc1_b = _linear_grads(dh, n2, fc1_w, needs[9], needs[10])
        dx1, d_n2_w, d_n2_b = layer_norm_backward(dn2, x1, n2_w, stats2, compute_dweight=needs[7],
                                                  compute_dbias=needs[8])
        dx1 = dx1.add_(d)

        # attention branch: x1 = x + mask1 * proj(na(qkv(norm1(x))))
        dy1 = _branch_grad(dx1, mask1, dtype, B)
        d_out, d_proj_w, d_proj_b = _linear_grads(dy1, out.view(-1, C), proj_w, needs[5], needs[6])
        want_drpb = rpb is not None and needs[4]
        d_qkv, d_rpb = fused_op._packed_gradients(qkv, rpb, out, lse, d_out.view(out.shape), None, block_plan.params,
                                                  block_plan.scale, fused_op._deterministic(), want_drpb)
        d_qkv = d_qkv.view(-1, 3 * C)
        dn1, d_qkv_w, d_qkv_b = _linear_grads(d_qkv, n1, qkv_w, needs[2], needs[3])
        dx, d_n1_w, d_n1_b = layer_norm_backward(dn1, x2d, n1_w, stats1, compute_dx=ctx.needs_input_grad[0],
                                                 compute_dweight=needs[0], compute_dbias=needs[1])
        dx = dx.add_(dx1).view(B, H, W, C) if dx is not None else None
        return (dx, None, None, None, d_n1_w, d_n1_b, d_qkv_w, d_qkv_b, d_rpb if want_drpb else None, d_proj_w,
                d_proj_b, d_n2_w, d_n2_b, d_fc1_w, d_fc1_b, d_fc2_w, d_fc2_b)
