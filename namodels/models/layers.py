"""Building blocks shared by NAT, DiNAT and DiNAT_s (channels-last ``[B, H, W, C]`` throughout).

Module and parameter names follow the official SHI-Labs checkpoints (``norm1``, ``attn.qkv``,
``attn.rpb``, ``attn.proj``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``, ``gamma1``, ``gamma2``), so those
state dicts load without renaming.
"""
from __future__ import annotations

from typing import Sequence

import torch
from timm.layers import DropPath, Mlp, trunc_normal_
from torch import nn

import ops

from . import block, tape
from .block import DILATION_MODES, fit_window  # noqa: F401  (re-exported: the window rule's public home)


def refuse_scripting(module: nn.Module):
    """``__prepare_scriptable__`` of the NA models and layers: ``torch.jit.script`` cannot compile them (the NA ops
    validate their arguments, pick a backend and build index tables in Python on every call), so it stops here with
    the routes that work, instead of failing on whichever attribute it meets first."""
    raise RuntimeError(
        f"torch.jit.script cannot compile {type(module).__name__}: its neighborhood attention runs Python at every "
        "call (argument checks, backend choice, index tables). Export it with torch.jit.trace, torch.export.export "
        "or torch.onnx.export instead (README, 'Export').")


class NeighborhoodAttention2D(ops.NeighborhoodAttention2D):
    """``ops.NeighborhoodAttention2D`` whose window adapts to feature maps smaller than it.

    The official models are trained at 224 (or 384); at other input sizes a stage may be smaller
    than ``kernel_size * dilation``.  See :func:`fit_window` for what happens then.  Padded
    tokens are zeros (the input here is already normalised), attend and are attended like the
    official implementation, and are cropped off the output.  The computation is ``block.attention``
    (the NAT block's attention, one definition), run with the primitives' torch forms.
    """

    def __init__(self, *args, dilation_mode: str = "clamp", **kwargs):
        super().__init__(*args, **kwargs)
        fit_window((1,) * self.rank, self.kernel_size, self.dilation, dilation_mode)  # validates the mode
        self.dilation_mode = dilation_mode

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dilation_mode={self.dilation_mode!r}"

    __prepare_scriptable__ = refuse_scripting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected [B, H, W, {self.dim}], got {tuple(x.shape)}")
        return block.attention(block.OPS, block.attention_parts(self), x)


block.SECTION_TYPES[block.attention] = NeighborhoodAttention2D


class NATBlock(nn.Module):
    """Pre-norm transformer block with neighborhood attention (official ``NATLayer``).

    ``x + DropPath(gamma1 * attn(norm1(x)))`` then ``x + DropPath(gamma2 * mlp(norm2(x)))``;
    ``gamma1``/``gamma2`` exist only when ``layer_scale`` is set.  The math is ``block.block_forward``; in eager
    mode it runs as one autograd node where ``tape.route`` allows (``self.path`` says which ran, and
    ``self.path_reason`` why not the tape).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kernel_size: int = 7,
        dilation: int = 1,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        layer_scale: float | None = None,
        act_layer=nn.GELU,
        norm_layer=nn.LayerNorm,
        dilation_mode: str = "clamp",
        backend: str | None = None,
    ):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = NeighborhoodAttention2D(
            dim, num_heads, kernel_size, dilation=dilation, qkv_bias=qkv_bias, rel_pos_bias=True,
            attn_drop=attn_drop, proj_drop=proj_drop, backend=backend, dilation_mode=dilation_mode,
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.layer_scale = layer_scale is not None
        if self.layer_scale:
            self.gamma1 = nn.Parameter(layer_scale * torch.ones(dim))
            self.gamma2 = nn.Parameter(layer_scale * torch.ones(dim))

    __prepare_scriptable__ = refuse_scripting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tape.run_block(self, x)


def stage_dilations(depths: Sequence[int], dilations) -> list[list[int]]:
    """Per-block dilations (``None`` = 1 everywhere); checks one list per stage, one entry per block."""
    if dilations is None:
        return [[1] * d for d in depths]
    if len(dilations) != len(depths) or any(len(ds) != d for ds, d in zip(dilations, depths)):
        raise ValueError(f"dilations: expected one list per stage with one entry per block {list(depths)}, "
                         f"got {dilations!r}")
    return [list(ds) for ds in dilations]


def init_weights(module: nn.Module) -> None:
    """Official init: trunc-normal(0.02) Linear weights, zero biases, LayerNorm 1/0 (convs keep torch's)."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
