"""Independent reference forward of the official NAT / DiNAT / DiNAT_s classifiers.

Written from the facts in docs/models.md and the official code's behaviour, with
plain tensor ops on a *state dict* (official key names) -- no namodels module, no ops backend.  It
stands in for the original implementation, which cannot be downloaded here.

Attention follows the window formulas of the CUDA kernels the official checkpoints were trained
with (NATTEN before 0.15, stride 1): per axis a window start and an RPB start per query, written
below as closed-form expressions with the border cases spelled out, independently of
``ops.window``.  ``tests/test_models.py`` also checks them against the dense-mask oracle.

Small feature maps: the official module zero-pads the (normalised) tokens at the bottom/right to
``kernel_size * dilation`` and crops back (``dilation_mode='pad'``); ``'clamp'`` instead runs the
block with dilation ``max(1, min(d, L // K))`` per axis (our models' default), padding only to ``K``.
Everything runs in the dtype of the inputs (use float64).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.nn.functional as F

StateDict = Dict[str, torch.Tensor]


# --- attention ------------------------------------------------------------------------------------------

def window_starts(L: int, K: int, d: int):
    """Per query index: first key index of its window and first RPB index (old NATTEN kernels)."""
    ns = K // 2
    starts, pb = [], []
    for i in range(L):
        if d == 1:
            s = max(i - ns, 0) + (L - i - ns - 1 if i + ns >= L else 0)
            b = ns + (ns - i if i < ns else 0) + (L - i - 1 - ns if i + ns >= L else 0)
        elif i - ns * d < 0:
            s, b = i % d, K - 1 - i // d
        elif i + ns * d >= L:
            a = (L // d) * d
            rem = L - a
            s = L - rem + i % d - 2 * ns * d if i % d < rem else a + i % d - K * d
            b = (L - i - 1) // d
        else:
            s, b = i - ns * d, ns
        starts.append(s)
        pb.append(b)
    return torch.tensor(starts), torch.tensor(pb)


def neighborhood_attention_2d(q, k, v, rpb, K: int, dilation: Sequence[int]):
    """q, k, v: [B, H, W, heads, D]; rpb [heads, 2K-1, 2K-1]; returns [B, H, W, heads, D]."""
    B, H, W, nh, D = q.shape
    (sh, ph), (sw, pw) = window_starts(H, K, dilation[0]), window_starts(W, K, dilation[1])
    slots = torch.arange(K)
    rows = sh[:, None] + slots[None] * dilation[0]  # [H, K] key rows per query row
    cols = sw[:, None] + slots[None] * dilation[1]  # [W, K]
    # keys[b, y, x, a, c] = k[b, rows[y, a], cols[x, c]]
    keys = k[:, rows[:, None, :, None], cols[None, :, None, :]]  # [B, H, W, K, K, heads, D]
    vals = v[:, rows[:, None, :, None], cols[None, :, None, :]]
    logits = torch.einsum("byxhd,byxachd->byxhac", q * D ** -0.5, keys)
    bias_rows = ph[:, None] + slots[None]  # [H, K]
    bias_cols = pw[:, None] + slots[None]  # [W, K]
    bias = rpb[:, bias_rows[:, None, :, None], bias_cols[None, :, None, :]]  # [heads, H, W, K, K]
    logits = logits + bias.permute(1, 2, 0, 3, 4)[None]
    attn = torch.softmax(logits.reshape(B, H, W, nh, K * K), dim=-1).reshape(logits.shape)
    return torch.einsum("byxhac,byxachd->byxhd", attn, vals)


def _linear(sd: StateDict, name: str, x):
    return F.linear(x, sd[name + ".weight"], sd.get(name + ".bias"))


def _ln(sd: StateDict, name: str, x):
    return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps=1e-5)


def attention_layer(sd: StateDict, p: str, x, heads: int, K: int, dilation: int, dilation_mode: str):
    """Official NeighborhoodAttention2D on channels-last x, including its pad-to-window behaviour."""
    B, H, W, C = x.shape
    if dilation_mode == "pad":
        dh = dw = dilation
    else:
        dh, dw = max(1, min(dilation, H // K)), max(1, min(dilation, W // K))
    Hp, Wp = max(H, K * dh), max(W, K * dw)
    x = F.pad(x, (0, 0, 0, Wp - W, 0, Hp - H))
    qkv = _linear(sd, p + "qkv", x).reshape(B, Hp, Wp, 3, heads, C // heads)
    out = neighborhood_attention_2d(qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :], sd[p + "rpb"], K,
                                    (dh, dw))
    out = out.reshape(B, Hp, Wp, C)[:, :H, :W]
    return _linear(sd, p + "proj", out)


def block(sd: StateDict, p: str, x, heads: int, K: int, dilation: int, dilation_mode: str):
    """x + gamma1 * attn(norm1(x)); x + gamma2 * mlp(norm2(x)) (gammas only if in the state dict)."""
    g1, g2 = sd.get(p + "gamma1"), sd.get(p + "gamma2")
    y = attention_layer(sd, p + "attn.", _ln(sd, p + "norm1", x), heads, K, dilation, dilation_mode)
    x = x + (g1 * y if g1 is not None else y)
    y = _linear(sd, p + "mlp.fc2", F.gelu(_linear(sd, p + "mlp.fc1", _ln(sd, p + "norm2", x))))
    return x + (g2 * y if g2 is not None else y)


def _head(sd: StateDict, x):
    return _linear(sd, "head", _ln(sd, "norm", x).mean(dim=(1, 2)))


# --- NAT / DiNAT ----------------------------------------------------------------------------------------

def nat_logits(sd: StateDict, images, depths, num_heads, kernel_size, dilations=None, dilation_mode="pad"):
    """Official NAT / DiNAT classifier: conv tokenizer, levels (blocks then conv downsampler), norm, head."""
    x = F.conv2d(images, sd["patch_embed.proj.0.weight"], sd["patch_embed.proj.0.bias"], stride=2, padding=1)
    x = F.conv2d(x, sd["patch_embed.proj.1.weight"], sd["patch_embed.proj.1.bias"], stride=2, padding=1)
    x = _ln(sd, "patch_embed.norm", x.permute(0, 2, 3, 1))
    for i, depth in enumerate(depths):
        for j in range(depth):
            d = 1 if dilations is None else dilations[i][j]
            x = block(sd, f"levels.{i}.blocks.{j}.", x, num_heads[i], kernel_size, d, dilation_mode)
        if i < len(depths) - 1:
            x = F.conv2d(x.permute(0, 3, 1, 2), sd[f"levels.{i}.downsample.reduction.weight"], stride=2, padding=1)
            x = _ln(sd, f"levels.{i}.downsample.norm", x.permute(0, 2, 3, 1))
    return _head(sd, x)


# --- DiNAT_s --------------------------------------------------------------------------------------------

def _patch_merging(sd: StateDict, p: str, x):
    B, H, W, C = x.shape
    x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
    parts = [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]]
    return _linear(sd, p + "reduction", _ln(sd, p + "norm", torch.cat(parts, dim=-1)))


def dinat_s_logits(sd: StateDict, images, depths, num_heads, kernel_size, dilations=None, dilation_mode="pad"):
    """Official DiNAT_s classifier: 4x4 patch embedding (input padded to a multiple of 4), layers
    (blocks then Swin patch merging), norm, head."""
    H, W = images.shape[-2:]
    images = F.pad(images, (0, (4 - W % 4) % 4, 0, (4 - H % 4) % 4))
    x = F.conv2d(images, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=4)
    x = _ln(sd, "patch_embed.norm", x.permute(0, 2, 3, 1))
    for i, depth in enumerate(depths):
        for j in range(depth):
            d = 1 if dilations is None else dilations[i][j]
            x = block(sd, f"layers.{i}.blocks.{j}.", x, num_heads[i], kernel_size, d, dilation_mode)
        if i < len(depths) - 1:
            x = _patch_merging(sd, f"layers.{i}.downsample.", x)
    return _head(sd, x)
