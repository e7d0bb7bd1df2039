"""Runs a NAT block (``block.block_forward``) in eager mode as ONE autograd node, from the same definition.

An eager step issues every op of every block from the host, and NAT-Tiny has 30 blocks where Swin-T has 12: at
NAT's small feature maps the host, not the GPU, bounds an eager training step.  Run through autograd op by op, a
block pays for a dozen module calls, autocast's per-tensor casts, the stochastic-depth arithmetic and a backward graph
of one node per op.  Here :class:`TapeExecutor` runs the block function with each primitive's tape form
(``primitives.py``): the forward runs the kernels and records on a tape what each backward needs; the block's
``autograd.Function`` saves the tape's tensors and its backward replays the primitives' backwards in reverse order,
routing gradients between them.  What makes it light: the GEMM weights cast by one multi-tensor copy per stage
(``stage_casts.py``), both LayerNorms on the project's Triton kernel with the first residual join (its stochastic-depth
and layer scales) fused into the second, GEMMs with the bias added in (``addmm``), float32 weight gradients written
by the GEMM (``mm(..., out_dtype=float32)`` where torch has it), the fused NA kernels without host-built TMA
descriptors while training.  Inference (nothing needs a gradient) runs the same forward with no tape and nothing
saved.

The rule (:func:`route`): the tape runs in eager mode when the block is built as it computes (exact module types,
fast_norm's LayerNorm included), nothing is hooked, no dropout is active and the fused backend serves the attention.
Every other call runs the block function with ``block.OPS``, the primitives' torch forms: traced code
(``torch.compile``, export, ``jit.trace``: graphs record plain ops), functorch transforms and forward-mode AD (the
tape's kernels have no tangent rule), attention dropout while training (which needs the attention weights: the
unfused route), hooks, parametrised or swapped layers (called as modules), other NA backends.  Each call sets ``block.path`` (``"tape"`` or ``"ops"``) and ``block.path_reason`` (why
not the tape, else None), and each reason is logged once per block at DEBUG level (eager calls; compiled code runs
no Python per call).  ``ENABLED = False`` turns the tape off.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as _forward_ad
from timm.layers import DropPath, Mlp
from torch import nn
from torch.nn.modules import module as _module_hooks

from ops import dense_window
from ops.backends import Problem, current_backend, select_backend
from ops.functional import make_params
from ops.layer_norm import MAX_COLUMNS, SUPPORTED_DTYPES
from ops.layer_norm import LayerNorm as FastLayerNorm
from ops.window import NAParams

from . import block as B
from . import layers  # (imports this module first: its classes are looked up per call)
from . import primitives as P
from . import stage_casts

ENABLED = P.fused_op is not None
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockSettings:
    """What one block call runs with: the NA window of the padded map, the compute dtype of the GEMMs and attention
    (the autocast dtype, or the input's), and whether it builds an autograd node."""

    params: NAParams
    scale: float
    heads: int
    dtype: torch.dtype
    autocast: bool
    grad: bool


class Var:
    """A tensor of the recorded block and its tape key (the slot of its gradient)."""

    __slots__ = ("t", "key")

    def __init__(self, t, key: int):
        self.t, self.key = t, key

    @property
    def shape(self):
        return self.t.shape

    @property
    def device(self):
        return self.t.device


def _t(v):
    return v.t if type(v) is Var else v


class TapeExecutor:
    """Runs the primitives' tape forms; where ``record``, values are :class:`Var` and each call is noted on the tape
    (``entries``: backward, meta, where its saved tensors start in ``saved`` and how many, input and output keys)."""

    def __init__(self, settings: BlockSettings, casts: dict, keys: dict, requires: list | None):
        # casts: GEMM layer -> (weight, bias) in settings.dtype; keys: id of a differentiated tensor -> its tape key
        self.settings, self.casts, self.keys = settings, casts, keys
        self.record = requires is not None
        self.requires = requires  # per key: whether its gradient is wanted
        self.entries, self.saved = [], []

    def _note(self, primitive, outs, saved, meta, in_keys):
        if not self.record:  # (inference: nothing to note)
            return outs
        requires = self.requires
        wanted = any(k is not None and requires[k] for k in in_keys)
        first = len(requires)
        requires.extend([wanted] * len(outs))
        self.entries.append((primitive, meta, len(self.saved), len(saved), in_keys,
                             tuple(range(first, first + len(outs)))))
        self.saved.extend(saved)
        return tuple(Var(t, first + i) for i, t in enumerate(outs))

    def _key(self, param):
        return None if param is None else self.keys.get(id(param))

    def layer_norm(self, norm, x, add=None, mask=None, gamma=None):
        params = norm._parameters
        weight, bias = params["weight"], params["bias"]
        gamma_grad = self.record and gamma is not None and gamma.requires_grad
        outs, saved, meta = P.LayerNorm.forward(_t(x), weight, bias, norm.eps, self.settings.dtype, _t(add), mask,
                                                gamma, self.record, gamma_grad)
        if not self.record:
            return outs[0] if add is None else outs
        in_keys = (_key_of(x), self._key(weight), self._key(bias))
        if add is not None:
            in_keys += (_key_of(add),) if gamma is None else (_key_of(add), self._key(gamma))
        outs = self._note(P.LayerNorm, outs, saved, meta, in_keys)
        return outs[0] if add is None else outs

    def linear(self, layer, x):
        weight, bias = self.casts[layer]
        outs, saved, meta = P.Linear.forward(_t(x), weight, bias, self.record)
        if not self.record:
            return outs[0]
        params = layer._parameters
        return self._note(P.Linear, outs, saved, meta,
                          (_key_of(x), self._key(params["weight"]), self._key(params["bias"])))[0]

    def gelu(self, act, x):
        outs, saved, meta = P.Gelu.forward(_t(x), self.record)
        return self._note(P.Gelu, outs, saved, meta, (_key_of(x),))[0]

    def pad(self, x, Hp: int, Wp: int):
        outs, saved, meta = P.Pad.forward(_t(x), Hp, Wp, self.record)
        return self._note(P.Pad, outs, saved, meta, (_key_of(x),))[0]

    def crop(self, x, H: int, W: int):
        outs, saved, meta = P.Crop.forward(_t(x), H, W, self.record)
        return self._note(P.Crop, outs, saved, meta, (_key_of(x),))[0]

    def attend(self, p, qkv, dilation):
        settings = self.settings
        rpb = p.attn._parameters["rpb"]
        outs, saved, meta = P.Attention.forward(_t(qkv), rpb, settings.params, settings.scale, settings.heads,
                                                self.record)
        return self._note(P.Attention, outs, saved, meta, (_key_of(qkv), self._key(rpb)))[0]

    def residual(self, x, y, mask, gamma):
        gamma_grad = self.record and gamma is not None and gamma.requires_grad
        outs, saved, meta = P.Residual.forward(_t(x), _t(y), mask, gamma, self.record, gamma_grad)
        if not self.record:
            return outs[0]
        in_keys = (_key_of(x), _key_of(y)) if gamma is None else (_key_of(x), _key_of(y), self._key(gamma))
        return self._note(P.Residual, outs, saved, meta, in_keys)[0]

    @staticmethod
    def module(m, x):  # dropout (inactive) and timm's Mlp norm (Identity): the rule admits nothing else
        return x

    def section(self, module, fn, p, x):
        return fn(self, p, x)


def _key_of(v):
    return v.key if type(v) is Var else None


def replay(entries, saved, requires, out_key: int, d_out, leaves: int) -> list:
    """The gradients of the tape's first ``leaves`` keys: each entry's backward in reverse order, fed the gradients of
    its outputs; gradients of a key reached twice are summed (by the kernel where the primitive ``ACCUMULATES``)."""
    grads = [None] * len(requires)
    owned = [False] * len(requires)  # the buffer was made by the tape (a kernel may write into it)
    grads[out_key] = d_out
    for primitive, meta, start, count, in_keys, out_keys in reversed(entries):
        outs = [grads[k] for k in out_keys]
        if all(g is None for g in outs):
            continue
        needs = tuple(k is not None and requires[k] for k in in_keys)
        if primitive.ACCUMULATES:
            first = in_keys[0]
            ins = primitive.backward(meta, saved[start:start + count], outs, needs,
                                     None if first is None else grads[first], first is not None and owned[first])
        else:
            ins = primitive.backward(meta, saved[start:start + count], outs, needs)
        for k in out_keys:
            grads[k] = None  # (freed as soon as it is consumed)
        for i, (k, g) in enumerate(zip(in_keys, ins)):
            if k is None or g is None or not needs[i]:
                continue
            if grads[k] is None or (i == 0 and primitive.ACCUMULATES):
                grads[k] = g
                owned[k] = not any(g is o for o in outs)
            else:
                grads[k] = grads[k] + g
                owned[k] = True
    return grads[:leaves]


class _BlockFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, settings, parts, block, *params):
        keys = {id(p): i + 1 for i, p in enumerate(params)}
        requires = [x.requires_grad] + [p.requires_grad for p in params]
        casts, lease = _gemm_casts(block, parts, settings.dtype)  # (no grad mode here: the casts are not recorded)
        ex = TapeExecutor(settings, casts, keys, requires)
        # (the lease keeps the stage's cast buffer from being refilled while this backward can still read it)
        ex.saved.append(lease)
        out = B.block_forward(ex, parts, Var(x, 0))
        ctx.save_for_backward(*ex.saved)
        ctx.tape = (ex.entries, requires, out.key, 1 + len(params))
        return out.t

    @staticmethod
    def backward(ctx, d_out):
        entries, requires, out_key, leaves = ctx.tape
        grads = replay(entries, ctx.saved_tensors, requires, out_key, d_out.contiguous(), leaves)
        return (grads[0], None, None, None, *grads[1:])


