"""The image pipeline's device end (``namodels.data.device_transforms``, ``ClassificationDataModule.
on_after_batch_transfer``): the loaders hand over uint8, the device normalises with timm's numbers."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_transform

from namodels.data import ClassificationDataModule
from namodels.data.device_transforms import DeviceNormalize

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _images(n=4, size=24, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size + 7, size + 3, 3), dtype=np.uint8)) for _ in range(n)]


def test_device_normalisation_equals_timms_cpu_transform():
    images = _images()
    uint8 = create_transform((3, 24, 24), crop_pct=0.875, interpolation="bicubic", normalize=False)
    float32 = create_transform((3, 24, 24), crop_pct=0.875, interpolation="bicubic", mean=MEAN, std=STD)
    batch = torch.stack([uint8(im) for im in images])
    assert batch.dtype == torch.uint8
    expected = torch.stack([float32(im) for im in images])
    assert torch.equal(DeviceNormalize(MEAN, STD)(batch, training=False), expected)


def test_random_erasing_only_while_training():
    batch = torch.full((8, 3, 16, 16), 128, dtype=torch.uint8)
    transform = DeviceNormalize(MEAN, STD, re_prob=1.0, re_mode="const", re_count=1)
    plain = DeviceNormalize(MEAN, STD)(batch, training=True)
    assert torch.equal(transform(batch, training=False), plain)
    erased = transform(batch, training=True)
    changed = (erased != plain).flatten(1).any(1)
    assert changed.all()  # probability 1: a box in every image, filled with zeros ("const")
    assert (erased[erased != plain] == 0).all()


def test_float_batches_are_refused():
    with pytest.raises(ValueError, match="images: expected a uint8"):
        DeviceNormalize(MEAN, STD)(torch.zeros(2, 3, 8, 8), training=False)


def _synthetic_module():
    cfg = dict(name="synthetic", format="synthetic", num_classes=10, img_size=16, train_samples=8, val_samples=4,
               batch_size=4, num_workers=0, augment=dict(re_prob=0.0))
    dm = ClassificationDataModule(cfg, seed=0)
    dm.use_model_defaults(dict(mean=MEAN, std=STD))
    return dm


def test_synthetic_batches_travel_as_uint8_and_arrive_normalised():
    dm = _synthetic_module()
    images, targets, skipped = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 16, 16)
    out, _, _ = dm.on_after_batch_transfer((images, targets, skipped), 0)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (images.float() / 255 - mean) / std)


def test_new_model_defaults_renew_the_normalisation():
    dm = _synthetic_module()
    batch = next(iter(dm.train_dataloader()))
    first, _, _ = dm.on_after_batch_transfer(batch, 0)
    dm.use_model_defaults(dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)))
    second, _, _ = dm.on_after_batch_transfer(batch, 0)
    torch.testing.assert_close(second, batch[0].float() / 127.5 - 1)
    assert not torch.equal(first, second)


def test_a_batch_without_images_passes_through():
    dm = _synthetic_module()
    assert dm.on_after_batch_transfer((None, None, ["a.jpg"]), 0) == (None, None, ["a.jpg"])


@pytest.mark.parametrize("count, splits", [(1, 0), (3, 0), (2, 2)])
def test_batch_random_erasing_draws_timms_boxes(count, splits):
    """The same random state gives the boxes timm's per-image loop erases (const mode on ones shows them)."""
    from timm.data.random_erasing import RandomErasing

    from namodels.data.device_transforms import BatchRandomErasing

    kwargs = dict(probability=0.6, mode="const", max_count=count, min_count=1, num_splits=splits, device="cpu")
    for seed in range(5):
        random.seed(seed)
        expected = RandomErasing(**kwargs)(torch.ones(16, 3, 40, 52))
        after_timm = random.random()
        random.seed(seed)
        got = BatchRandomErasing(**kwargs)(torch.ones(16, 3, 40, 52))
        assert torch.equal(got, expected) and (got == 0).any()
        assert random.random() == after_timm  # the same draws consumed


def test_batch_random_erasing_fills_like_timm():
    """pixel mode: erased pixels are standard normal; rand mode: one normal colour per box and channel."""
    from namodels.data.device_transforms import BatchRandomErasing

    random.seed(0)
    torch.manual_seed(0)
    x = torch.full((64, 3, 32, 32), 7.0)
    pixel = BatchRandomErasing(1.0, mode="pixel", device="cpu")(x.clone())
    values = pixel[pixel != 7.0]
    assert values.numel() > 5000 and abs(values.mean()) < 0.05 and abs(values.std() - 1) < 0.05
    assert ((pixel != 7.0).flatten(1).any(1)).all()  # probability 1: every image erased
    rand = BatchRandomErasing(1.0, mode="rand", device="cpu")(x.clone())
    for image in rand:
        erased = image != 7.0
        for c in range(3):
            assert image[c][erased[c]].unique().numel() == 1
