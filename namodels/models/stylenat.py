"""StyleNAT: a style-based GAN whose synthesis blocks use Hydra neighborhood attention.

Paper: Walton et al., "StyleNAT: Giving Each Head a New Perspective" (arXiv:2211.05770).  The
architecture follows the released SHI-Labs/StyleNAT model (facts only, own code):

* mapping network: PixelNorm + 8 equalized-lr linear layers (lr multiplier 0.01, scaled leaky ReLU);
* synthesis: a learned constant 4x4 input, then one stage per resolution ``4 .. size``; each stage
  has two transformer blocks whose norms are AdaIN (instance norm, scale/shift from one ``w`` each)
  and whose attention is **Hydra-NA**: the heads are split into groups, each group with its own
  kernel size, dilation and relative positional bias (FFHQ-256: kernel 7, dilations 1 and
  ``resolution / 8``; the 4x4 stage attends to all tokens with RPB).  Between stages: bilinear x2
  upsampling, LayerNorm, a linear channel reduction and a 2-D sinusoidal position encoding scaled by
  a learnable scalar (initialised at 0).  Each stage adds a 1x1 ToRGB to an RGB skip path that is
  upsampled with the [1, 3, 3, 1] FIR filter;
* discriminator: the StyleGAN2 residual/skip discriminator in the wavelet (Haar) domain with
  spectral norm and minibatch standard deviation (as StyleSwin / StyleNAT use).

The StyleGAN2 parts (FIR filters, equalized-lr layers, mapping network, ToRGB, discriminator) are in
:mod:`namodels.models.stylegan2`; this module holds StyleNAT's synthesis network and the loading of
released checkpoints.

Feature maps are channels-last ``[B, H, W, C]`` inside the synthesis network; images are NCHW in
``[-1, 1]`` (unbounded, as in StyleGAN).  Hydra-NA calls :func:`ops.na2d` once per head group on
slices of the q/k/v projections; the kernel backend follows ``backend=`` or ``ops.use_backend``.

Official ``g_ema`` checkpoints load through :func:`convert_official_generator` (their module names,
the legacy split-head ``rpb0``/``rpb1`` attention, the 4x4 ``MHSARPB`` layer and the doubled ToRGB
bias are mapped onto this module).
"""
from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from timm.layers import Mlp, trunc_normal_
from torch import nn

import ops

from ..backend import register_na_module
from .backbone import check_batch, check_model_arguments
from .layers import init_weights
from .stylegan2 import EqualLinear, MappingNetwork, StyleNATDiscriminator, ToRGB, stage_channels, upfirdn2d

__all__ = [
    "StyleNATGenerator",
    "StyleNATDiscriminator",
    "HydraNeighborhoodAttention",
    "MappingNetwork",
    "upfirdn2d",
    "stage_channels",
    "default_windows",
    "convert_official_generator",
    "official_state_dict",
]


# ---------------------------------------------------------------------------------------------
# Synthesis network
# ---------------------------------------------------------------------------------------------


