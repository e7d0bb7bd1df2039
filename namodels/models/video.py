"""Causal spatio-temporal video transformer on 3-D neighborhood attention, with streaming inference.

Every token attends to a ``(k_t, k, k)`` neighborhood: the current and the ``k_t - 1`` previous
frames in time (causal), a ``k x k`` spatial window (DiNAT-style: dilation alternates between 1
and ``dilation`` from block to block).  Nothing ever mixes time non-causally:

* the stem is a per-frame conv stack (downsampling in space only);
* positions: rotary embeddings over (t, y, x) inside attention (relative, so no bias table on the
  causal axis) plus an optional learned absolute *spatial* embedding (the same for every frame);
* LayerNorm / MLP / heads are per token; the clip classifier mean-pools over everything.

So output frame ``t`` depends on input frames ``<= t`` only and the model runs as a stream:
:meth:`VideoNAT.init_stream` + :meth:`VideoNAT.step` take one frame at a time and keep, per
block, a ring buffer of ``k_t`` frames of keys/values (the ``k_t - 1`` frames the next query
needs plus the slot the next frame is written to): memory is constant in clip length, and the
outputs equal the full-clip forward (the test suite checks both).

Layout: clips are ``[B, T, C, H, W]``; tokens are channels-last ``[B, T, h, w, D]``.

>>> import timm, torch, namodels
>>> model = timm.create_model("video_nat_tiny", img_size=64).eval()
>>> clip = torch.rand(2, 16, 3, 64, 64)
>>> pred = model(clip)                      # [2, 16, 3, 64, 64]: pred[:, t] predicts clip[:, t + 1]
>>> state = model.init_stream()
>>> outs = [model.step(clip[:, t], state)["next_frame"] for t in range(16)]   # same values, one frame at a time
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, resample_abs_pos_embed, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

import ops

from .backbone import ClassifierHooks, check_batch, check_model_arguments
from .layers import init_weights

__all__ = ["VideoNAT", "StreamState", "VideoRope", "CausalVideoAttention"]


# --------------------------------------------------------------------------------------------- positions


class VideoRope(nn.Module):
    """Rotary position embedding over (t, y, x) for heads-last ``[..., heads, head_dim]`` tensors.

    The head dimension is split into rotation pairs; the pairs are shared out over the three axes
    (time gets the remainder) and each axis uses frequencies ``theta ** (-i / n_axis)``.  Logits
    then depend on the *difference* of positions only: relative in time, which is what a causal
    axis allows (no bias table), and the same rotation is applied in the full-clip forward and in
    streaming, so both agree.  Angles are computed in float64 so frame indices of long streams
    keep their precision.
    """

    def __init__(self, head_dim: int, theta: float = 100.0):
        super().__init__()
        if head_dim % 2 or head_dim < 6:
            raise ValueError(f"head_dim: rotary embedding over 3 axes needs an even head_dim >= 6, got {head_dim}")
        pairs = head_dim // 2
        spatial = pairs // 3
        self.pairs = (pairs - 2 * spatial, spatial, spatial)  # (t, y, x)
        self.head_dim, self.theta = head_dim, float(theta)

    def _axis_angles(self, positions: torch.Tensor, n: int) -> torch.Tensor:
        freqs = self.theta ** (-torch.arange(n, dtype=torch.float64, device=positions.device) / n)
        return positions.to(torch.float64)[:, None] * freqs  # [L, n]

    def tables(self, t_positions: torch.Tensor, h: int, w: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Unit complex rotations ``[T, h, w, 1, head_dim // 2]`` for frames at ``t_positions``
        (complex128 for float64 ``dtype``, else complex64)."""
        dev = t_positions.device
        at = self._axis_angles(t_positions, self.pairs[0])
        ay = self._axis_angles(torch.arange(h, device=dev), self.pairs[1])
        ax = self._axis_angles(torch.arange(w, device=dev), self.pairs[2])
        T = at.shape[0]
        angles = torch.cat([
            at[:, None, None, :].expand(T, h, w, -1),
            ay[None, :, None, :].expand(T, h, w, -1),
            ax[None, None, :, :].expand(T, h, w, -1),
        ], dim=-1)
        rot = torch.polar(torch.ones_like(angles), angles)
        return (rot if dtype == torch.float64 else rot.to(torch.complex64))[..., None, :]

    @staticmethod
    def rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Rotates consecutive pairs (x0, x1) of the last axis of ``x`` by the unit complex ``rot``."""
        real = torch.float64 if rot.dtype == torch.complex128 else torch.float32
        xc = torch.view_as_complex(x.to(real).unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


# --------------------------------------------------------------------------------------------- attention


def spatial_dilation(size: Sequence[int], kernel_size: int, dilation: int) -> tuple[int, int]:
    """Dilation per spatial axis for a token map of ``size``: ``dilation`` lowered so ``k * d <= L``."""
    for axis, L in enumerate(size):
        if L < kernel_size:
            raise ValueError(
                f"kernel_size: spatial kernel {kernel_size} exceeds the token map ({tuple(size)}, axis {axis}); "
                f"use a larger img_size or smaller kernel_size / patch_size"
            )
    return tuple(max(1, min(dilation, L // kernel_size)) for L in size)


class CausalVideoAttention(ops.NeighborhoodAttention3D):
    """``ops.NeighborhoodAttention3D`` causal in time, with rotary positions, plus a one-frame step.

    Full clip: ``na3d`` with kernel ``(min(k_t, T), k, k)`` and ``is_causal=(True, False, False)``;
    a kernel of ``T`` on the time axis has the same causal window as any larger one (frames
    ``max(t - k_t + 1, 0) .. t``), so short clips are allowed.

    Step (frame ``t``): the new frame's queries attend to the keys of the ``n = min(t + 1, k_t)``
    frames in the window.  The spatial window does not depend on the frame, so this is one batched
    2-D NA call (``na2d``, frames folded into the batch) with ``return_lse=True``, and the per-frame
    results are merged through their log-sum-exps: exactly the 3-D causal window, one frame of
    queries at the cost of one frame.  Keys are cached *after* rotation (absolute frame index), so
    the merge order does not matter and the cache can be a ring buffer.
    """

    def __init__(self, dim: int, num_heads: int, kernel_size: int = 7, temporal_kernel: int = 3, dilation: int = 1,
                 qkv_bias: bool = True, proj_drop: float = 0.0, rope_theta: float = 100.0,
                 backend: Optional[str] = None):
        if temporal_kernel < 1:
            raise ValueError(f"temporal_kernel: must be >= 1, got {temporal_kernel}")
        super().__init__(dim, num_heads, (temporal_kernel, kernel_size, kernel_size), dilation=(1, dilation, dilation),
                         is_causal=(True, False, False), qkv_bias=qkv_bias, rel_pos_bias=False, proj_drop=proj_drop,
                         backend=backend)
        self.rope = VideoRope(self.head_dim, rope_theta)

    def _qkv(self, x: torch.Tensor, rot: torch.Tensor):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        return self.rope.rotate(q, rot), self.rope.rotate(k, rot), v

    def forward(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, h, w, C]``; ``rot`` from :meth:`VideoRope.tables`."""
        if x.dim() != 5 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected [B, T, h, w, {self.dim}], got {tuple(x.shape)}")
        T, h, w = x.shape[1:4]
        q, k, v = self._qkv(x, rot)
        kt, ks = self.kernel_size[0], self.kernel_size[1]
        dil = spatial_dilation((h, w), ks, self.dilation[1])
        out = ops.na3d(q, k, v, (min(kt, T), ks, ks), dilation=(1, *dil), is_causal=(True, False, False),
                       backend=self.backend)
        return self.proj_drop(self.proj(out.flatten(-2)))

    def step(self, x: torch.Tensor, rot: torch.Tensor, cache: "_KVRing") -> torch.Tensor:
        """``x: [B, h, w, C]`` (one frame); updates ``cache`` in place and returns ``[B, h, w, C]``."""
        B, h, w, _ = x.shape
        q, k, v = self._qkv(x, rot)
        keys, values = cache.push(k, v)  # [B, n, h, w, heads, D], n = frames in the window
        n = keys.shape[1]
        ks = self.kernel_size[1]
        dil = spatial_dilation((h, w), ks, self.dilation[1])
        q_rep = q.unsqueeze(1).expand(B, n, *q.shape[1:]).reshape(B * n, *q.shape[1:])
        out, lse = ops.na2d(q_rep, keys.reshape(B * n, *keys.shape[2:]), values.reshape(B * n, *values.shape[2:]),
                            ks, dilation=dil, return_lse=True, backend=self.backend)
        weight = torch.softmax(lse.view(B, n, h, w, self.num_heads).float(), dim=1).to(out.dtype)
        out = (out.view(B, n, h, w, self.num_heads, -1) * weight.unsqueeze(-1)).sum(1)
        return self.proj_drop(self.proj(out.flatten(-2)))