# --- the rule ----------------------------------------------------------------------------------------------------

def _is_linear(m) -> bool:
    return type(m) is nn.Linear and m.bias is not None


def _is_layer_norm(m, dim: int) -> bool:
    return (type(m) in (nn.LayerNorm, FastLayerNorm) and m.elementwise_affine and m.bias is not None
            and tuple(m.normalized_shape) == (dim,))


def _structure_refusal(p: B.BlockParts) -> str | None:
    """Why the tape does not compute a block of these parts (None: it does): it computes exact types, affine
    LayerNorms, biased Linears, exact GELU, torch's dropouts and timm's stochastic depth."""
    attn = p.attn
    if type(attn) is not B.SECTION_TYPES.get(B.attention):
        return f"attn is a {type(attn).__name__}"
    if type(p.mlp) is not Mlp:
        return f"mlp is a {type(p.mlp).__name__}"
    if attn.is_causal != (False, False) or attn.stride != (1, 1):
        return "causal or strided attention"
    for name in ("norm1", "norm2"):
        if not _is_layer_norm(getattr(p, name), attn.dim):
            return f"{name} is not an affine LayerNorm over the channels"
    for name in ("qkv", "proj", "fc1", "fc2"):
        if not _is_linear(getattr(p, name)):
            return f"{name} is a {type(getattr(p, name)).__name__}, not an nn.Linear with bias"
    if type(p.act) is not nn.GELU or p.act.approximate != "none":
        return "the activation is not exact GELU"
    if type(p.mlp_norm) is not nn.Identity:
        return "the MLP has a norm"
    for name in ("attn_drop", "proj_drop", "drop1", "drop2"):
        if type(getattr(p, name)) is not nn.Dropout:
            return f"{name} is a {type(getattr(p, name)).__name__}"
    if type(p.drop_path) not in (nn.Identity, DropPath):
        return f"drop_path is a {type(p.drop_path).__name__}"
    return None


