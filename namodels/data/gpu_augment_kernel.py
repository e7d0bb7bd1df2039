"""RandAugment layers (and the flips before them) as one Triton launch per layer on CUDA batches.

:class:`~namodels.data.gpu_augment.GPUAugment`'s torch form splits each layer into groups of samples and runs a
few dozen torch ops per group: several hundred kernel launches per batch, each a Python call in the process that
feeds the training GPU, and as many passes over the batch.  Here each layer is one program per (sample, tile)
that applies the sample's own op, chosen by a per-sample row of parameters: the point ops read a per-sample
lookup table (built by the torch form's :func:`~namodels.data.gpu_augment.point_tables` from one batched
histogram), the PIL blends compute their degenerate image in place (luma, the luma's rounded mean, black, or the
SMOOTH filter with its border kept), the affine ops gather through PIL's nearest, bilinear or a = -1 bicubic taps
in float64.  The first layer reads its input flipped where the sample drew a flip.

The arithmetic is the torch form's, operation for operation (float contraction off), so the two agree exactly;
the tests check that under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

from . import gpu_augment as ga

try:
    import triton
    import triton.language as tl
except ImportError:  # torch builds without Triton: GPUAugment keeps its torch form
    triton = None

BLOCK = 32
# a sample's op kind in a layer
COPY, POINT, BLEND, AFFINE = range(4)
_KINDS = {ga._LUT: POINT, ga._BLEND: BLEND, ga._GEO: AFFINE}
PARAMS = 16  # kind, blend code, factor, matrix (6), mode, fill (3), hflip, vflip, unused


def available() -> bool:
    return triton is not None


def _layer_rows(aug, params, layer: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, bool]:
    """Host rows ``[B, PARAMS]`` (float64) for RandAugment layer ``layer`` (None: flips only), with the point-op
    codes and arguments for :func:`point_tables` and whether the layer needs histograms or luma means."""
    h, w = params.image_size
    b = params.hflip.numel()
    rows = torch.zeros((b, PARAMS), dtype=torch.float64)
    rows[:, 10:13] = torch.tensor(aug.fill, dtype=torch.float64)
    if layer in (None, 0):
        rows[:, 13], rows[:, 14] = params.hflip.double(), params.vflip.double()
    codes = torch.full((b,), -1, dtype=torch.long)
    args = torch.zeros(b, dtype=torch.float32)
    if layer is None:
        return rows, codes, args, False, False
    spec, draw = aug.rand_augment, params.rand_augment
    op, arg, applied = draw.op[:, layer], draw.arg[:, layer], draw.applied[:, layer]
    groups = [ga._OPS[name][0] for name in spec.ops]
    code_of = torch.tensor([ga._OPS[name][1] for name in spec.ops], dtype=torch.long)
    kind = torch.tensor([_KINDS[g] for g in groups], dtype=torch.long)[op]
    kind = torch.where(applied, kind, COPY)
    rows[:, 0] = kind.double()
    point, blend, affine = kind == POINT, kind == BLEND, kind == AFFINE
    codes = torch.where(point, code_of[op], -1)
    args = torch.where(point, arg.float(), 0.0)
    needs_histogram = bool((point & ((codes == ga._AUTOCONTRAST) | (codes == ga._EQUALIZE))).any())
    blend_codes = torch.where(blend, code_of[op], -1)
    needs_mean = bool((blend_codes == ga._TO_MEAN).any())
    rows[:, 1] = blend_codes.double()
    rows[:, 2] = ga.blend_factors(spec, op, arg).float().double()
    index = affine.nonzero().flatten()
    if index.numel():
        names = [spec.ops[i] for i in op[index].tolist()]
        rows[index, 3:9] = ga.affine_matrices(names, arg[index], h, w)
        rows[:, 9] = draw.interpolation[:, layer].double()
    return rows, codes, args, needs_histogram, needs_mean


def apply_layers(aug, images: torch.Tensor, params) -> torch.Tensor:
    """Flips and every RandAugment layer of ``params`` on ``images`` (uint8 ``[B, 3, H, W]``): a new batch."""
    b, _, h, w = images.shape
    layers = [None] if aug.rand_augment is None else list(range(aug.rand_augment.num_layers))
    built = [_layer_rows(aug, params, layer) for layer in layers]
    rows = torch.stack([r[0] for r in built])                                   # [L, B, PARAMS]
    if images.device.type == "cuda":
        rows = rows.pin_memory().to(images.device, non_blocking=True)
    else:
        rows = rows.to(images.device)
    src = images.contiguous()
    dummy_lut = torch.zeros(1, dtype=torch.uint8, device=images.device)
    dummy_mean = torch.zeros(1, dtype=torch.float32, device=images.device)
    grid = (b, triton.cdiv(h, BLOCK) * triton.cdiv(w, BLOCK))
    for i, (_, codes, args, needs_histogram, needs_mean) in enumerate(built):
        lut, mean = dummy_lut, dummy_mean
        if bool((codes >= 0).any()):
            lut = ga.point_tables(src, codes.to(src.device), args.to(src.device), needs_histogram).to(torch.uint8)
        if needs_mean:
            luma_sum = ga._luma(src).sum(dim=(1, 2, 3), dtype=torch.int64).double()
            mean = torch.floor(ga._div(luma_sum, h * w) + 0.5).float()
        dst = torch.empty_like(src)
        _layer_kernel[grid](src, dst, lut, mean, rows[i], h, w, HAS_LUT=lut is not dummy_lut,
                            HAS_MEAN=mean is not dummy_mean, P=PARAMS, BLOCK_Y=BLOCK, BLOCK_X=BLOCK,
                            enable_fp_fusion=False)
        src = dst
    return src


if triton is not None:
    @triton.jit
    def _cubic(v1, v2, v3, v4, d):
        p2 = -v1 + v3
        p3 = 2 * (v1 - v2) + v3 - v4
        p4 = -v1 + v2 - v3 + v4
        return v2 + d * (p2 + d * (p3 + d * p4))

    @triton.jit
    def _tap(plane, row, col, H, W, keep, hflip, vflip):
        """Pixel (row, col) of one channel of the (flipped) input, clamped to the border, as float64."""
        r = tl.minimum(tl.maximum(row, 0), H - 1)
        c = tl.minimum(tl.maximum(col, 0), W - 1)
        r = tl.where(vflip, H - 1 - r, r)
        c = tl.where(hflip, W - 1 - c, c)
        return tl.load(plane + r * W + c, mask=keep, other=0).to(tl.float64)

    @triton.jit
    def _layer_kernel(src, dst, lut, mean, rows, H, W, HAS_LUT: tl.constexpr, HAS_MEAN: tl.constexpr,
                      P: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_X: tl.constexpr):
        b = tl.program_id(0)
        t = tl.program_id(1)
        row = rows + b * P
        kind = tl.load(row).to(tl.int32)
        hflip = tl.load(row + 13) != 0.0
        vflip = tl.load(row + 14) != 0.0
        tiles_x = tl.cdiv(W, BLOCK_X)
        y = (t // tiles_x) * BLOCK_Y + tl.arange(0, BLOCK_Y)[:, None]
        x = (t % tiles_x) * BLOCK_X + tl.arange(0, BLOCK_X)[None, :]
        keep = (y < H) & (x < W)
        image = src + b.to(tl.int64) * 3 * H * W
        out = dst + b.to(tl.int64) * 3 * H * W
        # the input as the op sees it: flipped where the sample drew a flip (first layer only)
        ry = tl.where(vflip, H - 1 - y, y)
        rx = tl.where(hflip, W - 1 - x, x)
        if kind == 3:  # affine: PIL's transform through the inverse matrix, fill outside the source
            m0, m1, m2 = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
            m3, m4, m5 = tl.load(row + 6), tl.load(row + 7), tl.load(row + 8)
            mode = tl.load(row + 9).to(tl.int32)
            xs = x.to(tl.float64) + 0.5
            ys = y.to(tl.float64) + 0.5
            sx = m0 * xs + m1 * ys + m2
            sy = m3 * xs + m4 * ys + m5
            inside = (sx >= 0) & (sx < W) & (sy >= 0) & (sy < H)
            fx = sx - 0.5
            fy = sy - 0.5
            x0f = tl.floor(fx)
            y0f = tl.floor(fy)
            dx = fx - x0f
            dy = fy - y0f
            x0 = x0f.to(tl.int32)
            y0 = y0f.to(tl.int32)
            nx = tl.floor(sx).to(tl.int32)
            ny = tl.floor(sy).to(tl.int32)
            for c in range(0, 3):
                plane = image + c * H * W
                fill = tl.load(row + 10 + c)
                if mode == 0:
                    value = _tap(plane, ny, nx, H, W, keep, hflip, vflip)
                elif mode == 1:
                    top = _tap(plane, y0, x0, H, W, keep, hflip, vflip)
                    top = top + (_tap(plane, y0, x0 + 1, H, W, keep, hflip, vflip) - top) * dx
                    bottom = _tap(plane, y0 + 1, x0, H, W, keep, hflip, vflip)
                    bottom = bottom + (_tap(plane, y0 + 1, x0 + 1, H, W, keep, hflip, vflip) - bottom) * dx
                    value = tl.floor(top + (bottom - top) * dy)
                else:
                    r0 = _cubic(_tap(plane, y0 - 1, x0 - 1, H, W, keep, hflip, vflip), _tap(plane, y0 - 1, x0, H, W, keep, hflip, vflip),
                                _tap(plane, y0 - 1, x0 + 1, H, W, keep, hflip, vflip), _tap(plane, y0 - 1, x0 + 2, H, W, keep, hflip, vflip), dx)
                    r1 = _cubic(_tap(plane, y0, x0 - 1, H, W, keep, hflip, vflip), _tap(plane, y0, x0, H, W, keep, hflip, vflip),
                                _tap(plane, y0, x0 + 1, H, W, keep, hflip, vflip), _tap(plane, y0, x0 + 2, H, W, keep, hflip, vflip), dx)
                    r2 = _cubic(_tap(plane, y0 + 1, x0 - 1, H, W, keep, hflip, vflip), _tap(plane, y0 + 1, x0, H, W, keep, hflip, vflip),
                                _tap(plane, y0 + 1, x0 + 1, H, W, keep, hflip, vflip), _tap(plane, y0 + 1, x0 + 2, H, W, keep, hflip, vflip), dx)
                    r3 = _cubic(_tap(plane, y0 + 2, x0 - 1, H, W, keep, hflip, vflip), _tap(plane, y0 + 2, x0, H, W, keep, hflip, vflip),
                                _tap(plane, y0 + 2, x0 + 1, H, W, keep, hflip, vflip), _tap(plane, y0 + 2, x0 + 2, H, W, keep, hflip, vflip), dx)
                    value = tl.floor(tl.minimum(tl.maximum(_cubic(r0, r1, r2, r3, dy), 0.0), 255.0))
                value = tl.where(inside, value, fill)
                tl.store(out + c * H * W + y * W + x, value.to(tl.uint8), mask=keep)
        elif kind == 2:  # PIL ImageEnhance blend with the sample's degenerate image
            code = tl.load(row + 1).to(tl.int32)
            factor = tl.load(row + 2).to(tl.float32)
            at = ry * W + rx
            grey = tl.zeros((BLOCK_Y, BLOCK_X), dtype=tl.float32)
            if code == 0:  # Color: the luma, as convert("L")
                r = tl.load(image + at, mask=keep, other=0).to(tl.int32)
                g = tl.load(image + H * W + at, mask=keep, other=0).to(tl.int32)
                bl = tl.load(image + 2 * H * W + at, mask=keep, other=0).to(tl.int32)
                grey = ((r * 19595 + g * 38470 + bl * 7471 + 0x8000) >> 16).to(tl.float32)
            for c in range(0, 3):
                plane = image + c * H * W
                v = tl.load(plane + at, mask=keep, other=0)
                if code == 0:
                    degenerate = grey
                elif code == 1:  # Contrast: the luma's mean, rounded
                    if HAS_MEAN:
                        degenerate = tl.zeros((BLOCK_Y, BLOCK_X), dtype=tl.float32) + tl.load(mean + b)
                    else:
                        degenerate = tl.zeros((BLOCK_Y, BLOCK_X), dtype=tl.float32)
                elif code == 2:  # Brightness: black
                    degenerate = tl.zeros((BLOCK_Y, BLOCK_X), dtype=tl.float32)
                else:  # Sharpness: SMOOTH, border pixels kept
                    inner = (y >= 1) & (y < H - 1) & (x >= 1) & (x < W - 1)
                    sums = tl.zeros((BLOCK_Y, BLOCK_X), dtype=tl.int32)
                    for dyy in tl.static_range(-1, 2):
                        for dxx in tl.static_range(-1, 2):
                            ny = tl.where(vflip, H - 1 - (y + dyy), y + dyy)
                            nx = tl.where(hflip, W - 1 - (x + dxx), x + dxx)
                            ok = keep & inner
                            sums += tl.load(plane + ny * W + nx, mask=ok, other=0).to(tl.int32)
                    sums += 4 * v.to(tl.int32)
                    smooth = ((2 * sums + 13) // 26).to(tl.float32)
                    degenerate = tl.where(inner, smooth, v.to(tl.float32))
                value = (v.to(tl.float32) - degenerate) * factor + degenerate
                value = tl.minimum(tl.maximum(tl.floor(value), 0.0), 255.0)
                tl.store(out + c * H * W + y * W + x, value.to(tl.uint8), mask=keep)
        else:
            at = ry * W + rx
            for c in range(0, 3):
                v = tl.load(image + c * H * W + at, mask=keep, other=0)
                if kind == 1:
                    if HAS_LUT:
                        v = tl.load(lut + (b * 3 + c) * 256 + v.to(tl.int32), mask=keep, other=0)
                tl.store(out + c * H * W + y * W + x, v, mask=keep)
