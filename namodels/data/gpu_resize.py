"""Crop and antialiased resize of a whole batch of differently sized images in one kernel launch.

The GPU input pipeline turns each decoded image into a ``S x S`` training or validation crop.  Per image that is
torch's ``F.interpolate(crop.float(), mode=..., antialias=True)`` (PIL's resampling filters, as timm's CPU
transform resizes), then rounding to uint8: four or five kernel launches, a few hundred per batch, each with the
host cost of a Python call.  :func:`resize_crops` does the whole batch in one Triton launch with the same
arithmetic: per output pixel, the filter taps and normalised weights of torch's antialiased kernels (``support =
filter radius * max(scale, 1)``, weights from the filter at ``(j + min - centre + 0.5) / max(scale, 1)`` divided by
their sum), summed along the width inside a sum along the height as torch sums them, in float32, rounded half to
even and clamped.  A pixel can differ from torch's by one level where float rounding lands on a half.

Each sample names its source window (``top, left, height, width`` in its image) and where its ``S x S`` output
sits in the virtual resized image (``resized height and width, offset``): the training crop resizes the window to
exactly ``S x S``; validation resizes the whole image to its short-side size and keeps the centre.  Images may be
channels-first (torchvision's decoder) or channels-last (nvImageCodec's) views: the kernel reads each through its
own strides from one packed buffer.

On CPU tensors (the tests) the kernel runs under ``TRITON_INTERPRET=1``; :func:`resize_crops_reference` is the
per-image torch form it is checked against, and what CPU stages use.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # torch builds without Triton: the reference path only
    triton = None

MODES = ("bilinear", "bicubic")
BLOCK = 32  # output tile side per program


def _check(images: Sequence[torch.Tensor], windows: Sequence, placements: Sequence, modes: Sequence[str],
           size: tuple[int, int]) -> None:
    if not (len(images) == len(windows) == len(placements) == len(modes)):
        raise ValueError(f"images, windows, placements, modes: expected one per sample, got {len(images)}, "
                         f"{len(windows)}, {len(placements)}, {len(modes)}")
    for k, image in enumerate(images):
        if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.dim() != 3 \
                or image.shape[0] != 3:
            got = (image.dtype, tuple(image.shape)) if isinstance(image, torch.Tensor) else type(image).__name__
            raise ValueError(f"images[{k}]: expected a uint8 [3, H, W] tensor, got {got}")
    for k, ((top, left, h, w), image) in enumerate(zip(windows, images)):
        if h < 1 or w < 1 or top < 0 or left < 0 or top + h > image.shape[1] or left + w > image.shape[2]:
            raise ValueError(f"windows[{k}]: {(top, left, h, w)} is not inside the image of size "
                             f"{tuple(image.shape[1:])}")
    for k, (rh, rw, oy, ox) in enumerate(placements):
        if oy < 0 or ox < 0 or oy + size[0] > rh or ox + size[1] > rw:
            raise ValueError(f"placements[{k}]: output {size} at ({oy}, {ox}) is not inside the resized size "
                             f"({rh}, {rw})")
    for k, mode in enumerate(modes):
        if mode not in MODES:
            raise ValueError(f"modes[{k}]: expected one of {MODES}, got {mode!r}")


def resize_crops_reference(images: Sequence[torch.Tensor], windows: Sequence, placements: Sequence,
                           modes: Sequence[str], size: tuple[int, int]) -> torch.Tensor:
    """What :func:`resize_crops` computes, image by image with ``F.interpolate``: uint8 ``[N, 3, *size]``."""
    _check(images, windows, placements, modes, size)
    device = images[0].device if len(images) else torch.device("cpu")
    out = torch.empty((len(images), 3, *size), device=device)
    for k, (image, (top, left, h, w), (rh, rw, oy, ox), mode) in enumerate(zip(images, windows, placements, modes)):
        crop = image[:, top:top + h, left:left + w]
        resized = F.interpolate(crop[None].float(), size=(rh, rw), mode=mode, antialias=True, align_corners=False)[0]
        out[k] = resized[:, oy:oy + size[0], ox:ox + size[1]]
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _layout(image: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The image's memory as a flat view and its (channel, row, column) strides in it; a copy only for views that
    are neither channels-first nor channels-last contiguous (a crop view, say)."""
    if image.is_contiguous():
        return image.reshape(-1), tuple(image.stride())
    hwc = image.permute(1, 2, 0)
    if not hwc.is_contiguous():
        hwc = hwc.contiguous()
    return hwc.reshape(-1), (1, hwc.stride(0), hwc.stride(1))