def default_windows(resolution: int, kernel_size: int = 7) -> list[tuple[int, int]]:
    """(kernel, dilation) per head group at one resolution, as in the FFHQ-256 release.

    4x4 (or any map no larger than the kernel): one group attending to the whole map
    (kernel = resolution).  Otherwise two groups: local (dilation 1) and sparse-global
    (dilation ``resolution // 8``), the dilation clamped so ``kernel * dilation <= resolution``.
    """
    if resolution <= kernel_size:
        return [(resolution, 1)]
    sparse = max(1, min(resolution // 8, resolution // kernel_size))
    return [(kernel_size, 1), (kernel_size, sparse)]


def _check_windows(windows, resolution: int, name: str) -> list[tuple[int, int]]:
    out = []
    for g, w in enumerate(windows):
        if len(w) != 2:
            raise ValueError(f"{name}: group {g}: expected (kernel_size, dilation), got {w!r}")
        k, d = int(w[0]), int(w[1])
        if k < 1 or d < 1 or k * d > resolution:
            raise ValueError(
                f"{name}: group {g}: kernel_size {k} x dilation {d} must be >= 1 and fit the {resolution}x{resolution} "
                f"feature map (kernel_size * dilation <= {resolution})"
            )
        out.append((k, d))
    if not out:
        raise ValueError(f"{name}: needs at least one head group")
    return out


@register_na_module
class HydraNeighborhoodAttention(nn.Module):
    """Multi-head 2-D neighborhood attention whose heads are split into groups, each group with its
    own kernel size, dilation and relative positional bias (``rpb.<g>: [heads_g, 2K-1, 2K-1]``).

    Heads are divided evenly; a remainder goes one head each to the last groups (the release's rule).
    Input/output ``[B, H, W, C]`` (channels last).
    """

    def __init__(self, dim: int, num_heads: int, windows: Sequence[tuple[int, int]], qkv_bias: bool = True,
                 backend: str | None = None):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"num_heads: dim ({dim}) must be divisible by num_heads ({num_heads})")
        if not windows or len(windows) > num_heads:
            raise ValueError(f"windows: need between 1 and num_heads ({num_heads}) head groups, got {len(windows)}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.windows = [(int(k), int(d)) for k, d in windows]
        base, extra = divmod(num_heads, len(self.windows))
        sizes = [base + (1 if g >= len(self.windows) - extra else 0) for g in range(len(self.windows))]
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        self.head_slices = [(bounds[g], bounds[g + 1]) for g in range(len(sizes))]
        self.backend = backend
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.rpb = nn.ParameterList(
            nn.Parameter(torch.zeros(s, 2 * k - 1, 2 * k - 1)) for s, (k, _) in zip(sizes, self.windows)
        )
        for p in self.rpb:
            trunc_normal_(p, std=0.02, a=-2.0, b=2.0)
        self.proj = nn.Linear(dim, dim)

    def extra_repr(self):
        groups = ", ".join(f"heads {a}:{b} k{k} d{d}" for (a, b), (k, d) in zip(self.head_slices, self.windows))
        return f"dim={self.dim}, num_heads={self.num_heads}, groups=[{groups}]"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        # [B, H, W, 3, heads, D] -> three strided views; each group reads a head slice of them.
        q, k, v = self.qkv(x).view(b, h, w, 3, self.num_heads, self.head_dim).unbind(3)
        outs = []
        for (lo, hi), (kernel, dilation), rpb in zip(self.head_slices, self.windows, self.rpb):
            outs.append(ops.na2d(q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], kernel_size=kernel,
                                 dilation=dilation, rpb=rpb, backend=self.backend))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
        return self.proj(out.reshape(b, h, w, c))


class AdaptiveInstanceNorm(nn.Module):
    """Instance norm over the spatial positions (no affine), then per-channel scale and shift
    predicted from ``w`` by an equalized-lr linear layer (``style``: ``[2C]`` = gamma, beta)."""

    def __init__(self, dim: int, style_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.style = EqualLinear(style_dim, 2 * dim)

    def forward(self, x, w):  # x [B, H, W, C], w [B, style_dim]
        var, mean = torch.var_mean(x, dim=(1, 2), keepdim=True, unbiased=False)
        gamma, beta = self.style(w)[:, None, None, :].chunk(2, dim=-1)
        return gamma * (x - mean) * torch.rsqrt(var + self.eps) + beta


class StyleNATBlock(nn.Module):
    """``x + attn(AdaIN1(x, w))`` then ``x + mlp(AdaIN2(x, w))`` (no layer scale, no drop path)."""

    def __init__(self, dim: int, num_heads: int, windows, style_dim: int = 512, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, backend: str | None = None):
        super().__init__()
        self.norm1 = AdaptiveInstanceNorm(dim, style_dim)
        self.attn = HydraNeighborhoodAttention(dim, num_heads, windows, qkv_bias=qkv_bias, backend=backend)
        self.norm2 = AdaptiveInstanceNorm(dim, style_dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)

    def forward(self, x, w):
        x = x + self.attn(self.norm1(x, w))
        return x + self.mlp(self.norm2(x, w))


def sinusoidal_grid(height: int, width: int, channels: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """2-D sinusoidal position encoding ``[H, W, channels]`` (channels % 4 == 0).

    The first half of the channels encodes the column, the second half the row; each half is
    ``[sin(p * f_i), cos(p * f_i)]`` for positions ``p = 1, 2, ...`` and frequencies
    ``f_i = 10000 ** (-i / (n - 1))``, ``i < n = channels / 4`` (the release's convention).
    """
    if channels % 4 != 0 or channels < 8:
        raise ValueError(f"channels: the sinusoidal encoding needs a multiple of 4 (>= 8), got {channels}")
    n = channels // 4
    freqs = torch.exp(torch.arange(n, dtype=torch.float32, device=device) * -(math.log(10000.0) / (n - 1)))

    def encode(length):
        angles = torch.arange(1, length + 1, dtype=torch.float32, device=device)[:, None] * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)  # [length, 2n]

    cols = encode(width)[None, :, :].expand(height, width, 2 * n)
    rows = encode(height)[:, None, :].expand(height, width, 2 * n)
    return torch.cat([cols, rows], dim=-1).to(dtype)


class BilinearUpsample(nn.Module):
    """x2 bilinear upsampling, LayerNorm, linear channel change, plus ``alpha`` x position encoding."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.reduction = nn.Linear(dim, out_dim, bias=False)
        self.alpha = nn.Parameter(torch.zeros(1))
        self.out_dim = out_dim

    def forward(self, x):  # [B, H, W, C] -> [B, 2H, 2W, out_dim]
        x = F.interpolate(x.permute(0, 3, 1, 2), scale_factor=2, mode="bilinear", align_corners=False)
        x = self.reduction(self.norm(x.permute(0, 2, 3, 1)))
        pos = sinusoidal_grid(x.shape[1], x.shape[2], self.out_dim, device=x.device, dtype=x.dtype)
        return x + self.alpha.to(x.dtype) * pos


class SynthesisStage(nn.Module):
    """Two style blocks at one resolution, then (except at the last stage) the upsampler."""

    def __init__(self, resolution: int, dim: int, out_dim: int | None, num_heads: int, windows, style_dim: int,
                 mlp_ratio: float, qkv_bias: bool, depth: int = 2, backend: str | None = None):
        super().__init__()
        self.resolution = resolution
        self.blocks = nn.ModuleList(
            StyleNATBlock(dim, num_heads, windows, style_dim, mlp_ratio, qkv_bias, backend) for _ in range(depth)
        )
        self.upsample = BilinearUpsample(dim, out_dim) if out_dim is not None else None

    def forward(self, x, ws):  # ws: [B, depth, style_dim]
        for i, block in enumerate(self.blocks):
            x = block(x, ws[:, i])
        return self.upsample(x) if self.upsample is not None else x


class StyleNATGenerator(nn.Module):
    """StyleNAT generator.

    Args:
        size: output resolution, a power of two in [32, 1024].
        style_dim: z and w dimension (512).
        n_mlp: mapping layers (8); lr_mlp: their learning-rate multiplier (0.01).
        channel_multiplier: widens resolutions >= 64 (2 in the release).
        mlp_ratio: hidden width of the block MLPs (4).
        min_heads: heads per stage are ``max(channels // 32, min_heads)``.
        kernel_size: NA kernel for the default windows (7).
        windows: optional per-stage list (one entry per resolution 4, 8, ..., size) of head groups
            ``[[kernel, dilation], ...]``; ``None`` entries (or ``windows=None``) use
            :func:`default_windows`.
        channels: optional width per resolution 4..size (overrides the table; small models).
        backend: NA backend for every attention call (``None``: automatic / ``ops.use_backend``).

    ``forward(z)`` returns images ``[B, 3, size, size]``; see :meth:`forward` for style mixing,
    truncation and w inputs.
    """

    def __init__(self, size: int = 256, style_dim: int = 512, n_mlp: int = 8, lr_mlp: float = 0.01,
                 channel_multiplier: int = 2, mlp_ratio: float = 4.0, min_heads: int = 4, kernel_size: int = 7,
                 windows: Sequence | None = None, qkv_bias: bool = True, depth: int = 2,
                 w_avg_beta: float = 0.995, channels: Sequence[int] | None = None, backend: str | None = None):
        super().__init__()
        if size not in (32, 64, 128, 256, 512, 1024):
            raise ValueError(f"size: expected a power of two from 32 to 1024, got {size}")
        # kernel_size sets the default windows; explicit `windows` may use an even kernel equal to their
        # (even) map size, which attends to the whole map (the release's 4x4 stage).
        check_model_arguments(kernel_size=kernel_size, mlp_ratio=mlp_ratio, backend=backend)
        channels = stage_channels(size, channel_multiplier, channels)
        resolutions = [2**i for i in range(2, int(math.log2(size)) + 1)]
        if windows is not None and len(windows) != len(resolutions):
            raise ValueError(f"windows: expected one entry per resolution {resolutions}, got {len(windows)}")
        self.size, self.style_dim, self.depth = size, style_dim, depth
        self.w_avg_beta = w_avg_beta
        self.resolutions = resolutions
        self.mapping = MappingNetwork(style_dim, style_dim, n_mlp, lr_mlp)
        self.register_buffer("w_avg", torch.zeros(style_dim))
        self.const = nn.Parameter(torch.randn(1, channels[4], 4, 4))
        self.stages = nn.ModuleList()
        self.to_rgbs = nn.ModuleList()
        self.stage_windows = []
        for i, r in enumerate(resolutions):
            spec = windows[i] if windows is not None else None
            win = default_windows(r, kernel_size) if spec is None else _check_windows(spec, r, f"windows[{i}]")
            self.stage_windows.append(win)
            out_dim = channels[r * 2] if r < size else None
            heads = max(channels[r] // 32, min_heads)
            self.stages.append(SynthesisStage(r, channels[r], out_dim, heads, win, style_dim, mlp_ratio, qkv_bias,
                                              depth, backend))
            self.to_rgbs.append(ToRGB(out_dim or channels[r], upsample_skip=r < size))
        self.n_latent = depth * len(resolutions)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        # The release's init: NAT's (trunc-normal(0.02) linears, LayerNorm 1/0) plus xavier-normal(0.02)
        # convs. Equalized-lr layers keep their N(0, 1) / lr_mul weights.
        init_weights(m)
        if isinstance(m, nn.Conv2d):
            nn.init.xavier_normal_(m.weight, gain=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    # --- latents -------------------------------------------------------------------------

    def map(self, z: torch.Tensor, update_w_avg: bool | None = None) -> torch.Tensor:
        """z ``[B, style_dim]`` -> w; in training mode the running mean ``w_avg`` (used by the
        truncation trick) is updated with ``w_avg_beta``."""
        if z.dim() != 2 or z.shape[1] != self.style_dim:
            raise ValueError(f"z: expected [B, {self.style_dim}], got {tuple(z.shape)}")
        w = self.mapping(z)
        if update_w_avg if update_w_avg is not None else self.training:
            with torch.no_grad():
                self.w_avg.copy_(w.detach().float().mean(0).lerp(self.w_avg, self.w_avg_beta))
        return w

    @torch.no_grad()
    def estimate_w_avg(self, n: int = 10000, batch: int = 1000, seed: int = 0) -> torch.Tensor:
        """Sets ``w_avg`` to the mean of ``n`` mapped latents (for checkpoints that carry none)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        total = torch.zeros(self.style_dim, dtype=torch.float64, device=self.w_avg.device)
        for lo in range(0, n, batch):
            z = torch.randn(min(batch, n - lo), self.style_dim, generator=gen).to(self.w_avg.device)
            total += self.mapping(z).double().sum(0)
        self.w_avg.copy_((total / n).to(self.w_avg.dtype))
        return self.w_avg

    def truncate(self, w: torch.Tensor, psi: float, cutoff: int | None = None) -> torch.Tensor:
        """Truncation trick: ``w_avg + psi * (w - w_avg)``; with ``cutoff`` only the first
        ``cutoff`` style layers of a ``[B, n_latent, D]`` tensor are truncated."""
        if psi == 1:
            return w
        avg = self.w_avg.to(w.dtype)
        if cutoff is None or w.dim() == 2:
            return avg.lerp(w, psi)
        out = w.clone()
        out[:, :cutoff] = avg.lerp(w[:, :cutoff], psi)
        return out

    def styles(self, z: torch.Tensor, mix_z: torch.Tensor | None = None, mix_index: int | None = None,
               truncation: float = 1.0, truncation_cutoff: int | None = None) -> torch.Tensor:
        """Per-layer styles ``[B, n_latent, style_dim]``.

        Style mixing: layers ``>= mix_index`` take their style from ``mix_z`` (``mix_index``
        drawn uniformly from ``[1, n_latent)`` when ``None``).
        """
        w = self.map(z)
        ws = w[:, None].expand(-1, self.n_latent, -1)
        if mix_z is not None:
            if mix_index is None:
                mix_index = int(torch.randint(1, self.n_latent, ()).item())
            if not 0 <= mix_index <= self.n_latent:
                raise ValueError(f"mix_index: must be in [0, {self.n_latent}], got {mix_index}")
            w2 = self.map(mix_z, update_w_avg=False)
            layer = torch.arange(self.n_latent, device=w.device)[None, :, None]
            ws = torch.where(layer < mix_index, ws, w2[:, None].expand(-1, self.n_latent, -1))
        return self.truncate(ws, truncation, truncation_cutoff)

    # --- synthesis -----------------------------------------------------------------------

    def synthesis(self, ws: torch.Tensor) -> torch.Tensor:
        """Styles ``[B, n_latent, style_dim]`` (or one ``w [B, style_dim]`` for all layers) -> image."""
        if ws.dim() == 2:
            ws = ws[:, None].expand(-1, self.n_latent, -1)
        if ws.dim() != 3 or ws.shape[1:] != (self.n_latent, self.style_dim):
            raise ValueError(f"ws: expected [B, {self.n_latent}, {self.style_dim}], got {tuple(ws.shape)}")
        x = self.const.permute(0, 2, 3, 1).expand(ws.shape[0], -1, -1, -1).to(ws.dtype)
        skip = None
        for i, (stage, to_rgb) in enumerate(zip(self.stages, self.to_rgbs)):
            x = stage(x, ws[:, i * self.depth:(i + 1) * self.depth])
            skip = to_rgb(x, skip)
        return skip

    def forward(self, z: torch.Tensor, *, mix_z: torch.Tensor | None = None, mix_index: int | None = None,
                truncation: float = 1.0, truncation_cutoff: int | None = None, input_is_w: bool = False,
                return_latents: bool = False):
        """Images ``[B, 3, size, size]`` from latents.

        Args:
            z: ``[B, style_dim]`` latents (or ``w`` / per-layer ``[B, n_latent, style_dim]`` styles
                with ``input_is_w=True``).
            mix_z, mix_index: style mixing (see :meth:`styles`).
            truncation, truncation_cutoff: truncation trick (``1.0`` = off).
            return_latents: also return the per-layer styles.
        """
        check_batch(z, "z")
        if input_is_w:
            ws = z if z.dim() == 3 else z[:, None].expand(-1, self.n_latent, -1)
            ws = self.truncate(ws, truncation, truncation_cutoff)
        else:
            ws = self.styles(z, mix_z, mix_index, truncation, truncation_cutoff)
        img = self.synthesis(ws)
        return (img, ws) if return_latents else img

    def seeded_latents(self, seeds: Sequence[int]) -> torch.Tensor:
        """One ``z`` per seed (drawn on CPU, so an image depends only on its seed, not on the
        device or the batch it is generated in)."""
        return torch.stack([torch.randn(self.style_dim, generator=torch.Generator().manual_seed(int(s)))
                            for s in seeds])

    @torch.no_grad()
    def sample(self, n: int, seed: int = 0, truncation: float = 1.0, batch_size: int = 16,
               device=None) -> torch.Tensor:
        """Images for seeds ``seed, seed + 1, ..., seed + n - 1``."""
        device = device or self.const.device
        z = self.seeded_latents(range(seed, seed + n))
        out = [self(z[i:i + batch_size].to(device), truncation=truncation) for i in range(0, n, batch_size)]
        return torch.cat(out)


# ---------------------------------------------------------------------------------------------
# Official checkpoints
# ---------------------------------------------------------------------------------------------

_DROP = (re.compile(r"\.relative_position_index$"), re.compile(r"\._float_tensor$"),
         re.compile(r"^to_rgbs\.\d+\.upsample\.kernel$"))


def official_state_dict(checkpoint: Mapping, which: str = "g_ema") -> dict:
    """The ``which`` (``g_ema``, ``g`` or ``d``) state dict of a released StyleNAT checkpoint:
    ``{"state_dicts": {"g", "g_ema", "d"}, ...}`` or the older top-level ``{"g", "g_ema", "d"}``."""
    if "state_dicts" in checkpoint and which in checkpoint["state_dicts"]:
        return dict(checkpoint["state_dicts"][which])
    if which in checkpoint:
        return dict(checkpoint[which])
    raise ValueError(f"checkpoint: no {which!r} state dict (keys: {sorted(checkpoint)[:10]})")


def convert_official_generator(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """Maps a released StyleNAT generator state dict onto :class:`StyleNATGenerator` names.

    * ``style.<i>.{weight,bias}`` (i = 1..8; 0 is PixelNorm) -> ``mapping.layers.<i-1>.*``;
    * ``input.input`` -> ``const``;
    * ``layers.<s>.blocks.<b>.*`` -> ``stages.<s>.blocks.<b>.*``; attention biases: the 4x4
      ``attn.rpb`` and legacy split-head ``attn.rpb0`` / ``attn.rpb1`` -> ``attn.rpb.0`` /
      ``attn.rpb.1`` (Hydra ``attn.rpb.<g>`` unchanged);
    * ``layers.<s>.upsample.*`` -> ``stages.<s>.upsample.*``;
    * ``to_rgbs.<s>.conv.bias + to_rgbs.<s>.bias`` -> ``to_rgbs.<s>.conv.bias`` (one bias);
    * constant buffers (relative position index, FIR kernels, fairseq's ``_float_tensor``) dropped.

    ``w_avg`` is not part of the release; load with ``strict=False`` for it or call
    :func:`load_official_generator`, which estimates it.
    """
    out = {}
    rgb_bias = {}
    for key, value in state_dict.items():
        key = key[len("module."):] if key.startswith("module.") else key
        if any(p.search(key) for p in _DROP):
            continue
        m = re.match(r"^style\.(\d+)\.(weight|bias)$", key)
        if m:
            out[f"mapping.layers.{int(m.group(1)) - 1}.{m.group(2)}"] = value
            continue
        if key == "input.input":
            out["const"] = value
            continue
        m = re.match(r"^to_rgbs\.(\d+)\.bias$", key)
        if m:
            rgb_bias[m.group(1)] = value.reshape(-1)
            continue
        m = re.match(r"^layers\.(\d+)\.(.*)$", key)
        if m:
            rest = m.group(2)
            rest = re.sub(r"\.attn\.rpb$", ".attn.rpb.0", rest)
            rest = re.sub(r"\.attn\.rpb([01])$", r".attn.rpb.\1", rest)
            out[f"stages.{m.group(1)}.{rest}"] = value
            continue
        out[key] = value
    for s, bias in rgb_bias.items():
        conv_bias = f"to_rgbs.{s}.conv.bias"
        out[conv_bias] = out[conv_bias] + bias if conv_bias in out else bias
    return out


def load_official_generator(generator: StyleNATGenerator, checkpoint, which: str = "g_ema",
                            w_avg_samples: int = 10000) -> StyleNATGenerator:
    """Loads a released StyleNAT checkpoint (path or loaded dict) into ``generator`` (strict,
    except for ``w_avg``, which is estimated from ``w_avg_samples`` mapped latents).  A path is read as
    plain data only (``weights_only``; see :mod:`namodels.tasks.checkpoints`): pickled code never runs."""
    if not isinstance(checkpoint, Mapping):
        from namodels.tasks.checkpoints import load_checkpoint_file

        checkpoint = load_checkpoint_file(checkpoint)
    converted = convert_official_generator(official_state_dict(checkpoint, which))
    hint = "check size / channel_multiplier / channels / kernel sizes"
    try:
        missing, unexpected = generator.load_state_dict(converted, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise ValueError(f"checkpoint: does not match this generator configuration ({hint}): {err}") from err
    missing = [k for k in missing if k != "w_avg"]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint: does not match this generator configuration ({hint}); missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    if "w_avg" not in converted:
        generator.estimate_w_avg(w_avg_samples)
    return generator
