"""StyleGAN2 building blocks, as StyleNAT uses them (facts of the StyleGAN2 / StyleSwin designs, own code).

* FIR filtering (``upfirdn2d``: upsample, pad, FIR-convolve, downsample in plain PyTorch) with the
  [1, 3, 3, 1] filter: x2 up / down sampling, blur;
* equalized learning rate (weights stored N(0, 1) and scaled at run time), the scaled leaky ReLU;
* the mapping network: PixelNorm + equalized-lr linear layers (lr multiplier 0.01) with scaled leaky ReLU;
* the channel table per resolution and the ToRGB skip output (1x1 conv added to the FIR-upsampled skip);
* the discriminator StyleNAT trains with: StyleGAN2's residual/skip discriminator in the Haar wavelet
  domain (StyleSwin's), with spectral norm and minibatch standard deviation.

Images are NCHW; StyleNAT's synthesis network itself is in :mod:`namodels.models.stylenat`.  Module and
parameter names are those of the released checkpoints (see ``convert_official_generator``).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BLUR_KERNEL",
    "fir_kernel",
    "upfirdn2d",
    "FIRUpsample",
    "FIRDownsample",
    "Blur",
    "ScaledLeakyReLU",
    "EqualLinear",
    "EqualConv2d",
    "PixelNorm",
    "MappingNetwork",
    "stage_channels",
    "ToRGB",
    "HaarTransform",
    "InverseHaarTransform",
    "ConvLayer",
    "DiscriminatorBlock",
    "FromRGB",
    "MinibatchStdDev",
    "StyleNATDiscriminator",
]

BLUR_KERNEL = (1, 3, 3, 1)
SQRT2 = math.sqrt(2.0)


# ---------------------------------------------------------------------------------------------
# FIR filtering (upfirdn2d) in plain PyTorch
# ---------------------------------------------------------------------------------------------


def fir_kernel(taps: Sequence[float]) -> torch.Tensor:
    """Separable 2-D FIR kernel from 1-D taps (outer product), normalised to sum 1."""
    k = torch.tensor(taps, dtype=torch.float32)
    if k.dim() == 1:
        k = k[None, :] * k[:, None]
    return k / k.sum()


def upfirdn2d(x: torch.Tensor, kernel: torch.Tensor, up: int = 1, down: int = 1, pad=(0, 0)) -> torch.Tensor:
    """Upsample by zero insertion, pad, convolve with ``kernel`` (true convolution), downsample.

    ``x: [B, C, H, W]``; ``pad``: ``(p0, p1)`` for both axes or ``(x0, x1, y0, y1)``; negative
    padding crops.  Every channel is filtered independently.
    """
    if len(pad) == 2:
        pad = (pad[0], pad[1], pad[0], pad[1])
    b, c, h, w = x.shape
    y = x.reshape(b * c, 1, h, w)
    if up > 1:
        y = y.reshape(b * c, 1, h, 1, w, 1)
        y = F.pad(y, (0, up - 1, 0, 0, 0, up - 1))
        y = y.reshape(b * c, 1, h * up, w * up)
    x0, x1, y0, y1 = pad
    y = F.pad(y, (max(x0, 0), max(x1, 0), max(y0, 0), max(y1, 0)))
    y = y[:, :, max(-y0, 0): y.shape[2] - max(-y1, 0), max(-x0, 0): y.shape[3] - max(-x1, 0)]
    weight = torch.flip(kernel, (0, 1)).to(y)[None, None]
    y = F.conv2d(y, weight)
    y = y[:, :, ::down, ::down]
    return y.reshape(b, c, y.shape[2], y.shape[3])


class FIRUpsample(nn.Module):
    """x2 upsampling with a FIR low-pass (StyleGAN2 skip path)."""

    def __init__(self, taps=BLUR_KERNEL, factor: int = 2):
        super().__init__()
        self.factor = factor
        # Not persistent: a constant, so state dicts hold only learned tensors.
        self.register_buffer("kernel", fir_kernel(taps) * factor**2, persistent=False)
        p = self.kernel.shape[0] - factor
        self.pad = ((p + 1) // 2 + factor - 1, p // 2)

    def forward(self, x):
        return upfirdn2d(x, self.kernel, up=self.factor, pad=self.pad)


class FIRDownsample(nn.Module):
    """FIR low-pass then x2 decimation."""

    def __init__(self, taps=BLUR_KERNEL, factor: int = 2):
        super().__init__()
        self.factor = factor
        self.register_buffer("kernel", fir_kernel(taps), persistent=False)
        p = self.kernel.shape[0] - factor
        self.pad = ((p + 1) // 2, p // 2)

    def forward(self, x):
        return upfirdn2d(x, self.kernel, down=self.factor, pad=self.pad)


class Blur(nn.Module):
    """FIR low-pass with explicit padding (before a strided conv in the discriminator)."""

    def __init__(self, taps, pad):
        super().__init__()
        self.register_buffer("kernel", fir_kernel(taps), persistent=False)
        self.pad = tuple(pad)

    def forward(self, x):
        return upfirdn2d(x, self.kernel, pad=self.pad)


# ---------------------------------------------------------------------------------------------
# Mapping network
# ---------------------------------------------------------------------------------------------


class ScaledLeakyReLU(nn.Module):
    """Leaky ReLU (0.2) times sqrt(2) with an optional learned bias added first (StyleGAN2's
    "fused" leaky ReLU); the gain keeps activations at unit variance."""

    def __init__(self, channels: int | None = None, negative_slope: float = 0.2, bias_dim: int = 1):
        super().__init__()
        self.negative_slope = negative_slope
        self.bias_dim = bias_dim
        self.bias = nn.Parameter(torch.zeros(channels)) if channels else None

    def forward(self, x):
        if self.bias is not None:
            shape = [1] * x.dim()
            shape[self.bias_dim] = -1
            x = x + self.bias.view(shape)
        return F.leaky_relu(x, self.negative_slope) * SQRT2


class EqualLinear(nn.Module):
    """Linear layer with equalized learning rate: weights stored as N(0, 1) / lr_mul and scaled by
    ``lr_mul / sqrt(fan_in)`` at run time (so Adam's effective step is ``lr * lr_mul``)."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, bias_init: float = 0.0,
                 lr_mul: float = 1.0, activation: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim) / lr_mul)
        self.bias = nn.Parameter(torch.full((out_dim,), float(bias_init))) if bias else None
        self.scale = lr_mul / math.sqrt(in_dim)
        self.lr_mul = lr_mul
        self.activation = activation

    def forward(self, x):
        bias = self.bias * self.lr_mul if self.bias is not None else None
        if self.activation:
            out = F.linear(x, self.weight * self.scale)
            if bias is not None:
                out = out + bias
            return F.leaky_relu(out, 0.2) * SQRT2
        return F.linear(x, self.weight * self.scale, bias)

    def extra_repr(self):
        return f"{self.weight.shape[1]}, {self.weight.shape[0]}, lr_mul={self.lr_mul}, activation={self.activation}"


