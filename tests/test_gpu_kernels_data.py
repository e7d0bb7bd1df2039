"""The input pipeline's Triton kernels against the torch forms they replace, under ``TRITON_INTERPRET=1`` on the
CPU (on a GPU, the same tests run on CUDA tensors).

* :func:`namodels.data.gpu_resize.resize_crops` (one launch for a batch's crops) vs ``F.interpolate`` image by
  image: every pixel within one level, nearly all exact;
* :mod:`namodels.data.gpu_augment_kernel` (one launch per RandAugment layer) vs GPUAugment's torch ops, which the
  tests of ``test_gpu_augment.py`` hold to timm's PIL ops: identical bytes, op by op and on mixed batches.
"""
from __future__ import annotations

import pytest
import torch

from namodels.data import gpu_augment as ga
from namodels.data.gpu_resize import resize_crops, resize_crops_reference

from tests.test_gpu_augment import augment_with_spec, one_op_params, smooth_images

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_crops(n: int, seed: int, placements=None):
    g = torch.Generator().manual_seed(seed)
    images, windows, modes = [], [], []
    for k in range(n):
        h_img, w_img = (int(v) for v in torch.randint(12, 70, (2,), generator=g))
        image = torch.randint(0, 256, (3, h_img, w_img), generator=g, dtype=torch.uint8)
        if k % 2:  # channels-last memory, as nvImageCodec returns it
            image = image.permute(1, 2, 0).contiguous().permute(2, 0, 1)
        h = int(torch.randint(3, h_img + 1, (1,), generator=g))
        w = int(torch.randint(3, w_img + 1, (1,), generator=g))
        top = int(torch.randint(0, h_img - h + 1, (1,), generator=g))
        left = int(torch.randint(0, w_img - w + 1, (1,), generator=g))
        images.append(image.to(DEVICE))
        windows.append((top, left, h, w))
        modes.append(ga.INTERPOLATIONS[1 + k % 2])
    return images, windows, modes


def assert_close_to_reference(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours.int() - ref.int()).abs()
    assert diff.max() <= 1, diff.max()
    assert (diff > 0).float().mean() < 1e-3


@pytest.mark.parametrize("size", [(16, 16), (20, 36)])
def test_training_crops_match_interpolate(size):
    """Up- and down-scaled windows of both layouts with both filters, resized to the whole output."""
    images, windows, modes = random_crops(8, seed=sum(size))
    placements = [(*size, 0, 0)] * len(images)
    ours = resize_crops(images, windows, placements, modes, size, kernel=True)
    assert ours.dtype == torch.uint8 and ours.shape == (8, 3, *size)
    assert_close_to_reference(ours, resize_crops_reference(images, windows, placements, modes, size))


def test_validation_centre_crops_match_interpolate():
    """The whole image resized to its short-side size with the centre kept, as ValStage places it."""
    images, _, modes = random_crops(6, seed=3)
    size = (18, 18)
    windows, placements = [], []
    for image in images:
        h, w = image.shape[1:]
        rh, rw = (21, int(21 * w / h)) if h <= w else (int(21 * h / w), 21)
        windows.append((0, 0, h, w))
        placements.append((rh, rw, int(round((rh - 18) / 2.0)), int(round((rw - 18) / 2.0))))
    ours = resize_crops(images, windows, placements, modes, size, kernel=True)
    assert_close_to_reference(ours, resize_crops_reference(images, windows, placements, modes, size))


def test_resize_crops_rejects_bad_arguments():
    images, windows, modes = random_crops(2, seed=0)
    placements = [(8, 8, 0, 0)] * 2
    with pytest.raises(ValueError, match="windows\\[0\\]"):
        resize_crops(images, [(0, 0, 999, 4), windows[1]], placements, modes, (8, 8), kernel=True)
    with pytest.raises(ValueError, match="modes\\[1\\]"):
        resize_crops(images, windows, placements, [modes[0], "lanczos"], (8, 8), kernel=True)
    with pytest.raises(ValueError, match="placements\\[0\\]"):
        resize_crops(images, windows, [(8, 8, 1, 0), placements[1]], modes, (8, 8), kernel=True)
    with pytest.raises(ValueError, match="images\\[0\\]"):
        resize_crops([images[0].float(), images[1]], windows, placements, modes, (8, 8), kernel=True)
    with pytest.raises(ValueError, match="one per sample"):
        resize_crops(images, windows[:1], placements, modes, (8, 8), kernel=True)


@pytest.mark.parametrize("name", ga.SUPPORTED_OPS)
def test_each_op_kernel_matches_torch_ops(name):
    x = smooth_images(3, 17, 21, seed=2).to(DEVICE)
    x[0, :, :4] = 0          # a flat region: equalize and autocontrast tables with empty bins
    modes = (ga._NEAREST, ga._BILINEAR, ga._BICUBIC) if ga._OPS[name][0] == ga._GEO else (ga._BICUBIC,)
    for magnitude, negate in ((3.0, True), (10.0, False)):
        for mode in modes:
            spec, params = one_op_params(name, magnitude, negate, mode, 3, (17, 21))
            aug = augment_with_spec(spec)
            ours = aug.apply(x, params, kernels=True)
            ref = aug.apply(x, params, kernels=False)
            assert torch.equal(ours, ref), f"{name} m={magnitude} negate={negate} mode={mode}"


@pytest.mark.parametrize("config", ["rand-m9-mstd0.5-inc1", "rand-n3-m15-mstd1-p1.0", None])
def test_mixed_batches_match_torch_ops(config):
    """Per-sample ops, flips before the first layer, several layers, ColorJitter after when RandAugment is off."""
    aug = ga.GPUAugment(hflip=0.5, vflip=0.3, auto_augment=config, color_jitter=0.4)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 256, (12, 3, 19, 23), generator=g, dtype=torch.uint8)
        x[0] //= 3
        x = x.to(DEVICE)
        params = aug.draw(12, (19, 23), torch.Generator().manual_seed(seed + 10))
        ours = aug.apply(x, params, kernels=True)
        assert torch.equal(ours, aug.apply(x, params, kernels=False)), (config, seed)


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from namodels.data import gpu_augment_kernel as aug, gpu_resize as resize

# names Triton's generated argument binder assigns before it specialises the arguments
RESERVED = {"params", "specialization", "options", "backend", "specialize_impl"}

def build(fn, pointers, ints, constants, **options):
    assert not RESERVED & set(fn.arg_names), fn.arg_names
    signature = {**pointers, **{name: "i32" for name in ints}, **{name: "constexpr" for name in constants}}
    triton.compile(triton.compiler.ASTSource(fn, signature, constants, {}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, **options})

build(resize._resize_kernel, {"src": "*u8", "out": "*u8", "layout": "*i64"}, ("SIZE_Y", "SIZE_X"),
      {"COLUMNS": 13, "BLOCK_Y": resize.BLOCK, "BLOCK_X": resize.BLOCK})
for has_lut in (True, False):
    build(aug._layer_kernel, {"src": "*u8", "dst": "*u8", "lut": "*u8", "mean": "*fp32", "rows": "*fp64"}, ("H", "W"),
          {"HAS_LUT": has_lut, "HAS_MEAN": not has_lut, "P": aug.PARAMS, "BLOCK_Y": aug.BLOCK, "BLOCK_X": aug.BLOCK},
          enable_fp_fusion=False)
"""


def test_kernels_compile_for_hopper():
    """The interpreter runs neither Triton's compiler nor its argument binder: compile both kernels for sm_90 offline
    (ptxas ships with Triton), in a process without ``TRITON_INTERPRET``."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