def resize_crops(images: Sequence[torch.Tensor], windows: Sequence, placements: Sequence, modes: Sequence[str],
                 size: tuple[int, int], kernel: bool | None = None) -> torch.Tensor:
    """Crop ``windows[k]`` (``top, left, height, width``) of ``images[k]`` (uint8 ``[3, H, W]``, one device), resize
    it antialiased with ``modes[k]`` ('bilinear' or 'bicubic') to ``placements[k][:2]`` (resized height, width) and
    keep ``size`` pixels from offset ``placements[k][2:]``: uint8 ``[N, 3, *size]``.

    ``kernel``: one Triton launch for the batch (by default on CUDA where Triton is installed) rather than
    :func:`resize_crops_reference`."""
    size = (int(size[0]), int(size[1]))
    n = len(images)
    device = images[0].device if n else torch.device("cpu")
    if kernel is None:
        kernel = device.type == "cuda" and triton is not None
    if not kernel:
        return resize_crops_reference(images, windows, placements, modes, size)
    _check(images, windows, placements, modes, size)
    out = torch.empty((n, 3, *size), dtype=torch.uint8, device=device)
    if n == 0:
        return out
    flats, rows, offset = [], [], 0
    for image, window, placement, mode in zip(images, windows, placements, modes):
        flat, strides = _layout(image)
        flats.append(flat)
        rows.append([offset, *strides, *window, *placement, MODES.index(mode)])
        offset += flat.numel()
    packed = torch.cat(flats) if n > 1 else flats[0]
    layout = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        layout = layout.pin_memory().to(device, non_blocking=True)
    grid = (n, triton.cdiv(size[0], BLOCK) * triton.cdiv(size[1], BLOCK))
    # (a kernel argument may not be called ``params``: Triton's generated binder uses that name)
    _resize_kernel[grid](packed, out, layout, size[0], size[1], COLUMNS=layout.shape[1], BLOCK_Y=BLOCK,
                         BLOCK_X=BLOCK)
    return out


