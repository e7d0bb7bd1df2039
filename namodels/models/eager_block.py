"""A NAT block run as one autograd function in eager mode, on the fused NA kernels.

An eager step issues every op of every block from the host, and NAT-Tiny has 30 blocks where Swin-T has 12: at
NAT's small feature maps the host, not the GPU, bounds an eager training step.  Run as modules, a block pays for
about a dozen module calls, autocast's per-tensor casts, timm's drop-path arithmetic and a backward graph of one
autograd node per op.  Here the block is one node:

* forward: the block's GEMM weights cast by one multi-tensor copy per stage (``stage_casts``), two LayerNorms on the
  project's Triton kernel (float32 statistics, the normalised rows written in the GEMMs' dtype, launched through
  planned compiled kernels), four GEMMs with the bias added in (``addmm``), GELU, the fused NA kernels; the attention
  branch joins the skip connection (with its stochastic-depth scale) inside the second LayerNorm, the MLP branch as
  one ``addcmul``;
* backward: the GEMMs write float32 weight gradients directly where torch has ``mm(..., out_dtype=)`` (CUDA), bias
  gradients are float32 sums, and the NA gradient is the fused backward writing the packed qkv gradient.

The math is the modules' under autocast (LayerNorm in float32, GEMMs, GELU and attention in the autocast dtype),
except where this path is more precise: weight and bias gradients reduced in float32, and the stochastic-depth scale
applied in float32.  The random draws of stochastic depth differ from timm's ``DropPath`` (one draw per block for
both residuals), with the same distribution.

:func:`plan` decides per call whether a block can take this path; every other case runs the modules: traced code
(``torch.compile`` fuses the modules better; ``torch.export``, ONNX export and ``torch.jit.trace`` can record only
tensor ops, which this autograd function and its cached plans are not), attention or MLP dropout while training,
layer scale, strided or causal attention, feature maps that need padding, submodules with hooks or of other types
(``fast_norm``'s LayerNorm, a parametrised Linear), another NA backend.  ``ENABLED = False`` turns the path off.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator
import weakref
from dataclasses import dataclass
from weakref import WeakKeyDictionary

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


def _submodules(block) -> tuple | None:
    """``(norm1, attn, qkv, proj, attn_drop, proj_drop, drop_path, norm2, mlp, fc1, act, drop1, norm, fc2, drop2)``:
    every module the path stands in for, read from the module dicts (``nn.Module.__getattr__`` is a slow per-call
    lookup), or None where the block is built otherwise."""
    top = block._modules
    try:
        attn, mlp = top["attn"]._modules, top["mlp"]._modules
        return (top["norm1"], top["attn"], attn["qkv"], attn["proj"], attn["attn_drop"], attn["proj_drop"],
                top["drop_path"], top["norm2"], top["mlp"], mlp["fc1"], mlp["act"], mlp["drop1"], mlp["norm"],
                mlp["fc2"], mlp["drop2"])
    except (KeyError, AttributeError):
        return None


def _is_linear(m) -> bool:
    return type(m) is nn.Linear and m.bias is not None


def _is_layer_norm(m, dim: int) -> bool:
    return (type(m) is nn.LayerNorm and m.elementwise_affine and m.bias is not None
            and tuple(m.normalized_shape) == (dim,))


def _built_as_computed(modules) -> bool:
    """The modules are those of the plain pre-norm NAT block this path computes: exact types (so no parametrised or
    swapped layer), affine LayerNorms, biased Linears, exact GELU, dropouts and stochastic depth of torch / timm."""
    norm1, attn, qkv, proj, attn_drop, proj_drop, drop_path, norm2, mlp, fc1, act, drop1, norm, fc2, drop2 = modules
    return (type(attn) is layers.NeighborhoodAttention2D and attn.is_causal == (False, False) and type(mlp) is Mlp
            and _is_layer_norm(norm1, attn.dim) and _is_layer_norm(norm2, attn.dim)
            and all(_is_linear(m) for m in (qkv, proj, fc1, fc2))
            and type(act) is nn.GELU and act.approximate == "none" and type(norm) is nn.Identity
            and all(type(m) is nn.Dropout for m in (attn_drop, proj_drop, drop1, drop2))
            and type(drop_path) in (nn.Identity, DropPath))


def _cached_structure(block) -> tuple | None:
    """The block's submodules where they are built as this path computes them, else None; the type checks are kept
    per set of submodules and their classes (a parametrisation changes a module's class in place)."""
    modules = _submodules(block)
    if modules is None:
        return None
    key = (modules, tuple(map(type, modules)))
    cached = block.__dict__.get("_eager_structure")
    if cached is None or cached[0] != key:
        cached = (key, modules if _built_as_computed(modules) else None)
        block.__dict__["_eager_structure"] = cached
    return cached[1]


def _quiet(modules) -> bool:
    """No hooks on the modules or globally, no dropout that would drop (stochastic depth is computed here)."""
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
    if (_module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks
            or _module_hooks._global_backward_hooks or _module_hooks._global_backward_pre_hooks):
        return False
    for index in (4, 5, 11, 14):  # attn_drop, proj_drop, drop1, drop2
        dropout = modules[index]
        if dropout.training and dropout.p > 0:
            return False
    return True


def _parameters(modules) -> tuple:
    norm1, attn, qkv, proj, _, _, _, norm2, _, fc1, _, _, _, fc2, _ = modules
    return (norm1._parameters["weight"], norm1._parameters["bias"], qkv._parameters["weight"],
            qkv._parameters["bias"], attn._parameters["rpb"], proj._parameters["weight"], proj._parameters["bias"],
            norm2._parameters["weight"], norm2._parameters["bias"], fc1._parameters["weight"],
            fc1._parameters["bias"], fc2._parameters["weight"], fc2._parameters["bias"])


def plan(block, x: torch.Tensor) -> BlockPlan | None:
    """How ``block`` runs ``x`` on this path, or None where it must run its modules."""
    if not ENABLED or block.__dict__.get("layer_scale", True) or torch._C._are_functorch_transforms_active():
        return None
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # a graph records the modules' ops, not this function
        return None
    if x.dim() != 4 or not x.is_contiguous():
        return None
    modules = _cached_structure(block)
    if modules is None or not _quiet(modules):
        return None
    weights = _parameters(modules)
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    grad = torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in weights))
    key = (x.shape, x.dtype, x.device, autocast, torch.get_autocast_dtype(device) if autocast else None, grad,
           modules[1].backend, current_backend(), weights[0].dtype)
    cache = block.__dict__.setdefault("_eager_plans", {})
    block_plan = cache.get(key, False)
    if block_plan is False:
        block_plan = _decide(modules, weights, x, autocast, grad)
        if len(cache) < 64:
            cache[key] = block_plan
    return block_plan


