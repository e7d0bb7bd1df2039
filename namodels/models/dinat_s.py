"""DiNAT_s: the Swin-like DiNAT variant (official ``classification/dinats.py``) for the timm registry.

Swin's architecture with window attention replaced by neighborhood attention and shifted-window
attention by dilated neighborhood attention: 4x4 patch stem, ``PatchMerging`` downsamplers (at the
end of stages 0-2), MLP ratio 4, no layer scale.  State-dict names equal the official ones
(``layers.i.blocks.j...``).  Input sizes and ``dilation_mode`` behave as in :mod:`namodels.models.nat`;
inputs that are not a multiple of 4 are zero-padded at the bottom/right before the stem, and odd stage
sizes are zero-padded before merging (both official behaviour).
"""
from __future__ import annotations

from functools import partial
from typing import Dict, Sequence

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from ops.layer_norm import LayerNorm as FastLayerNorm

from .backbone import NABackbone, build_stages, check_model_arguments
from .layers import init_weights
from .pretrained import download_errors, with_local_weights
from .nat import clean_state_dict, dilated

__all__ = ["DiNAT_s", "checkpoint_filter_fn"]


class PatchEmbed(nn.Module):
    """4x4 stride-4 conv (inputs padded to a multiple of 4), channels-last, LayerNorm."""

    def __init__(self, in_chans: int, embed_dim: int, patch_size: int = 4, norm_layer=nn.LayerNorm):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = norm_layer(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        pad_h, pad_w = (-x.shape[2]) % p, (-x.shape[3]) % p
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class PatchMerging(nn.Module):
    """Swin patch merging: each 2x2 neighbourhood (order (0,0), (1,0), (0,1), (1,1) as (row, col)) is
    concatenated, normalised (4C) and projected to 2C without bias.  Odd sizes are zero-padded."""

    def __init__(self, dim: int, norm_layer=nn.LayerNorm):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = norm_layer(4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
            H, W = H + H % 2, W + W % 2
        # [B, H/2, row-in-pair, W/2, col-in-pair, C] -> channel blocks ordered by (col, row)
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).reshape(B, H // 2, W // 2, 4 * C)
        return self.reduction(self.norm(x))


class DiNAT_s(NABackbone):
    """DiNAT_s (arguments as :class:`namodels.models.nat.NAT`, plus ``patch_size``, without ``layer_scale``).

    ``fast_norm=True`` builds every LayerNorm (stem, blocks, patch merging, final) as ``ops.layer_norm.LayerNorm``,
    as in NAT: same parameters and state_dict, the Triton kernel on CUDA.
    """

    stage_attr = "layers"

    def __init__(
        self,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        patch_size: int = 4,
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        mlp_ratio: float = 4.0,
        kernel_size: int = 7,
        dilations=None,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.2,
        dilation_mode: str = "clamp",
        backend: str | None = None,
        fast_norm: bool = False,
    ):
        super().__init__()
        check_model_arguments(kernel_size=kernel_size, mlp_ratio=mlp_ratio, drop_path_rate=drop_path_rate,
                              backend=backend)
        self.in_chans = in_chans
        self.grad_checkpointing = False
        norm_layer = FastLayerNorm if fast_norm else nn.LayerNorm
        # built first: keeps the seeded init order
        self.patch_embed = PatchEmbed(in_chans, embed_dim, patch_size, norm_layer=norm_layer)
        self.pos_drop = nn.Dropout(pos_drop_rate)
        dims, self.layers = build_stages(
            embed_dim, depths, num_heads, kernel_size, dilations, partial(PatchMerging, norm_layer=norm_layer),
            drop_path_rate, norm_layer=norm_layer, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
            attn_drop=attn_drop_rate, dilation_mode=dilation_mode, backend=backend)
        self.num_features = dims[-1]
        self.norm = norm_layer(self.num_features)
        self._build_feature_info(dims)
        self._init_head(num_classes, global_pool, drop_rate)
        self.apply(init_weights)


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Official checkpoints use our names; only wrappers / DDP prefixes / RPB sizes are adapted."""
    return clean_state_dict(state_dict, model)


def _create_dinat_s(variant: str, pretrained: bool = False, **kwargs) -> DiNAT_s:
    out_indices = kwargs.pop("out_indices", tuple(range(len(kwargs.get("depths", (1, 1, 1, 1))))))
    kwargs = with_local_weights(variant, pretrained, kwargs)  # no network: one clear error at once, no retries
    with download_errors(variant, pretrained):
        return build_model_with_cfg(
            DiNAT_s, variant, pretrained,
            pretrained_filter_fn=checkpoint_filter_fn,
            feature_cfg=dict(feature_cls="getter", out_indices=out_indices),
            **kwargs,
        )


# The authors' files, linked from DiNAT.md and classification/dinats.py of
# github.com/SHI-Labs/Neighborhood-Attention-Transformer (official layout; docs/models.md lists every tag).
# No Hugging Face hub copy of DiNAT_s is published.
_URL = "https://shi-labs.com/projects/dinat/checkpoints/"


def _cfg(url: str = "", **kwargs):
    return {
        "url": url,
        "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7),
        "crop_pct": 0.875, "interpolation": "bicubic", "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head",
        "license": "mit", "origin_url": "https://github.com/SHI-Labs/Neighborhood-Attention-Transformer",
        "paper_ids": "arXiv:2209.15001", "paper_name": "Dilated Neighborhood Attention Transformer",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "dinat_s_tiny.in1k": _cfg(_URL + "imagenet1k/dinat_s_tiny_in1k_224.pth"),
    "dinat_s_small.in1k": _cfg(_URL + "imagenet1k/dinat_s_small_in1k_224.pth"),
    "dinat_s_base.in1k": _cfg(_URL + "imagenet1k/dinat_s_base_in1k_224.pth"),
    "dinat_s_large.in22k_ft_in1k": _cfg(_URL + "imagenet1k/dinat_s_large_in1k_224.pth"),
    "dinat_s_large.in22k": _cfg(_URL + "imagenet22k/dinat_s_large_in22k_224.pth", num_classes=21841),
    "dinat_s_large_384.in22k_ft_in1k": _cfg(_URL + "imagenet1k/dinat_s_large_in1k_384.pth",
                                            input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0),
})


def _build(variant: str, pretrained: bool, arch: dict, every_other, **kwargs) -> DiNAT_s:
    """Published hyper-parameters ``arch`` (+ dilations), overridable by ``kwargs`` (pass ``dilations``
    together with other ``depths``)."""
    arch = dict(arch, mlp_ratio=4, kernel_size=7, dilations=dilated(arch["depths"], every_other))
    return _create_dinat_s(variant, pretrained, **dict(arch, **kwargs))


_TINY = dict(depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), embed_dim=96, drop_path_rate=0.2)
_SMALL = dict(depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), embed_dim=96, drop_path_rate=0.3)
_BASE = dict(depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), embed_dim=128, drop_path_rate=0.5)
_LARGE = dict(depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48), embed_dim=192, drop_path_rate=0.35)
_D224 = (8, 4, 2, 1)


@register_model
def dinat_s_tiny(pretrained=False, **kwargs) -> DiNAT_s:
    return _build("dinat_s_tiny", pretrained, _TINY, _D224, **kwargs)


@register_model
def dinat_s_small(pretrained=False, **kwargs) -> DiNAT_s:
    return _build("dinat_s_small", pretrained, _SMALL, _D224, **kwargs)


@register_model
def dinat_s_base(pretrained=False, **kwargs) -> DiNAT_s:
    return _build("dinat_s_base", pretrained, _BASE, _D224, **kwargs)


@register_model
def dinat_s_large(pretrained=False, **kwargs) -> DiNAT_s:
    return _build("dinat_s_large", pretrained, _LARGE, _D224, **kwargs)


@register_model
def dinat_s_large_384(pretrained=False, **kwargs) -> DiNAT_s:
    return _build("dinat_s_large_384", pretrained, _LARGE, (13, 6, 3, 1), **kwargs)
