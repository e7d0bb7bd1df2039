"""The NAT block's math, written once: :func:`block_forward` over the primitives of ``primitives.py``.

``x1 = x + mask1 * gamma1 * attention(norm1(x))``, ``x2 = x1 + mask2 * gamma2 * mlp(norm2(x1))``: pre-norm, with
layer scale (``gamma``, where the block has it) and stochastic depth (``mask``, per sample).  The first residual join
is part of the second norm's primitive (the tape fuses it into the LayerNorm kernel).  The attention pads a map
smaller than its window (``fit_window``) after ``norm1`` with zero tokens, which attend and are attended, and crops
them off its output before the projection (a per-token map, so cropping before or after it is the same function).

An executor runs it: ``OPS`` (here) runs each primitive's torch form, calling the block's modules, so that hooks,
parametrisations and swapped layers act as modules do; ``tape.py``'s executor runs their tape forms as one autograd
node.  A part whose module is hooked or of another type than the one its section computes runs as a module call
(:meth:`OpsExecutor.section`).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from timm.layers import DropPath, Mlp
from torch import nn

from . import primitives as P

DILATION_MODES = ("clamp", "pad")


def fit_window(spatial: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int], mode: str):
    """Dilation to use and the size to pad to, per axis, for a feature map of size ``spatial``.

    ``mode='clamp'``: an axis with ``L < K * d`` runs with dilation ``max(1, L // K)`` (so
    ``K * d <= L``); ``mode='pad'``: the dilation is kept and the axis is zero-padded to ``K * d``
    (what the official NAT / DiNAT code does through NATTEN's module).  In both modes an axis
    shorter than the kernel itself is zero-padded to ``K``.
    """
    if mode not in DILATION_MODES:
        raise ValueError(f"dilation_mode: expected one of {DILATION_MODES}, got {mode!r}")
    dilations, padded = [], []
    for L, K, d in zip(spatial, kernel_size, dilation):
        L = int(L)  # (the TorchScript-based ONNX exporter hands sizes over as 0-d tensors; windows need ints)
        if mode == "clamp":
            d = max(1, min(d, L // K))
        dilations.append(d)
        padded.append(max(L, K * d))
    return tuple(dilations), tuple(padded)


class AttentionParts(NamedTuple):
    """What :func:`attention` reads: the attention module (window, heads, rpb, backend) and its layers."""

    attn: nn.Module
    qkv: nn.Module
    proj: nn.Module
    attn_drop: nn.Module
    proj_drop: nn.Module


class BlockParts(NamedTuple):
    """What :func:`block_forward` reads, looked up once per call (``block_parts``)."""

    norm1: nn.Module
    attn: nn.Module
    qkv: nn.Module
    proj: nn.Module
    attn_drop: nn.Module
    proj_drop: nn.Module
    drop_path: nn.Module
    norm2: nn.Module
    mlp: nn.Module
    fc1: nn.Module
    act: nn.Module
    drop1: nn.Module
    mlp_norm: nn.Module
    fc2: nn.Module
    drop2: nn.Module
    gamma1: torch.Tensor | None
    gamma2: torch.Tensor | None


def attention_parts(attn) -> AttentionParts:
    m = attn._modules
    return AttentionParts(attn, m["qkv"], m["proj"], m["attn_drop"], m["proj_drop"])


def block_parts(block) -> BlockParts:
    """The block's parts, read from the module dicts (``nn.Module.__getattr__`` is a slow per-call lookup)."""
    top, params = block._modules, block._parameters
    attn, mlp = top["attn"], top["mlp"]
    a, m = attn._modules, mlp._modules
    return BlockParts(top["norm1"], attn, a.get("qkv"), a.get("proj"), a.get("attn_drop"), a.get("proj_drop"),
                      top["drop_path"], top["norm2"], mlp, m.get("fc1"), m.get("act"), m.get("drop1"),
                      m.get("norm"), m.get("fc2"), m.get("drop2"), params.get("gamma1"), params.get("gamma2"))


def drop_path_masks(drop_path: nn.Module, batch: int, device) -> torch.Tensor | None:
    """``[2, batch]`` float32 per-sample scales of both residual branches (0 or ``1 / keep``), or None without
    stochastic depth.  One draw per block for both residuals: the distribution of timm's ``DropPath`` (which draws
    once per residual, in the branch's dtype), not its random stream."""
    if type(drop_path) is nn.Identity:
        return None
    if type(drop_path) is not DropPath:
        raise TypeError(f"drop_path: expected nn.Identity or timm's DropPath, got {type(drop_path).__name__}")
    if not drop_path.training or drop_path.drop_prob == 0:
        return None
    keep = 1.0 - drop_path.drop_prob
    masks = torch.empty((2, batch), dtype=torch.float32, device=device).bernoulli_(keep)
    if drop_path.scale_by_keep:
        masks.div_(keep)
    return masks


def block_forward(ex, p: BlockParts, x):
    """The block's output for ``x [B, H, W, C]`` run by executor ``ex``."""
    if type(p.drop_path) not in (nn.Identity, DropPath):  # another stochastic depth: its module scales each branch
        y = ex.section(p.attn, attention, p, ex.layer_norm(p.norm1, x))
        x = x + p.drop_path(y if p.gamma1 is None else p.gamma1 * y)
        y = ex.section(p.mlp, mlp, p, ex.layer_norm(p.norm2, x))
        return x + p.drop_path(y if p.gamma2 is None else p.gamma2 * y)
    masks = drop_path_masks(p.drop_path, x.shape[0], x.device)
    mask1, mask2 = (None, None) if masks is None else (masks[0], masks[1])
    n1 = ex.layer_norm(p.norm1, x)
    y = ex.section(p.attn, attention, p, n1)
    n2, x1 = ex.layer_norm(p.norm2, x, add=y, mask=mask1, gamma=p.gamma1)
    y = ex.section(p.mlp, mlp, p, n2)
    return ex.residual(x1, y, mask2, p.gamma2)


def attention(ex, p, x):
    """Neighborhood attention of a normalised map ``x [B, H, W, C]`` (``p``: AttentionParts or BlockParts)."""
    attn = p.attn
    H, W = x.shape[1], x.shape[2]
    dilation, (Hp, Wp) = fit_window((H, W), attn.kernel_size, attn.dilation, attn.dilation_mode)
    padded = Hp != H or Wp != W
    if padded:
        x = ex.pad(x, Hp, Wp)
    out = ex.attend(p, ex.linear(p.qkv, x), dilation)
    if padded:
        out = ex.crop(out, H, W)
    return ex.module(p.proj_drop, ex.linear(p.proj, out))


def mlp(ex, p, x):
    """timm's ``Mlp``: fc1, act, drop1, norm, fc2, drop2."""
    h = ex.module(p.drop1, ex.gelu(p.act, ex.linear(p.fc1, x)))
    return ex.module(p.drop2, ex.linear(p.fc2, ex.module(p.mlp_norm, h)))


def hooked(m: nn.Module) -> bool:
    """Whether ``m`` has forward or backward hooks of its own."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


class OpsExecutor:
    """Runs the primitives' torch forms: ordinary differentiable ops and module calls."""

    layer_norm = staticmethod(P.LayerNorm.ops)
    linear = staticmethod(P.Linear.ops)
    gelu = staticmethod(P.Gelu.ops)
    pad = staticmethod(P.Pad.ops)
    crop = staticmethod(P.Crop.ops)
    residual = staticmethod(P.Residual.ops)

    @staticmethod
    def attend(p, qkv, dilation):
        return P.Attention.ops(p, qkv, dilation)

    @staticmethod
    def module(m, x):
        return m(x)

    def section(self, module, fn, p, x):
        """``fn(self, p, x)``, or the module's own call where it is hooked or of a type ``fn`` does not compute."""
        if hooked(module) or type(module) is not SECTION_TYPES.get(fn):
            return module(x)
        return fn(self, p, x)


OPS = OpsExecutor()
# section function -> the module type it computes (layers.py adds attention's, NeighborhoodAttention2D)
SECTION_TYPES: dict = {mlp: Mlp}