def _cached_structure_refusal(block, p: B.BlockParts) -> str | None:
    """:func:`_structure_refusal`, kept per set of parts and their classes (a parametrisation changes a module's
    class in place)."""
    modules = p[:15]
    key = (modules, tuple(map(type, modules)), p.gamma1 is None)
    cached = block.__dict__.get("_tape_structure")
    if cached is None or cached[0] != key:
        cached = (key, _structure_refusal(p))
        block.__dict__["_tape_structure"] = cached
    return cached[1]


def _hooks_or_dropout(p: B.BlockParts) -> str | None:
    for name, m in zip(B.BlockParts._fields[:15], p[:15]):
        if B.hooked(m):
            return f"hooks on {name}"
    if (_module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks
            or _module_hooks._global_backward_hooks or _module_hooks._global_backward_pre_hooks):
        return "global module hooks"
    if p.attn_drop.training and p.attn_drop.p > 0:
        return "attention dropout while training (needs the attention weights)"
    for name in ("proj_drop", "drop1", "drop2"):
        dropout = getattr(p, name)
        if dropout.training and dropout.p > 0:
            return f"{name} active while training"
    return None


def parameters(p: B.BlockParts) -> tuple:
    """The tensors the tape differentiates besides x, in its order."""
    params = (p.norm1._parameters["weight"], p.norm1._parameters["bias"], p.qkv._parameters["weight"],
              p.qkv._parameters["bias"], p.attn._parameters["rpb"], p.proj._parameters["weight"],
              p.proj._parameters["bias"], p.norm2._parameters["weight"], p.norm2._parameters["bias"],
              p.fc1._parameters["weight"], p.fc1._parameters["bias"], p.fc2._parameters["weight"],
              p.fc2._parameters["bias"])
    return params if p.gamma1 is None else params + (p.gamma1, p.gamma2)