class PixelNorm(nn.Module):
    """Normalises each latent vector to unit mean square."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class MappingNetwork(nn.Module):
    """z -> w: PixelNorm then ``n_layers`` equalized-lr linear layers with scaled leaky ReLU."""

    def __init__(self, z_dim: int = 512, w_dim: int = 512, n_layers: int = 8, lr_mul: float = 0.01):
        super().__init__()
        self.norm = PixelNorm()
        dims = [z_dim] + [w_dim] * n_layers
        self.layers = nn.ModuleList(
            EqualLinear(dims[i], dims[i + 1], lr_mul=lr_mul, activation=True) for i in range(n_layers)
        )

    def forward(self, z):
        x = self.norm(z)
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------
# Synthesis output
# ---------------------------------------------------------------------------------------------


def stage_channels(size: int, channel_multiplier: int = 2, channels: Sequence[int] | None = None) -> dict[int, int]:
    """Channels per resolution 4..size.

    Default: the StyleGAN2 table (512 up to 32x32, then 256, 128, ... times ``channel_multiplier``
    from 64x64); ``channels`` overrides it with one width per resolution (e.g. small test models).
    """
    resolutions = [2**i for i in range(2, int(math.log2(size)) + 1)]
    if channels is not None:
        channels = [int(c) for c in channels]
        if len(channels) != len(resolutions) or min(channels) < 1:
            raise ValueError(f"channels: expected one positive width per resolution {resolutions}, got {channels}")
        return dict(zip(resolutions, channels))
    table = {4: 512, 8: 512, 16: 512, 32: 512, 64: 256, 128: 128, 256: 64, 512: 32, 1024: 16}
    return {r: table[r] * (channel_multiplier if r >= 64 else 1) for r in resolutions}


class ToRGB(nn.Module):
    """1x1 conv to RGB (not modulated) added to the FIR-upsampled skip image."""

    def __init__(self, dim: int, upsample_skip: bool):
        super().__init__()
        self.conv = nn.Conv2d(dim, 3, kernel_size=1)
        self.upsample = FIRUpsample() if upsample_skip else None

    def forward(self, x, skip=None):  # x [B, H, W, C] channels last
        out = self.conv(x.permute(0, 3, 1, 2))
        if skip is not None:
            if self.upsample is not None and skip.shape[-1] != out.shape[-1]:
                skip = self.upsample(skip)
            out = out + skip
        return out


# ---------------------------------------------------------------------------------------------
# Discriminator
# ---------------------------------------------------------------------------------------------


def _haar_kernels():
    lo = torch.ones(1, 2) / math.sqrt(2.0)
    hi = lo.clone()
    hi[0, 0] = -hi[0, 0]
    return lo.T * lo, hi.T * lo, lo.T * hi, hi.T * hi  # ll, lh, hl, hh


class HaarTransform(nn.Module):
    """One-level 2-D Haar DWT: ``[B, C, H, W] -> [B, 4C, H/2, W/2]`` (ll, lh, hl, hh)."""

    def __init__(self):
        super().__init__()
        for name, k in zip(("ll", "lh", "hl", "hh"), _haar_kernels()):
            self.register_buffer(name, k, persistent=False)

    def forward(self, x):
        return torch.cat([upfirdn2d(x, getattr(self, n), down=2) for n in ("ll", "lh", "hl", "hh")], dim=1)


class InverseHaarTransform(nn.Module):
    """Inverse of :class:`HaarTransform`."""

    def __init__(self):
        super().__init__()
        ll, lh, hl, hh = _haar_kernels()
        for name, k in zip(("ll", "lh", "hl", "hh"), (ll, -lh, -hl, hh)):
            self.register_buffer(name, k, persistent=False)

    def forward(self, x):
        parts = x.chunk(4, dim=1)
        return sum(upfirdn2d(p, getattr(self, n), up=2, pad=(1, 0, 1, 0))
                   for p, n in zip(parts, ("ll", "lh", "hl", "hh")))


def _maybe_sn(module: nn.Module, use_sn: bool) -> nn.Module:
    return nn.utils.parametrizations.spectral_norm(module) if use_sn else module


class EqualConv2d(nn.Module):
    """Conv with equalized learning rate (used when spectral norm is off)."""

    def __init__(self, in_ch, out_ch, kernel_size, stride=1, padding=0, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_ch, in_ch, kernel_size, kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_ch)) if bias else None
        self.scale = 1 / math.sqrt(in_ch * kernel_size**2)
        self.stride, self.padding = stride, padding

    def forward(self, x):
        return F.conv2d(x, self.weight * self.scale, self.bias, stride=self.stride, padding=self.padding)


class ConvLayer(nn.Sequential):
    """[blur] -> conv (spectral-normed or equalized) -> biased scaled leaky ReLU."""

    def __init__(self, in_ch, out_ch, kernel_size, downsample=False, blur_kernel=BLUR_KERNEL, activate=True,
                 sn=True):
        layers = []
        if downsample:
            p = (len(blur_kernel) - 2) + (kernel_size - 1)
            layers.append(Blur(blur_kernel, ((p + 1) // 2, p // 2)))
            stride, padding = 2, 0
        else:
            stride, padding = 1, kernel_size // 2
        bias = not activate
        if sn:
            layers.append(_maybe_sn(nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding, bias=bias), True))
        else:
            layers.append(EqualConv2d(in_ch, out_ch, kernel_size, stride, padding, bias=bias))
        if activate:
            layers.append(ScaledLeakyReLU(out_ch))
        super().__init__(*layers)


class DiscriminatorBlock(nn.Module):
    """3x3 conv then a blurred stride-2 3x3 conv."""

    def __init__(self, in_ch, out_ch, blur_kernel=BLUR_KERNEL, sn=True):
        super().__init__()
        self.conv1 = ConvLayer(in_ch, in_ch, 3, sn=sn)
        self.conv2 = ConvLayer(in_ch, out_ch, 3, downsample=True, blur_kernel=blur_kernel, sn=sn)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class FromRGB(nn.Module):
    """Wavelet-domain input branch: (optionally) halve the image in the wavelet domain
    (IDWT -> FIR downsample -> DWT), 1x1 conv of the 12 sub-band channels, add to the features."""

    def __init__(self, out_ch, downsample=True, blur_kernel=BLUR_KERNEL, sn=True):
        super().__init__()
        if downsample:
            self.iwt, self.downsample, self.dwt = InverseHaarTransform(), FIRDownsample(blur_kernel), HaarTransform()
        else:
            self.iwt = self.downsample = self.dwt = None
        self.conv = ConvLayer(3 * 4, out_ch, 1, sn=sn)

    def forward(self, wavelets, features=None):
        if self.downsample is not None:
            wavelets = self.dwt(self.downsample(self.iwt(wavelets)))
        out = self.conv(wavelets)
        return wavelets, out if features is None else out + features


class MinibatchStdDev(nn.Module):
    """Appends the average (over features and positions) std-dev across groups of samples."""

    def __init__(self, group_size: int = 4, num_channels: int = 1):
        super().__init__()
        self.group_size, self.num_channels = group_size, num_channels

    def forward(self, x):
        b, c, h, w = x.shape
        g = min(self.group_size, b)
        while b % g:  # the largest group size <= group_size that divides the batch
            g -= 1
        f = self.num_channels
        y = x.view(g, -1, f, c // f, h, w)
        y = torch.sqrt(y.var(0, unbiased=False) + 1e-8)  # [B/g, f, c/f, h, w]
        y = y.mean(dim=(2, 3, 4))  # [B/g, f]
        y = y[:, :, None, None].repeat(g, 1, h, w)  # sample i uses group i % (B/g), like the view above
        return torch.cat([x, y], dim=1)


class StyleNATDiscriminator(nn.Module):
    """StyleGAN2-style discriminator in the Haar wavelet domain (StyleSwin's, used by StyleNAT).

    Args:
        size: input resolution (power of two, 32..1024).
        channel_multiplier: widens resolutions >= 64 (2 in the release).
        sn: spectral normalisation on every conv / linear (True in the release); otherwise
            equalized-lr layers.
        stddev_group: minibatch standard deviation group size (4).
        channels: optional width per resolution 4..size (overrides the table; small models).
    """

    def __init__(self, size: int = 256, channel_multiplier: int = 2, blur_kernel=BLUR_KERNEL, sn: bool = True,
                 stddev_group: int = 4, stddev_feat: int = 1, channels: Sequence[int] | None = None):
        super().__init__()
        if size not in (32, 64, 128, 256, 512, 1024):
            raise ValueError(f"size: expected a power of two from 32 to 1024, got {size}")
        channels = stage_channels(size, channel_multiplier, channels)
        self.size = size
        self.dwt = HaarTransform()
        self.from_rgbs = nn.ModuleList()
        self.convs = nn.ModuleList()
        log_size = int(math.log2(size)) - 1  # features start at size / 2 after the DWT
        in_ch = channels[size]
        for i in range(log_size, 2, -1):
            out_ch = channels[2 ** (i - 1)]
            self.from_rgbs.append(FromRGB(in_ch, downsample=i != log_size, blur_kernel=blur_kernel, sn=sn))
            self.convs.append(DiscriminatorBlock(in_ch, out_ch, blur_kernel, sn=sn))
            in_ch = out_ch
        self.from_rgbs.append(FromRGB(channels[4], blur_kernel=blur_kernel, sn=sn))
        self.stddev = MinibatchStdDev(stddev_group, stddev_feat)
        self.final_conv = ConvLayer(in_ch + stddev_feat, channels[4], 3, sn=sn)
        if sn:
            self.final_linear = nn.Sequential(
                _maybe_sn(nn.Linear(channels[4] * 16, channels[4]), True),
                ScaledLeakyReLU(channels[4]),
                _maybe_sn(nn.Linear(channels[4], 1), True),
            )
        else:
            self.final_linear = nn.Sequential(
                EqualLinear(channels[4] * 16, channels[4], activation=True), EqualLinear(channels[4], 1)
            )

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        if img.dim() != 4 or img.shape[1] != 3 or img.shape[-1] != self.size or img.shape[-2] != self.size:
            raise ValueError(f"img: expected [B, 3, {self.size}, {self.size}], got {tuple(img.shape)}")
        wavelets = self.dwt(img)
        features = None
        for from_rgb, conv in zip(self.from_rgbs, self.convs):
            wavelets, features = from_rgb(wavelets, features)
            features = conv(features)
        _, features = self.from_rgbs[-1](wavelets, features)
        out = self.final_conv(self.stddev(features))
        return self.final_linear(out.flatten(1))
