"""``nat_digits``: a small NAT-style network for tiny images (the built-in default training run).

Same structure as NAT (conv stem, levels of neighborhood-attention blocks with relative positional
bias, a strided-conv downsampler at the end of each level but the last, LayerNorm + mean pool +
linear head), scaled down for the 8x8 sklearn digits upsampled to 32x32: the stem brings 32x32 to
8x8 tokens (as NAT's two stride-2 convs), level 0 runs a 5x5 window then a 3x3 window with dilation
2 at 8x8, level 1 runs 3x3 windows at 4x4.  Small on purpose: the naive CPU backend is slow.  Attention goes through the project's own kernels (``ops.NeighborhoodAttention2D``), so the
default run exercises them; on CPU that is the naive/gemm backends.

>>> import timm, namodels
>>> model = timm.create_model("nat_digits", backend="naive")
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from timm.layers import DropPath, Mlp
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

import ops

from .backbone import ClassifierHooks, check_batch, check_model_arguments
from .layers import init_weights

__all__ = ["TinyNAT"]


class _Stem(nn.Module):
    """Two stride-2 3x3 convs (as NAT's stem) then LayerNorm on channels-last tokens."""

    def __init__(self, in_chans: int, dim: int):
        super().__init__()
        self.proj = nn.Sequential(
            nn.Conv2d(in_chans, dim // 2, 3, stride=2, padding=1),
            nn.Conv2d(dim // 2, dim, 3, stride=2, padding=1),
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class _Downsample(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.reduction = nn.Conv2d(dim, out_dim, 3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_dim)

    def forward(self, x):
        return self.norm(self.reduction(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))


class _Block(nn.Module):
    """Pre-norm NA block: x + DropPath(NA(LN(x))); x + DropPath(MLP(LN(x)))."""

    def __init__(self, dim, num_heads, kernel_size, dilation, mlp_ratio, drop_path, backend):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ops.NeighborhoodAttention2D(
            dim, num_heads, kernel_size, dilation=dilation, rel_pos_bias=True, backend=backend
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class _Level(nn.Module):
    def __init__(self, dim, out_dim, num_heads, kernel_sizes, dilations, mlp_ratio, drop_paths, backend):
        super().__init__()
        self.blocks = nn.Sequential(*[
            _Block(dim, num_heads, k, d, mlp_ratio, p, backend)
            for k, d, p in zip(kernel_sizes, dilations, drop_paths)
        ])
        self.downsample = _Downsample(dim, out_dim) if out_dim else nn.Identity()

    def forward(self, x):
        return self.downsample(self.blocks(x))


def smallest_input(kernel_sizes: Sequence[Sequence[int]], dilations: Sequence[Sequence[int]]) -> int:
    """The smallest square input whose token map at every level holds that level's widest window
    (``kernel_size * dilation``): the stem and each downsampler halve the map (3x3 convs, stride 2, padding 1)."""
    need = [max(k * d for k, d in zip(ks, ds)) for ks, ds in zip(kernel_sizes, dilations)]

    def fits(size: int) -> bool:
        tokens = (((size + 1) // 2) + 1) // 2  # after the stem's two stride-2 convs
        for level_need in need:
            if tokens < level_need:
                return False
            tokens = (tokens + 1) // 2
        return True

    size = 1
    while not fits(size):
        size += 1
    return size


class TinyNAT(ClassifierHooks, nn.Module):
    """A NAT in miniature.  Channels-last inside; ``forward_features`` returns ``[B, H, W, C]``."""

    def __init__(
        self,
        img_size: int = 32,
        in_chans: int = 3,
        num_classes: int = 10,
        embed_dim: int = 32,
        num_heads: Sequence[int] = (2, 4),
        kernel_sizes: Sequence[Sequence[int]] = ((5, 3), (3, 3)),
        dilations: Sequence[Sequence[int]] = ((1, 2), (1, 1)),
        mlp_ratio: float = 2.0,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        global_pool: str = "avg",
        backend: str | None = None,
    ):
        super().__init__()
        check_model_arguments(kernel_size=kernel_sizes, kernel_name="kernel_sizes", mlp_ratio=mlp_ratio,
                              drop_path_rate=drop_path_rate, backend=backend)
        if not len(num_heads) == len(kernel_sizes) == len(dilations):
            raise ValueError("kernel_sizes: num_heads, kernel_sizes and dilations need one entry per level")
        if any(len(k) != len(d) for k, d in zip(kernel_sizes, dilations)):
            raise ValueError("dilations: each level needs one dilation per block (one per kernel size)")
        depths = [len(k) for k in kernel_sizes]
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool: expected 'avg' or '', got {global_pool!r}")
        self.num_classes, self.global_pool, self.grad_checkpointing = num_classes, global_pool, False
        self.patch_embed = _Stem(in_chans, embed_dim)
        rates = torch.linspace(0, drop_path_rate, sum(depths), device="cpu").tolist()  # also under a meta device
        widths = [embed_dim * 2 ** i for i in range(len(depths))]
        self.levels = nn.Sequential()
        self.feature_info = []
        for i in range(len(depths)):
            last = i == len(depths) - 1
            self.levels.append(_Level(
                widths[i], None if last else widths[i + 1], num_heads[i], kernel_sizes[i], dilations[i],
                mlp_ratio, rates[sum(depths[:i]):sum(depths[:i + 1])], backend,
            ))
            self.feature_info.append(dict(num_chs=widths[i + (not last)], reduction=4 * 2 ** (i + (not last)),
                                          module=f"levels.{i}"))
        self.num_features = self.head_hidden_size = widths[-1]
        # Inputs below this size leave a level's window wider than its token map (21 px for nat_digits).
        self.min_input_size = smallest_input(kernel_sizes, dilations)
        self.norm = nn.LayerNorm(self.num_features)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {name for name, _ in self.named_parameters() if name.endswith(".rpb")}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False):
        return dict(
            stem=r"^patch_embed",
            blocks=r"^levels\.(\d+)" if coarse else [
                (r"^levels\.(\d+)\.downsample", (0,)),
                (r"^levels\.(\d+)\.blocks\.(\d+)", None),
                (r"^norm", (99999,)),
            ],
        )

    def reset_classifier(self, num_classes: int, global_pool: str | None = None):
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x):
        check_batch(x)
        x = self.patch_embed(x)
        for level in self.levels:
            if self.grad_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(level, x, use_reentrant=False)
            else:
                x = level(x)
        return self.norm(x)

    def forward_head(self, x, pre_logits: bool = False):
        if self.global_pool == "avg":
            x = x.mean(dim=(1, 2))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


default_cfgs = generate_default_cfgs({
    # No hosted weights: load a file of ours with pretrained_cfg_overlay=dict(file=...).
    "nat_digits.untrained": dict(
        url="", num_classes=10, input_size=(3, 32, 32), pool_size=(4, 4), crop_pct=1.0,
        interpolation="bilinear", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
        first_conv="patch_embed.proj.0", classifier="head",
    ),
})


@register_model
def nat_digits(pretrained: bool = False, **kwargs) -> TinyNAT:
    """~0.2M-parameter NAT for 32x32 inputs (sklearn digits upsampled); the default training run."""
    return build_model_with_cfg(
        TinyNAT, "nat_digits", pretrained,
        feature_cfg=dict(out_indices=(0, 1), flatten_sequential=True),
        **kwargs,
    )