def _gemm_weights(p: B.BlockParts) -> tuple:
    return (p.qkv._parameters["weight"], p.qkv._parameters["bias"], p.proj._parameters["weight"],
            p.proj._parameters["bias"], p.fc1._parameters["weight"], p.fc1._parameters["bias"],
            p.fc2._parameters["weight"], p.fc2._parameters["bias"])


def _gemm_casts(block, p: B.BlockParts, dtype) -> tuple[dict, object]:
    """``(GEMM layer -> (weight, bias) in dtype, the lease of the stage's cast buffer or None)``."""
    casts, lease = stage_casts.weight_casts(block, _gemm_weights(p), dtype, gemm_weights_of)
    return {p.qkv: (casts[0], casts[1]), p.proj: (casts[2], casts[3]), p.fc1: (casts[4], casts[5]),
            p.fc2: (casts[6], casts[7])}, lease


def gemm_weights_of(block):
    """A stage member's GEMM weights where the tape computes it (for the stage's cast copy), else None."""
    if not isinstance(block, layers.NATBlock):
        return None
    p = B.block_parts(block)
    return None if _cached_structure_refusal(block, p) is not None else _gemm_weights(p)


def route(block, p: B.BlockParts, x: torch.Tensor) -> BlockSettings | str:
    """How ``block`` runs ``x`` on the tape, or why it runs the primitives' torch forms (a reason)."""
    if not ENABLED:
        return "the tape is off (tape.ENABLED, or no fused kernels)"
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return "traced: a graph records the torch forms"
    if torch._C._are_functorch_transforms_active():
        return "a functorch transform is active"
    if _forward_ad._current_level >= 0:  # the tape's kernels have no tangent rule: dual inputs would lose theirs
        return "forward-mode AD is active (torch.autograd.forward_ad)"
    if x.dim() != 4 or not x.is_contiguous():
        return "x is not a contiguous [B, H, W, C] map"
    refusal = _cached_structure_refusal(block, p) or _hooks_or_dropout(p)
    if refusal is not None:
        return refusal
    weights = parameters(p)
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    grad = torch.is_grad_enabled() and (x.requires_grad or any(w is not None and w.requires_grad for w in weights))
    key = (x.shape, x.dtype, x.device, autocast, torch.get_autocast_dtype(device) if autocast else None, grad,
           p.attn.backend, current_backend(), weights[0].dtype)
    cache = block.__dict__.setdefault("_tape_settings", {})
    settings = cache.get(key)
    if settings is None:
        settings = _settings(p, weights, x, autocast, grad)
        if len(cache) < 64:
            cache[key] = settings
    return settings