class _KVRing:
    """Keys/values of the last ``size`` frames of one block, in a preallocated ring buffer.

    Frame ``t`` is written to slot ``t % size``.  The attention over the filled slots is
    order-free (keys carry their rotary frame position), so slots are never shifted or copied.
    """

    def __init__(self, size: int):
        self.size, self.count = size, 0
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def push(self, k: torch.Tensor, v: torch.Tensor):
        if self.keys is None:
            self.keys = k.new_empty(k.shape[0], self.size, *k.shape[1:])
            self.values = v.new_empty(v.shape[0], self.size, *v.shape[1:])
        elif self.keys.shape[2:] != k.shape[1:] or self.keys.shape[0] != k.shape[0]:
            raise ValueError(f"frame: stream was started with frames of token shape {tuple(self.keys.shape[2:4])} "
                             f"and batch {self.keys.shape[0]}, got {tuple(k.shape[1:3])} and batch {k.shape[0]}")
        slot = self.count % self.size
        self.keys[:, slot] = k
        self.values[:, slot] = v
        self.count += 1
        n = min(self.count, self.size)
        return self.keys[:, :n], self.values[:, :n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


@dataclass
class StreamState:
    """What :meth:`VideoNAT.step` carries from one frame to the next (constant size)."""

    caches: List[_KVRing]
    t: int = 0  # index of the next frame
    pooled_sum: Optional[torch.Tensor] = None  # running sum of per-frame mean features (classifier)

    def nbytes(self) -> int:
        """Bytes held by the state's tensors (the key/value rings and the pooled sum)."""
        total = sum(c.nbytes() for c in self.caches)
        if self.pooled_sum is not None:
            total += self.pooled_sum.numel() * self.pooled_sum.element_size()
        return total


# --------------------------------------------------------------------------------------------- blocks


class VideoNABlock(nn.Module):
    """Pre-norm block: ``x + DropPath(gamma1 * attn(norm1(x)))``, ``x + DropPath(gamma2 * mlp(norm2(x)))``."""

    def __init__(self, dim: int, num_heads: int, kernel_size: int, temporal_kernel: int, dilation: int,
                 mlp_ratio: float, qkv_bias: bool, proj_drop: float, drop_path: float, layer_scale: Optional[float],
                 rope_theta: float, backend: Optional[str]):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalVideoAttention(dim, num_heads, kernel_size, temporal_kernel, dilation, qkv_bias=qkv_bias,
                                         proj_drop=proj_drop, rope_theta=rope_theta, backend=backend)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop)
        self.layer_scale = layer_scale is not None
        if self.layer_scale:
            self.gamma1 = nn.Parameter(layer_scale * torch.ones(dim))
            self.gamma2 = nn.Parameter(layer_scale * torch.ones(dim))

    def _residuals(self, x, attn_out):
        x = x + self.drop_path(self.gamma1 * attn_out if self.layer_scale else attn_out)
        y = self.mlp(self.norm2(x))
        return x + self.drop_path(self.gamma2 * y if self.layer_scale else y)

    def forward(self, x, rot):
        return self._residuals(x, self.attn(self.norm1(x), rot))

    def step(self, x, rot, cache: _KVRing):
        return self._residuals(x, self.attn.step(self.norm1(x), rot, cache))