def _decide(modules, weights, x, autocast: bool, grad: bool) -> BlockPlan | None:
    attn = modules[1]
    param_dtype = weights[0].dtype
    if any(p is not None and p.dtype != param_dtype for p in weights):
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
    modules = block.__dict__["_eager_structure"][1]  # (kept by plan)
    drop_path, masks = modules[6], None
    if drop_path.training and type(drop_path) is DropPath and drop_path.drop_prob > 0:
        keep = 1.0 - drop_path.drop_prob
        masks = torch.empty((2, x.shape[0]), dtype=torch.float32, device=x.device).bernoulli_(keep)
        if drop_path.scale_by_keep:
            masks.div_(keep)
    weights = _parameters(modules)
    eps = (modules[0].eps, modules[7].eps)
    device = x.device.type
    if block_plan.autocast:  # the body casts explicitly; autocast would also widen addcmul's bf16 input
        torch.set_autocast_enabled(device, False)
    try:
        if block_plan.grad:
            return _BlockFunction.apply(x, masks, block_plan, eps, block, *weights)
        return _forward(x, masks, block_plan, eps, weights, save=False, block=block)[0]
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
    # one allocation split into the casts (an allocation costs a few views' host time), each starting on a multiple
    # of 8 elements, so the GEMMs see aligned operands whatever the widths
    sizes = [-(-t.numel() // 8) * 8 for t in tensors]
    flat = torch.empty(sum(sizes), dtype=dtype, device=tensors[0].device)
    out = []
    for chunk, t in zip(flat.split(sizes), tensors):
        chunk = chunk if chunk.numel() == t.numel() else chunk[:t.numel()]
        out.append(chunk if t.dim() == 1 else chunk.view(t.shape))
    torch._foreach_copy_(out, list(tensors))
    return out


# The GEMM weights of a stage's blocks are cast together: the stage opens a scope (``stage_casts``) and the first block
# that needs a cast in it casts every block's weights in one multi-tensor copy, into a buffer kept per stage with each
# block's views into it, so that a block's cast costs a lookup instead of an allocation, eight views and a copy.  The
# buffer is refilled in place on the next call when nothing can still read it: the previous call's lease (a tensor
# every block saves for its backward) is gone, the call runs on the same stream, and no CUDA graph is being captured
# (a graph keeps reading the memory it captured).  Otherwise a new buffer is made.  Every call copies the current
# weights, so the casts follow any change to them, ``.data`` writes included.
_STAGE_CASTS: WeakKeyDictionary = WeakKeyDictionary()  # blocks container -> _StageBuffer
_SCOPE: contextvars.ContextVar = contextvars.ContextVar("namodels_stage_casts", default=None)


@dataclass
class _StageBuffer:
    """A stage's cast buffer: the weights it holds casts of, and each block's views into it."""

    sources: list  # the weights cast, in order
    shapes: list
    stream: int | None
    views: list  # the casts, one per source
    views_of: dict  # block -> its views
    lease: object = None  # weakref to the last call's lease


class _Scope:
    __slots__ = ("blocks", "members", "lease", "dtype")

    def __init__(self, blocks):
        self.blocks, self.members, self.lease, self.dtype = blocks, None, None, None


@contextlib.contextmanager
def stage_casts(blocks: nn.Module):
    """Runs ``blocks`` (a container of NAT blocks called in this scope) with their weight casts shared."""
    token = _SCOPE.set(_Scope(blocks))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _gemm_weights(modules) -> tuple:
    _, _, qkv, proj, _, _, _, _, _, fc1, _, _, _, fc2, _ = modules
    return (qkv._parameters["weight"], qkv._parameters["bias"], proj._parameters["weight"],
            proj._parameters["bias"], fc1._parameters["weight"], fc1._parameters["bias"],
            fc2._parameters["weight"], fc2._parameters["bias"])


def _stream_of(t: torch.Tensor):
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else None


def _fill_stage(blocks, dtype, device) -> tuple[dict, object]:
    """``(block -> (its weights, their versions, their casts), lease)``: the GEMM weights of every block of
    ``blocks`` on this path that needs a cast, cast in one copy into the stage's buffer (refilled in place where
    nothing can still read it)."""
    members, sources = {}, []
    for block in blocks._modules.values():
        modules = _cached_structure(block) if isinstance(block, layers.NATBlock) else None
        if modules is None:
            continue
        weights = _gemm_weights(modules)
        if weights[0].dtype == dtype or weights[0].device != device:
            continue
        members[block] = (weights, tuple([w._version for w in weights]))
        sources.extend(weights)
    if not sources:
        return {}, None
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    shapes = [w.shape for w in sources]
    stream = _stream_of(sources[0])
    buffer = _STAGE_CASTS.get(blocks)
    # (a buffer made under torch.inference_mode can only be written there, and one made outside it not refilled there)
    reusable = (buffer is not None and not capturing and buffer.views[0].dtype == dtype and buffer.stream == stream
                and buffer.views[0].is_inference() == torch.is_inference_mode_enabled()
                and (buffer.lease is None or buffer.lease() is None) and len(buffer.sources) == len(sources)
                and all(map(operator.is_, buffer.sources, sources)) and buffer.shapes == shapes)
    if reusable:
        torch._foreach_copy_(buffer.views, sources)
    else:
        views = _cast(sources, dtype)
        spans, start = {}, 0
        for block, (weights, _) in members.items():
            spans[block] = views[start:start + len(weights)]
            start += len(weights)
        buffer = _StageBuffer(sources, shapes, stream, views, spans)
        if not capturing:  # (memory a graph captured is not the eager calls' to reuse)
            _STAGE_CASTS[blocks] = buffer
    lease = torch.empty(0)
    buffer.lease = weakref.ref(lease)
    return {block: (weights, versions, buffer.views_of[block]) for block, (weights, versions) in members.items()}, lease


def _weight_casts(block, weights, dtype) -> tuple[list, object]:
    """``(the GEMM weights in dtype, the lease of the shared buffer they are views of, or None)``."""
    scope = _SCOPE.get()
    if scope is not None:
        if scope.members is None or scope.dtype != dtype:
            scope.members, scope.lease = _fill_stage(scope.blocks, dtype, weights[0].device)
            scope.dtype = dtype
        entry = scope.members.get(block)
        # (a hook outside the block's modules may have swapped or changed a weight since the stage's copy)
        if (entry is not None and all(map(operator.is_, entry[0], weights))
                and entry[1] == tuple([w._version for w in weights])):
            return entry[2], scope.lease
    return _cast(weights, dtype), None


def _forward(x, masks, block_plan: BlockPlan, eps, weights, save: bool, block):
    """The block's output, and what its backward needs where ``save`` (else None)."""
    (n1_w, n1_b, qkv_w, qkv_b, rpb, proj_w, proj_b, n2_w, n2_b, fc1_w, fc1_b, fc2_w, fc2_b) = weights
    dtype = block_plan.dtype
    B, H, W, C = x.shape
    heads = block_plan.heads
    gemm_weights = (qkv_w, qkv_b, proj_w, proj_b, fc1_w, fc1_b, fc2_w, fc2_b)
    (qkv_w, qkv_b, proj_w, proj_b, fc1_w, fc1_b, fc2_w, fc2_b), lease = _weight_casts(block, gemm_weights, dtype)
    x2d = x.view(-1, C)
    # LayerNorm statistics in float32, the normalised rows written in the GEMMs' dtype by the same kernel
    n1, stats1 = layer_norm_forward(x2d, n1_w, n1_b, eps[0], dtype)
    qkv = torch.addmm(qkv_b, n1, qkv_w.t()).view(B, H, W, 3, heads, C // heads)
    q, k, v = qkv.unbind(-3)
    if save:
        # training: no host-built TMA descriptors, whose host time an eager training step cannot hide (their GPU
        # saving is smaller there; docs/performance.md)
        out, lse = fused_launch.forward(q, k, v, rpb, block_plan.params, block_plan.scale, host_descriptors=False)
    else:
        out, lse = fused_op.attention_qkvpacked(qkv, block_plan.params, rpb, block_plan.scale, need_lse=False)
    # the attention branch joins the skip connection inside the second LayerNorm, which also writes the sum
    n2, stats2, x1 = layer_norm_forward(x2d, n2_w, n2_b, eps[1], dtype, add=torch.addmm(proj_b, out.view(-1, C),
                                        proj_w.t()), add_scale=None if masks is None else masks[0])
    h = torch.addmm(fc1_b, n2, fc1_w.t())
    g = F.gelu(h)
    x2 = _residual(x1, torch.addmm(fc2_b, g, fc2_w.t()), None if masks is None else masks[1], B).view(B, H, W, C)
    # (the lease keeps the stage's cast buffer from being refilled while this backward can still read it)
    saved = (x2d, stats1, n1, qkv_w, qkv, out, lse, proj_w, x1, stats2, n2, fc1_w, h, g, fc2_w, lease) if save else None
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
    def forward(ctx, x, masks, block_plan: BlockPlan, eps, block, *weights):
        x2, saved = _forward(x, masks, block_plan, eps, weights, save=True, block=block)
        n1_w, _, _, _, rpb, _, _, n2_w, _ = weights[:9]
        ctx.save_for_backward(*saved, masks, rpb, n1_w, n2_w)
        ctx.block_plan, ctx.shape = block_plan, x.shape
        return x2

    @staticmethod
    def backward(ctx, d_x2):
        (x2d, stats1, n1, qkv_w, qkv, out, lse, proj_w, x1, stats2, n2, fc1_w, h, g, fc2_w, _, masks, rpb, n1_w,
         n2_w) = ctx.saved_tensors
        block_plan = ctx.block_plan
        needs = ctx.needs_input_grad[5:]  # per weight, in _parameters' order
        dtype, (B, H, W, C) = block_plan.dtype, ctx.shape
        mask1, mask2 = (None, None) if masks is None else (masks[0], masks[1])
        d = d_x2.reshape(-1, C).contiguous()

        # MLP branch: x2 = x1 + mask2 * fc2(gelu(fc1(norm2(x1))))
        dy2 = _branch_grad(d, mask2, dtype, B)
        dg, d_fc2_w, d_fc2_b = _linear_grads(dy2, g, fc2_w, needs[11], needs[12])
        dh = _gelu_backward(dg, h)
        dn2, d_fc1_w, d_fc1_b = _linear_grads(dh, n2, fc1_w, needs[9], needs[10])
        # (the kernel adds the skip connection's gradient, and writes the attention branch's: dx1 * mask1)
        dx1, d_n2_w, d_n2_b, dy1 = layer_norm_backward(dn2, x1, n2_w, stats2, compute_dweight=needs[7],
                                                       compute_dbias=needs[8], residual=d, copy_dtype=dtype,
                                                       copy_scale=mask1)

        # attention branch: x1 = x + mask1 * proj(na(qkv(norm1(x))))
        d_out, d_proj_w, d_proj_b = _linear_grads(dy1, out.view(-1, C), proj_w, needs[5], needs[6])
        want_drpb = rpb is not None and needs[4]
        d_qkv, d_rpb = fused_op.packed_gradients(qkv, rpb, out, lse, d_out.view(out.shape), None, block_plan.params,
                                                 block_plan.scale, fused_op.drpb_deterministic(), want_drpb,
                                                 host_descriptors=False)
        d_qkv = d_qkv.view(-1, 3 * C)
        dn1, d_qkv_w, d_qkv_b = _linear_grads(d_qkv, n1, qkv_w, needs[2], needs[3])
        dx, d_n1_w, d_n1_b = layer_norm_backward(dn1, x2d, n1_w, stats1, compute_dx=ctx.needs_input_grad[0],
                                                 compute_dweight=needs[0], compute_dbias=needs[1], residual=dx1,
                                                 out=dx1)
        dx = dx.view(B, H, W, C) if dx is not None else None
        return (dx, None, None, None, None, d_n1_w, d_n1_b, d_qkv_w, d_qkv_b, d_rpb if want_drpb else None, d_proj_w,
                d_proj_b, d_n2_w, d_n2_b, d_fc1_w, d_fc1_b, d_fc2_w, d_fc2_b)
