"""NAT and DiNAT (Neighborhood / Dilated Neighborhood Attention Transformer) for the timm registry.

Architecture, hyper-parameters and state-dict names follow the official SHI-Labs release
(``classification/nat.py``, ``dinat.py``), so official checkpoints load strictly with no renaming;
``checkpoint_filter_fn`` also converts the Hugging Face transformers layout (``NatForImageClassification``
/ ``DinatForImageClassification``).  DiNAT is NAT with dilated attention in every other block.

Papers: NAT arXiv:2204.07143, DiNAT arXiv:2209.15001.  Official weights: MIT license.

Input sizes: any.  Where a stage is smaller than ``kernel_size * dilation``, ``dilation_mode``
decides (see :func:`namodels.models.layers.fit_window`): ``'clamp'`` (default) lowers that block's
dilation to ``max(1, L // kernel_size)``; ``'pad'`` zero-pads to ``kernel_size * dilation`` and crops
back, exactly like the official code.  Stages smaller than the kernel itself are zero-padded to it in
both modes (official behaviour).  At the training resolution both modes are identical.
"""
from __future__ import annotations

import re
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

__all__ = ["NAT", "checkpoint_filter_fn"]


class ConvTokenizer(nn.Module):
    """Stem: two 3x3 stride-2 convs (no activation between), channels-last, LayerNorm."""

    def __init__(self, in_chans: int, embed_dim: int, norm_layer=nn.LayerNorm):
        super().__init__()
        self.proj = nn.Sequential(
            nn.Conv2d(in_chans, embed_dim // 2, kernel_size=3, stride=2, padding=1),
            nn.Conv2d(embed_dim // 2, embed_dim, kernel_size=3, stride=2, padding=1),
        )
        self.norm = norm_layer(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # channels-last convolutions: cuDNN runs its NHWC kernels without converting the image and activations
        # there and back, and the permute below is a view
        x = x.contiguous(memory_format=torch.channels_last)
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class ConvDownsampler(nn.Module):
    """3x3 stride-2 conv (no bias) doubling the channels, then LayerNorm; channels-last in and out."""

    def __init__(self, dim: int, norm_layer=nn.LayerNorm):
        super().__init__()
        self.reduction = nn.Conv2d(dim, 2 * dim, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = norm_layer(2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.reduction(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))


class NAT(NABackbone):
    """NAT / DiNAT.

    Args:
        embed_dim: width of the first stage (doubles every stage).
        depths, num_heads: blocks and heads per stage.
        mlp_ratio: MLP hidden width / width.
        kernel_size: neighborhood size (odd).
        dilations: per stage, one dilation per block (DiNAT); ``None`` = NAT (all 1).
        layer_scale: initial value of the per-channel ``gamma1``/``gamma2`` (``None`` = no layer scale).
        drop_rate: dropout before the classifier (timm convention).
        pos_drop_rate: dropout after the stem; proj_drop_rate: after attention/MLP projections
            (the official ``drop_rate``); attn_drop_rate: on attention weights.
        drop_path_rate: stochastic depth, linear from 0 over all blocks.
        dilation_mode: 'clamp' or 'pad', for stages smaller than ``kernel_size * dilation``.
        backend: NA backend for every attention layer (``None``: ``ops.use_backend`` or automatic).
        fast_norm: LayerNorms on the project's Triton kernel (``ops.layer_norm.LayerNorm``; same parameters and
            state_dict) on CUDA: less GPU time than torch's for NAT's widths, but more host time per call, so it
            pays where a step is GPU-bound (compiled models use inductor's own fused norm either way; times in
            docs/performance.md, "LayerNorm").
    """

    stage_attr = "levels"

    def __init__(
        self,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 64,
        depths: Sequence[int] = (3, 4, 6, 5),
        num_heads: Sequence[int] = (2, 4, 8, 16),
        mlp_ratio: float = 3.0,
        kernel_size: int = 7,
        dilations=None,
        layer_scale: float | None = None,
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
        self.patch_embed = ConvTokenizer(in_chans, embed_dim, norm_layer)  # built first: keeps the seeded init order
        self.pos_drop = nn.Dropout(pos_drop_rate)
        dims, self.levels = build_stages(
            embed_dim, depths, num_heads, kernel_size, dilations, partial(ConvDownsampler, norm_layer=norm_layer),
            drop_path_rate, norm_layer=norm_layer, mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias, proj_drop=proj_drop_rate, attn_drop=attn_drop_rate, layer_scale=layer_scale,
            dilation_mode=dilation_mode, backend=backend)
        self.num_features = dims[-1]
        self.norm = norm_layer(self.num_features)
        self._build_feature_info(dims)
        self._init_head(num_classes, global_pool, drop_rate)
        self.apply(init_weights)


# --- checkpoint conversion ------------------------------------------------------------------------------

_HF_BLOCK_RENAMES = (  # Hugging Face NatLayer / DinatLayer -> official NATLayer (order matters: the
    ("layernorm_before.", "norm1."),  # attention's output.dense must be renamed before the MLP's)
    ("attention.self.rpb", "attn.rpb"),
    ("attention.output.dense.", "attn.proj."),
    ("layernorm_after.", "norm2."),
    ("intermediate.dense.", "mlp.fc1."),
    ("output.dense.", "mlp.fc2."),
)


def _is_hf_layout(state_dict: Dict[str, torch.Tensor]) -> bool:
    return any(k.startswith(("nat.", "dinat.")) for k in state_dict)


def _convert_hf(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers ``NatForImageClassification`` / ``DinatForImageClassification`` -> official names."""
    out: Dict[str, torch.Tensor] = {}
    qkv: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        k = re.sub(r"^(nat|dinat)\.", "", key)
        if k.startswith("hidden_states_norms.") or k.startswith("pooler."):
            continue  # backbone-only norms / parameter-free pooler: no counterpart in the classifier
        k = k.replace("embeddings.patch_embeddings.projection.", "patch_embed.proj.")
        k = k.replace("embeddings.norm.", "patch_embed.norm.")
        k = re.sub(r"^encoder\.levels\.(\d+)\.layers\.(\d+)\.", r"levels.\1.blocks.\2.", k)
        k = re.sub(r"^encoder\.levels\.(\d+)\.downsample\.", r"levels.\1.downsample.", k)
        k = re.sub(r"^layernorm\.", "norm.", k)
        k = re.sub(r"^classifier\.", "head.", k)
        m = re.match(r"^(levels\.\d+\.blocks\.\d+\.)(.*)$", k)
        if m:
            prefix, rest = m.groups()
            qkv_match = re.match(r"^attention\.self\.(query|key|value)\.(weight|bias)$", rest)
            if qkv_match:
                qkv.setdefault(prefix + "attn.qkv." + qkv_match.group(2), {})[qkv_match.group(1)] = value
                continue
            if rest == "layer_scale_parameters":
                out[prefix + "gamma1"], out[prefix + "gamma2"] = value[0].clone(), value[1].clone()
                continue
            for old, new in _HF_BLOCK_RENAMES:
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            k = prefix + rest
        out[k] = value
    for k, parts in qkv.items():
        if set(parts) != {"query", "key", "value"}:
            raise ValueError(f"state_dict: {k} needs query, key and value tensors, got {sorted(parts)}")
        out[k] = torch.cat([parts["query"], parts["key"], parts["value"]], dim=0)
    return out


def resize_rpb(rpb: torch.Tensor, shape) -> torch.Tensor:
    """Bicubic resize of a ``[heads, 2K-1, 2K-1]`` bias table (how the official 11x11 weights were made)."""
    if tuple(rpb.shape) == tuple(shape):
        return rpb
    resized = F.interpolate(rpb[None].float(), size=tuple(shape[1:]), mode="bicubic", align_corners=False)
    return resized[0].to(rpb.dtype)


def clean_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Unwraps ``{'model': ...}``/``{'state_dict': ...}``, strips DDP ``module.`` and resizes RPB tables
    whose kernel differs from the model's."""
    for wrapper in ("model", "state_dict"):
        if isinstance(state_dict.get(wrapper), dict):
            state_dict = state_dict[wrapper]
    state_dict = {re.sub(r"^module\.", "", k): v for k, v in state_dict.items()}
    own = model.state_dict()
    for k, v in state_dict.items():
        if k.endswith(".rpb") and k in own and own[k].shape != v.shape and own[k].shape[0] == v.shape[0]:
            state_dict[k] = resize_rpb(v, own[k].shape)
    return state_dict


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Official SHI-Labs checkpoints pass through unchanged; Hugging Face layouts are renamed."""
    for wrapper in ("model", "state_dict"):
        if isinstance(state_dict.get(wrapper), dict):
            state_dict = state_dict[wrapper]
    if _is_hf_layout(state_dict):
        state_dict = _convert_hf(state_dict)
    return clean_state_dict(state_dict, model)


# --- registry -------------------------------------------------------------------------------------------

def _create_nat(variant: str, pretrained: bool = False, **kwargs) -> NAT:
    out_indices = kwargs.pop("out_indices", tuple(range(len(kwargs.get("depths", (1, 1, 1, 1))))))
    kwargs = with_local_weights(variant, pretrained, kwargs)  # no network: one clear error at once, no retries
    with download_errors(variant, pretrained):
        return build_model_with_cfg(
            NAT, variant, pretrained,
            pretrained_filter_fn=checkpoint_filter_fn,
            feature_cfg=dict(feature_cls="getter", out_indices=out_indices),
            **kwargs,
        )


def dilated(depths: Sequence[int], every_other: Sequence[int]) -> list[list[int]]:
    """DiNAT pattern: blocks 1, 3, 5... of stage i use dilation ``every_other[i]``, the others 1."""
    return [[d if j % 2 else 1 for j in range(n)] for n, d in zip(depths, every_other)]


# Weights are published in two places (docs/models.md lists every tag with its source):
# * the authors' files, linked from NAT.md / DiNAT.md of github.com/SHI-Labs/Neighborhood-Attention-Transformer
#   (official layout: loaded as they are);
# * the authors' Hugging Face hub copies of the ImageNet-1k classifiers, huggingface.co/shi-labs/<repo>
#   (transformers layout, renamed by ``checkpoint_filter_fn``).
# timm takes ``hf_hub_id`` when huggingface_hub is installed (cached under $HF_HUB_CACHE, HF_HUB_OFFLINE=1 works
# from the cache) and the ``url`` otherwise; the ImageNet-22k files are published only as urls.
_NAT_URL = "https://shi-labs.com/projects/nat/checkpoints/CLS/"
_DINAT_URL = "https://shi-labs.com/projects/dinat/checkpoints/"


def _cfg(url: str = "", hf_hub_id: str | None = None, **kwargs):
    return {
        "url": url,
        **({"hf_hub_id": hf_hub_id} if hf_hub_id else {}),
        "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7),
        "crop_pct": 0.875, "interpolation": "bicubic", "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj.0", "classifier": "head",
        "license": "mit", "origin_url": "https://github.com/SHI-Labs/Neighborhood-Attention-Transformer",
        **kwargs,
    }


_384 = dict(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0)
_NAT_PAPER = dict(paper_ids="arXiv:2204.07143", paper_name="Neighborhood Attention Transformer")
_DINAT_PAPER = dict(paper_ids="arXiv:2209.15001", paper_name="Dilated Neighborhood Attention Transformer")


def _nat(size: str):
    return _cfg(f"{_NAT_URL}nat_{size}.pth", hf_hub_id=f"shi-labs/nat-{size}-in1k-224", **_NAT_PAPER)


def _dinat(file: str, hf_hub_id: str | None = None, **kwargs):
    return _cfg(_DINAT_URL + file, hf_hub_id=hf_hub_id, **kwargs, **_DINAT_PAPER)


default_cfgs = generate_default_cfgs({
    "nat_mini.in1k": _nat("mini"),
    "nat_tiny.in1k": _nat("tiny"),
    "nat_small.in1k": _nat("small"),
    "nat_base.in1k": _nat("base"),
    "dinat_mini.in1k": _dinat("imagenet1k/dinat_mini_in1k_224.pth", "shi-labs/dinat-mini-in1k-224"),
    "dinat_tiny.in1k": _dinat("imagenet1k/dinat_tiny_in1k_224.pth", "shi-labs/dinat-tiny-in1k-224"),
    "dinat_small.in1k": _dinat("imagenet1k/dinat_small_in1k_224.pth", "shi-labs/dinat-small-in1k-224"),
    "dinat_base.in1k": _dinat("imagenet1k/dinat_base_in1k_224.pth", "shi-labs/dinat-base-in1k-224"),
    "dinat_large.in22k_ft_in1k": _dinat("imagenet1k/dinat_large_in22k_in1k_224.pth",
                                        "shi-labs/dinat-large-in22k-in1k-224"),
    "dinat_large.in22k": _dinat("imagenet22k/dinat_large_in22k_224.pth", num_classes=21841),
    "dinat_large_384.in22k_ft_in1k": _dinat("imagenet1k/dinat_large_in22k_in1k_384.pth",
                                            "shi-labs/dinat-large-in22k-in1k-384", **_384),
    "dinat_large_384_11x11.in22k_ft_in1k": _dinat("imagenet1k/dinat_large_in22k_in1k_384_11x11.pth",
                                                  "shi-labs/dinat-large-11x11-in22k-in1k-384", **_384),
    # ImageNet-22K DiNAT-Large weights with the 7x7 RPB bicubic-resized to 11x11: the starting point of
    # the 384 11x11 fine-tune.
    "dinat_large_384_11x11.in22k": _dinat("imagenet22k/dinat_large_in22k_224_11x11interp.pth", num_classes=21841,
                                          **_384),
})

_MINI = dict(depths=(3, 4, 6, 5), num_heads=(2, 4, 8, 16), embed_dim=64, mlp_ratio=3, drop_path_rate=0.2)
_TINY = dict(depths=(3, 4, 18, 5), num_heads=(2, 4, 8, 16), embed_dim=64, mlp_ratio=3, drop_path_rate=0.2)
_SMALL = dict(depths=(3, 4, 18, 5), num_heads=(3, 6, 12, 24), embed_dim=96, mlp_ratio=2, drop_path_rate=0.3)
_BASE = dict(depths=(3, 4, 18, 5), num_heads=(4, 8, 16, 32), embed_dim=128, mlp_ratio=2, drop_path_rate=0.5,
             layer_scale=1e-5)
_LARGE = dict(depths=(3, 4, 18, 5), num_heads=(6, 12, 24, 48), embed_dim=192, mlp_ratio=2, drop_path_rate=0.35)
_D224 = (8, 4, 2, 1)  # every-other-block dilation per stage at 224 with 7x7: resolution // 7


def _build(variant: str, pretrained: bool, arch: dict, kernel_size: int = 7, every_other=None, **kwargs) -> NAT:
    """Published hyper-parameters ``arch`` (+ DiNAT dilations), overridable by ``kwargs``."""
    arch = dict(arch, kernel_size=kernel_size)
    if every_other is not None:
        arch["dilations"] = dilated(arch["depths"], every_other)
    return _create_nat(variant, pretrained, **dict(arch, **kwargs))


@register_model
def nat_mini(pretrained=False, **kwargs) -> NAT:
    return _build("nat_mini", pretrained, _MINI, **kwargs)


@register_model
def nat_tiny(pretrained=False, **kwargs) -> NAT:
    return _build("nat_tiny", pretrained, _TINY, **kwargs)


@register_model
def nat_small(pretrained=False, **kwargs) -> NAT:
    return _build("nat_small", pretrained, dict(_SMALL, layer_scale=1e-5), **kwargs)


@register_model
def nat_base(pretrained=False, **kwargs) -> NAT:
    return _build("nat_base", pretrained, _BASE, **kwargs)


@register_model
def dinat_mini(pretrained=False, **kwargs) -> NAT:
    return _build("dinat_mini", pretrained, _MINI, every_other=_D224, **kwargs)


@register_model
def dinat_tiny(pretrained=False, **kwargs) -> NAT:
    return _build("dinat_tiny", pretrained, _TINY, every_other=_D224, **kwargs)


@register_model
def dinat_small(pretrained=False, **kwargs) -> NAT:
    # unlike nat_small, the official dinat_small has no layer scale
    return _build("dinat_small", pretrained, _SMALL, every_other=_D224, **kwargs)


@register_model
def dinat_base(pretrained=False, **kwargs) -> NAT:
    return _build("dinat_base", pretrained, _BASE, every_other=_D224, **kwargs)


@register_model
def dinat_large(pretrained=False, **kwargs) -> NAT:
    return _build("dinat_large", pretrained, _LARGE, every_other=_D224, **kwargs)


@register_model
def dinat_large_384(pretrained=False, **kwargs) -> NAT:
    return _build("dinat_large_384", pretrained, _LARGE, every_other=(13, 6, 3, 1), **kwargs)


@register_model
def dinat_large_384_11x11(pretrained=False, **kwargs) -> NAT:
    return _build("dinat_large_384_11x11", pretrained, _LARGE, kernel_size=11, every_other=(8, 4, 2, 1), **kwargs)