class FrameStem(nn.Module):
    """Per-frame conv stem: ``log2(patch_size)`` 3x3 stride-2 convs (GELU between), then LayerNorm.

    Frames are folded into the batch, so the stem never mixes time and needs no streaming state.
    """

    def __init__(self, in_chans: int, dim: int, patch_size: int):
        super().__init__()
        if patch_size < 2 or patch_size & (patch_size - 1):
            raise ValueError(f"patch_size: must be a power of two >= 2, got {patch_size}")
        n = int(math.log2(patch_size))
        widths = [in_chans] + [max(dim // 2 ** (n - 1 - i), 8) for i in range(n - 1)] + [dim]
        layers = []
        for i in range(n):
            layers.append(nn.Conv2d(widths[i], widths[i + 1], 3, stride=2, padding=1))
            if i < n - 1:
                layers.append(nn.GELU())
        self.proj = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dim)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W] -> [N, H/p, W/p, D]``."""
        return self.norm(self.proj(frames).permute(0, 2, 3, 1))


class FrameDecoder(nn.Module):
    """Next-frame head: per-token LayerNorm -> Linear(D, p*p*C) -> pixel shuffle (unpatchify)."""

    def __init__(self, dim: int, out_chans: int, patch_size: int):
        super().__init__()
        self.patch_size, self.out_chans = patch_size, out_chans
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, patch_size * patch_size * out_chans)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, h, w, D] -> [N, C, h*p, w*p]``."""
        n, h, w, _ = x.shape
        p, c = self.patch_size, self.out_chans
        # pixel shuffle written out (channel c*p*p + i*p + j -> pixel (h*p + i, w*p + j)): traced graphs keep
        # exact strides, where aten.pixel_shuffle's backward breaks a compiled training step on CPU
        y = self.proj(self.norm(x)).reshape(n, h, w, c, p, p)
        return y.permute(0, 3, 1, 4, 2, 5).reshape(n, c, h * p, w * p)