if triton is not None:
    @triton.jit
    def _filter(x, BICUBIC: tl.constexpr):
        """torch's antialias filters: the triangle, or the cubic with a = -0.5 (PIL's)."""
        ax = tl.abs(x)
        if BICUBIC:
            a = -0.5
            near = ((a + 2.0) * ax - (a + 3.0)) * ax * ax + 1.0
            far = ((a * ax - 5.0 * a) * ax + 8.0 * a) * ax - 4.0 * a
            return tl.where(ax < 1.0, near, tl.where(ax < 2.0, far, 0.0))
        return tl.maximum(1.0 - ax, 0.0)

    @triton.jit
    def _span(index, offset, in_size, out_size, BICUBIC: tl.constexpr):
        """Per output index: the first source index, the tap count, the filter's centre and 1 / max(scale, 1)."""
        scale = in_size.to(tl.float32) / out_size.to(tl.float32)
        if BICUBIC:  # the filter's radius: 2 (cubic) or 1 (triangle), widened by the downscale factor
            support = tl.where(scale >= 1.0, 2.0 * scale, 2.0)
        else:
            support = tl.where(scale >= 1.0, scale, 1.0)
        invscale = tl.where(scale >= 1.0, 1.0 / scale, 1.0)
        centre = scale * ((index + offset).to(tl.float32) + 0.5)
        first = tl.maximum((centre - support + 0.5).to(tl.int32), 0)
        count = tl.minimum((centre + support + 0.5).to(tl.int32), in_size) - first
        taps = (2.0 * support).to(tl.int32) + 2   # an upper bound of ``count`` for every index
        return first, count, centre, invscale, taps

    @triton.jit
    def _weight_sum(first, count, centre, invscale, taps, BICUBIC: tl.constexpr):
        total = tl.zeros_like(centre)
        for j in range(0, taps):
            w = _filter((j + first - centre + 0.5) * invscale, BICUBIC)
            total += tl.where(j < count, w, 0.0)
        return tl.where(total != 0.0, total, 1.0)

    @triton.jit
    def _resize_tile(src, out_ptr, sc, sr, sx, top, left, h, w, rh, rw, oy, ox, SIZE_Y, SIZE_X, pid_t,
                     BICUBIC: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_X: tl.constexpr):
        tiles_x = tl.cdiv(SIZE_X, BLOCK_X)
        iy = (pid_t // tiles_x) * BLOCK_Y + tl.arange(0, BLOCK_Y)
        ix = (pid_t % tiles_x) * BLOCK_X + tl.arange(0, BLOCK_X)
        y0, ny, cy, sy, taps_y = _span(iy, oy, h, rh, BICUBIC)
        x0, nx, cx, sxs, taps_x = _span(ix, ox, w, rw, BICUBIC)
        total_y = _weight_sum(y0, ny, cy, sy, taps_y, BICUBIC)
        total_x = _weight_sum(x0, nx, cx, sxs, taps_x, BICUBIC)
        keep = (iy < SIZE_Y)[:, None] & (ix < SIZE_X)[None, :]
        for c in range(0, 3):
            acc = tl.zeros((BLOCK_Y, BLOCK_X), dtype=tl.float32)
            for i in range(0, taps_y):
                wy = _filter((i + y0 - cy + 0.5) * sy, BICUBIC) / total_y
                row_ok = i < ny
                rows = (top + tl.minimum(y0 + i, h - 1)).to(tl.int64) * sr
                line = tl.zeros((BLOCK_Y, BLOCK_X), dtype=tl.float32)
                for j in range(0, taps_x):
                    wx = _filter((j + x0 - cx + 0.5) * sxs, BICUBIC) / total_x
                    col_ok = j < nx
                    cols = (left + tl.minimum(x0 + j, w - 1)).to(tl.int64) * sx
                    mask = keep & row_ok[:, None] & col_ok[None, :]
                    v = tl.load(src + c * sc + rows[:, None] + cols[None, :], mask=mask, other=0).to(tl.float32)
                    line += tl.where(col_ok, wx, 0.0)[None, :] * v
                acc += line * tl.where(row_ok, wy, 0.0)[:, None]
            # round half to even, then clamp, as ``round_().clamp_(0, 255)``
            r = tl.floor(acc + 0.5)
            odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
            r = tl.where(((r - acc) == 0.5) & odd, r - 1.0, r)
            r = tl.minimum(tl.maximum(r, 0.0), 255.0)
            dst = out_ptr + c * SIZE_Y * SIZE_X + iy[:, None] * SIZE_X + ix[None, :]
            tl.store(dst, r.to(tl.uint8), mask=keep)

    @triton.jit
    def _resize_kernel(src, out, layout, SIZE_Y, SIZE_X, COLUMNS: tl.constexpr, BLOCK_Y: tl.constexpr,
                       BLOCK_X: tl.constexpr):
        """Program (sample, output tile).  ``layout`` rows: offset, channel/row/column strides, window (top, left,
        height, width), placement (resized height, width, offset y, x), mode (0 bilinear, 1 bicubic)."""
        b = tl.program_id(0)
        pid_t = tl.program_id(1)
        row = layout + b * COLUMNS
        base = src + tl.load(row)
        sc, sr, sx = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
        top, left = tl.load(row + 4).to(tl.int32), tl.load(row + 5).to(tl.int32)
        h, w = tl.load(row + 6).to(tl.int32), tl.load(row + 7).to(tl.int32)
        rh, rw = tl.load(row + 8).to(tl.int32), tl.load(row + 9).to(tl.int32)
        oy, ox = tl.load(row + 10).to(tl.int32), tl.load(row + 11).to(tl.int32)
        dst = out + b.to(tl.int64) * 3 * SIZE_Y * SIZE_X
        if tl.load(row + 12) == 1:
            _resize_tile(base, dst, sc, sr, sx, top, left, h, w, rh, rw, oy, ox, SIZE_Y, SIZE_X, pid_t,
                         True, BLOCK_Y, BLOCK_X)
        else:
            _resize_tile(base, dst, sc, sr, sx, top, left, h, w, rh, rw, oy, ox, SIZE_Y, SIZE_X, pid_t,
                         False, BLOCK_Y, BLOCK_X)