def _settings(p: B.BlockParts, weights, x, autocast: bool, grad: bool) -> BlockSettings | str:
    attn = p.attn
    param_dtype = weights[0].dtype
    if any(w is not None and w.dtype != param_dtype for w in weights):
        return "parameters of mixed dtypes"
    if autocast:
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != torch.float32 or param_dtype != torch.float32:
            return "autocast over a non-float32 input or parameters"
    else:
        dtype = x.dtype
        if param_dtype != dtype:
            return "x and the parameters differ in dtype"
    if dtype not in SUPPORTED_DTYPES or x.dtype not in SUPPORTED_DTYPES or x.shape[-1] > MAX_COLUMNS:
        return "a dtype or width the LayerNorm kernel does not take"
    dilation, padded = B.fit_window(x.shape[1:3], attn.kernel_size, attn.dilation, attn.dilation_mode)
    params = make_params(padded, attn.kernel_size, 1, dilation, False)
    problem = Problem(params=params, dtype=dtype, device=x.device, head_dim=attn.head_dim, value_dim=attn.head_dim,
                      heads_q=attn.num_heads, heads_kv=attn.num_heads, has_rpb=attn.rpb is not None,
                      requires_grad=grad)
    try:
        backend = select_backend(problem, attn.backend)
    except ValueError:  # the torch forms raise it with the call's context
        return "no NA backend serves this call"
    if backend.name != "fused":
        return f"the {backend.name!r} NA backend serves this call (the tape runs the fused kernels)"
    if getattr(sys.modules.get("ops.fused"), "DENSE_WINDOW", False) and dense_window.covers(params):
        return "the window covers the map and ops.fused.DENSE_WINDOW is on (dense attention per dilation group)"
    return BlockSettings(params, attn.head_dim ** -0.5, attn.num_heads, dtype, autocast, grad)


def _note_path(block, path: str, reason: str | None) -> None:
    """``block.path`` / ``block.path_reason``, and each reason for the torch forms logged once per block."""
    state = block.__dict__
    state["path"], state["path_reason"] = path, reason
    if reason is not None:
        logged = state.setdefault("_path_reasons_logged", set())
        if reason not in logged:
            logged.add(reason)
            log.debug("%s runs the torch forms of its primitives: %s", type(block).__name__, reason)


def run_block(block, x: torch.Tensor) -> torch.Tensor:
    """``block``'s output for ``x``: the block function on the tape where :func:`route` allows, else with
    ``block.OPS``."""
    p = B.block_parts(block)
    if torch.compiler.is_compiling():  # (no bookkeeping in a graph)
        return B.block_forward(B.OPS, p, x)
    settings = route(block, p, x)
    if type(settings) is str:
        _note_path(block, "ops", settings)
        return B.block_forward(B.OPS, p, x)
    _note_path(block, "tape", None)
    device = x.device.type
    if settings.autocast:  # the primitives cast explicitly; autocast would also widen addcmul's bf16 input
        torch.set_autocast_enabled(device, False)
    try:
        if settings.grad:
            return _BlockFunction.apply(x, settings, p, block, *parameters(p))
        # inference: nothing needs a gradient, so nothing is recorded (the casts neither)
        return B.block_forward(TapeExecutor(settings, _gemm_casts(block, p, settings.dtype)[0], {}, None), p, x)
    finally:
        if settings.autocast:
            torch.set_autocast_enabled(device, True)