# --------------------------------------------------------------------------------------------- model


class VideoNAT(ClassifierHooks, nn.Module):
    """Causal video transformer (isotropic: one token resolution, ``depth`` blocks).

    Args:
        img_size: frame size the absolute spatial embedding is made for (others are interpolated).
        in_chans: frame channels (the next-frame head predicts the same number).
        patch_size: stem downsampling (power of two); tokens are ``H/p x W/p`` per frame.
        embed_dim, depth, num_heads, mlp_ratio: transformer width / depth / heads / MLP ratio.
        kernel_size: spatial window k (odd); temporal_kernel: k_t, frames each token sees (itself included).
        dilation: DiNAT-style: odd blocks use this spatial dilation, even blocks 1 (lowered where
            ``k * d`` exceeds the token map).  ``dilations`` (one per block) overrides the pattern.
        layer_scale: initial gamma of the per-channel layer scale (``None``: no layer scale).
        abs_pos_embed: learned absolute spatial embedding added after the stem (same for every frame).
        rope_theta: rotary base; num_classes: clip classifier classes (0: none).
        predict_residual: the next-frame head predicts ``frame_t + delta`` instead of the frame itself.
        backend: NA backend for every attention (``None``: ``ops.use_backend`` or automatic).

    ``forward(clip)`` returns next-frame predictions when ``num_classes == 0``, else clip logits;
    :meth:`predict_next_frames` and :meth:`classify` name them explicitly.
    """

    def __init__(
        self,
        img_size: int | Sequence[int] = 64,
        in_chans: int = 3,
        patch_size: int = 4,
        embed_dim: int = 192,
        depth: int = 8,
        num_heads: int = 6,
        mlp_ratio: float = 3.0,
        kernel_size: int = 7,
        temporal_kernel: int = 3,
        dilation: int = 2,
        dilations: Optional[Sequence[int]] = None,
        layer_scale: Optional[float] = 1e-2,
        abs_pos_embed: bool = True,
        rope_theta: float = 100.0,
        qkv_bias: bool = True,
        num_classes: int = 0,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        predict_residual: bool = False,
        backend: Optional[str] = None,
    ):
        super().__init__()
        img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        if len(img_size) != 2 or any(s % patch_size for s in img_size):
            raise ValueError(f"img_size: expected (H, W) divisible by patch_size {patch_size}, got {img_size}")
        check_model_arguments(kernel_size=kernel_size, mlp_ratio=mlp_ratio, drop_path_rate=drop_path_rate,
                              backend=backend)
        if dilations is None:
            dilations = [1 if i % 2 == 0 else dilation for i in range(depth)]
        elif len(dilations) != depth:
            raise ValueError(f"dilations: expected one per block ({depth}), got {list(dilations)}")
        self.img_size, self.in_chans, self.patch_size = img_size, in_chans, patch_size
        self.temporal_kernel, self.kernel_size, self.dilations = temporal_kernel, kernel_size, list(dilations)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.predict_residual = predict_residual
        self.grad_checkpointing = False
        grid = tuple(s // patch_size for s in img_size)
        spatial_dilation(grid, kernel_size, 1)  # the default grid must fit the window

        self.patch_embed = FrameStem(in_chans, embed_dim, patch_size)
        if abs_pos_embed:
            self.pos_embed = nn.Parameter(torch.zeros(1, *grid, embed_dim))
            trunc_normal_(self.pos_embed, std=0.02)
        else:
            self.register_parameter("pos_embed", None)
        self.pos_drop = nn.Dropout(drop_rate)
        rates = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList([
            VideoNABlock(embed_dim, num_heads, kernel_size, temporal_kernel, d, mlp_ratio, qkv_bias, proj_drop_rate,
                         rates[i], layer_scale, rope_theta, backend)
            for i, d in enumerate(self.dilations)
        ])
        self.rope = self.blocks[0].attn.rope  # same table for every block (parameter-free)
        self.norm = nn.LayerNorm(embed_dim)
        self.frame_head = FrameDecoder(embed_dim, in_chans, patch_size)
        self.head_drop = nn.Dropout(drop_rate)
        self.num_classes = num_classes
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(init_weights)

    # ---- timm conventions

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False):
        return dict(stem=r"^patch_embed|^pos_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None):
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    # ---- full clip

    def _embed_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W] -> [N, h, w, D]``: stem + absolute spatial embedding."""
        if frames.dim() != 4 or frames.shape[1] != self.in_chans:
            raise ValueError(f"frames: expected [N, {self.in_chans}, H, W], got {tuple(frames.shape)}")
        if frames.shape[-1] % self.patch_size or frames.shape[-2] % self.patch_size:
            raise ValueError(f"frames: H and W must be divisible by patch_size {self.patch_size}, "
                             f"got {tuple(frames.shape[-2:])}")
        x = self.patch_embed(frames)
        if self.pos_embed is not None:
            pos = self.pos_embed
            if pos.shape[1:3] != x.shape[1:3]:
                pos = resample_abs_pos_embed(pos.flatten(1, 2), list(x.shape[1:3]), list(pos.shape[1:3]),
                                             num_prefix_tokens=0).unflatten(1, x.shape[1:3])
            x = x + pos
        return self.pos_drop(x)

    def forward_features(self, clip: torch.Tensor) -> torch.Tensor:
        """``[B, T, C, H, W] -> [B, T, h, w, D]`` (normalised tokens)."""
        if clip.dim() != 5:
            raise ValueError(f"clip: expected [B, T, C, H, W], got {tuple(clip.shape)}")
        check_batch(clip, "clip")
        B, T = clip.shape[:2]
        x = self._embed_frames(clip.flatten(0, 1))
        x = x.unflatten(0, (B, T))
        rot = self.rope.tables(torch.arange(T, device=x.device), x.shape[2], x.shape[3], x.dtype)
        for blk in self.blocks:
            if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
                x = torch.utils.checkpoint.checkpoint(blk, x, rot, use_reentrant=False)
            else:
                x = blk(x, rot)
        return self.norm(x)

    def _decode(self, feats: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """``[N, h, w, D]`` tokens and their input frames ``[N, C, H, W]`` -> next-frame predictions."""
        pred = self.frame_head(feats)
        return frames + pred if self.predict_residual else pred

    def predict_next_frames(self, clip: torch.Tensor, feats: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, T, C, H, W] -> [B, T, C, H, W]``: output ``t`` predicts input frame ``t + 1``."""
        if feats is None:
            feats = self.forward_features(clip)
        B, T = clip.shape[:2]
        return self._decode(feats.flatten(0, 1), clip.flatten(0, 1)).unflatten(0, (B, T))

    def forward_head(self, feats: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Clip classifier: mean over (T, h, w) of ``[B, T, h, w, D]`` -> logits."""
        x = self.head_drop(feats.mean(dim=(1, 2, 3)))
        return x if pre_logits else self.head(x)

    def classify(self, clip: torch.Tensor) -> torch.Tensor:
        if self.num_classes == 0:
            raise ValueError("num_classes: this model has no classifier (num_classes=0)")
        return self.forward_head(self.forward_features(clip))

    def forward(self, clip: torch.Tensor) -> torch.Tensor:
        return self.predict_next_frames(clip) if self.num_classes == 0 else self.classify(clip)

    # ---- streaming

    def init_stream(self) -> StreamState:
        """Empty state for :meth:`step`; its buffers are allocated by the first frame."""
        return StreamState(caches=[_KVRing(self.temporal_kernel) for _ in self.blocks])

    @torch.no_grad()
    def step(self, frame: torch.Tensor, state: StreamState) -> dict:
        """Feeds frame ``state.t`` (``[B, C, H, W]``), advancing ``state`` in place.

        Returns ``next_frame`` (prediction of frame ``t + 1``, ``[B, C, H, W]``), ``features``
        (``[B, h, w, D]``, normalised tokens of frame ``t``) and, with a classifier, ``logits`` of
        the clip seen so far.  Each equals the full-clip forward on frames ``0..t``.  Inference
        only (no autograd: the caches are updated in place).
        """
        if frame.dim() != 4:
            raise ValueError(f"frame: expected [B, C, H, W], got {tuple(frame.shape)}")
        x = self._embed_frames(frame)
        t = torch.tensor([state.t], device=x.device)
        rot = self.rope.tables(t, x.shape[1], x.shape[2], x.dtype)[0]
        for blk, cache in zip(self.blocks, state.caches):
            x = blk.step(x, rot, cache)
        feats = self.norm(x)
        out = {"features": feats, "next_frame": self._decode(feats, frame)}
        pooled = feats.mean(dim=(1, 2))
        state.pooled_sum = pooled if state.pooled_sum is None else state.pooled_sum + pooled
        state.t += 1
        if self.num_classes > 0:
            out["logits"] = self.head(state.pooled_sum / state.t)
        return out

    @torch.no_grad()
    def rollout(self, context: torch.Tensor, num_frames: int, state: Optional[StreamState] = None) -> torch.Tensor:
        """Autoregressive generation: streams the ``[B, T0, C, H, W]`` context, then feeds each
        prediction back as the next frame.  Returns the ``num_frames`` generated frames
        ``[B, num_frames, C, H, W]`` (constant memory in ``T0 + num_frames``)."""
        if context.dim() != 5 or context.shape[1] < 1:
            raise ValueError(f"context: expected [B, T0>=1, C, H, W], got {tuple(context.shape)}")
        if num_frames < 0:
            raise ValueError(f"num_frames: must be >= 0, got {num_frames}")
        state = self.init_stream() if state is None else state
        for t in range(context.shape[1]):
            pred = self.step(context[:, t], state)["next_frame"]
        frames = []
        for _ in range(num_frames):
            frames.append(pred)
            if len(frames) < num_frames:
                pred = self.step(pred, state)["next_frame"]
        if not frames:
            return context.new_empty(context.shape[0], 0, *context.shape[2:])
        return torch.stack(frames, dim=1).contiguous()


# --------------------------------------------------------------------------------------------- registry


def _cfg(**kwargs):
    # No hosted weights: a trained checkpoint loads with pretrained_cfg_overlay=dict(file=...).
    cfg = dict(url="", num_classes=0, input_size=(3, 64, 64), crop_pct=1.0, interpolation="bilinear",
               mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), first_conv="patch_embed.proj.0", classifier="head")
    return {**cfg, **kwargs}


default_cfgs = generate_default_cfgs({
    "video_nat_nano.untrained": _cfg(input_size=(1, 32, 32), mean=(0.0,), std=(1.0,)),
    "video_nat_tiny.untrained": _cfg(),
    "video_nat_small.untrained": _cfg(),
})


def _create(variant: str, pretrained: bool, defaults: dict, **kwargs) -> VideoNAT:
    return build_model_with_cfg(VideoNAT, variant, pretrained, **{**defaults, **kwargs})


@register_model
def video_nat_nano(pretrained: bool = False, **kwargs) -> VideoNAT:
    """~0.16M parameters, 32x32 grey frames (moving digits): width 64, 4 blocks, (3, 3, 3) windows, dilation 1/2."""
    return _create("video_nat_nano", pretrained, dict(img_size=32, in_chans=1, embed_dim=64, depth=4, num_heads=4,
                                                      mlp_ratio=2.0, kernel_size=3, dilation=2), **kwargs)


@register_model
def video_nat_tiny(pretrained: bool = False, **kwargs) -> VideoNAT:
    """~3.2M parameters: width 192, 8 blocks, 6 heads, (3, 7, 7) windows, dilation 1/2."""
    return _create("video_nat_tiny", pretrained, dict(embed_dim=192, depth=8, num_heads=6, kernel_size=7,
                                                      temporal_kernel=3, dilation=2), **kwargs)


@register_model
def video_nat_small(pretrained: bool = False, **kwargs) -> VideoNAT:
    """~18.5M parameters: width 384, 12 blocks, 12 heads, (3, 7, 7) windows, dilation 1/2."""
    return _create("video_nat_small", pretrained, dict(embed_dim=384, depth=12, num_heads=12, kernel_size=7,
                                                       temporal_kernel=3, dilation=2), **kwargs)
