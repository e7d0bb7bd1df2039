"""Classification data: ImageNet folder and tar-shard layouts (generated in tmp_path), generic image
folders, the built-in digits, synthetic tensors, unreadable images, layout and config errors, and the
epoch-seeded sampler that makes resumption exact."""
import os
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from namodels.data import ClassificationDataModule, DatasetLayoutError, EpochSampler, build_splits, collate_skipping
from namodels.data.decoding import Unreadable

CLASSES = ("n01", "n02", "n03")
MODEL_DEFAULTS = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), interpolation="bilinear", crop_pct=1.0)


def _image(rng, label, size=12):
    """A random image whose mean colour encodes its label (so tests can check image/label pairing)."""
    base = np.zeros((size, size, 3), np.uint8) + np.uint8(60 * (label + 1))
    noise = rng.integers(0, 20, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(base + noise)


def make_folder(root, per_class=(4, 2), rng=None):
    """root/train/<class>/*.png and root/val/<class>/*.png; returns {split: [(relpath, label)]}."""
    rng = rng or np.random.default_rng(0)
    made = {}
    for split, n in zip(("train", "val"), per_class):
        made[split] = []
        for label, cls in enumerate(CLASSES):
            os.makedirs(os.path.join(root, split, cls), exist_ok=True)
            for i in range(n):
                rel = os.path.join(cls, f"{cls}_{i}.png")
                _image(rng, label).save(os.path.join(root, split, rel))
                made[split].append((rel, label))
    return made


def data_cfg(fmt, root=None, **extra):
    cfg = dict(name="test", format=fmt, root=root, num_classes=len(CLASSES), img_size=16, batch_size=2,
               val_batch_size=4, num_workers=0, augment=dict(scale=[0.9, 1.0], hflip=0.0, color_jitter=0.0,
                                                              interpolation="bilinear"),
               eval=dict(crop_pct=1.0))
    cfg.update(extra)
    return cfg


def _labels_by_colour(dataset):
    """(decoded image mean -> label) for every sample: the label must match the colour it was made with."""
    out = []
    for i in range(len(dataset)):
        image, target = dataset[i]
        level = int(round(np.asarray(image, np.float32)[..., 0].mean() / 60.0)) - 1
        out.append((level, target))
    return out


def test_imagenet_folder_layout(tmp_path):
    made = make_folder(str(tmp_path))
    train, val = build_splits(data_cfg("folder", str(tmp_path)))
    assert len(train) == len(made["train"]) and len(val) == len(made["val"])
    assert train.classes == list(CLASSES) and val.classes == list(CLASSES)
    assert all(colour == target for colour, target in _labels_by_colour(train) + _labels_by_colour(val))

    dm = ClassificationDataModule(data_cfg("folder", str(tmp_path)), seed=1)
    dm.use_model_defaults(MODEL_DEFAULTS)
    dm.setup("fit")
    images, targets, skipped = next(iter(dm.train_dataloader()))
    assert images.shape == (2, 3, 16, 16) and images.dtype == torch.uint8  # normalised after the transfer
    assert targets.dtype == torch.int64 and skipped == []
    normalised, same_targets, _ = dm.on_after_batch_transfer((images, targets, skipped), 0)
    assert normalised.dtype == torch.float32 and same_targets is targets
    torch.testing.assert_close(normalised, (images.float() / 255 - 0.5) / 0.5, rtol=0, atol=1e-6)  # MODEL_DEFAULTS
    batches = list(dm.val_dataloader())
    assert sum(b[0].shape[0] for b in batches) == len(made["val"])


def test_val_split_keeps_train_class_indices(tmp_path):
    make_folder(str(tmp_path))
    import shutil

    shutil.rmtree(tmp_path / "val" / "n01")  # a class absent from val must not shift the others' indices
    _, val = build_splits(data_cfg("folder", str(tmp_path)))
    assert sorted({t for _, t in _labels_by_colour(val)}) == [1, 2]
    assert all(colour == target for colour, target in _labels_by_colour(val))


def _tar_of(path, files):
    with tarfile.open(path, "w") as tf:
        for arcname, src in files:
            tf.add(src, arcname=arcname)


def test_tar_shards(tmp_path):
    src = tmp_path / "src"
    made = make_folder(str(src))
    root = tmp_path / "shards"
    # train: a folder of one <class>.tar shard per class; val: one tar of <class>/ folders
    os.makedirs(root / "train")
    for cls in CLASSES:
        files = [(os.path.basename(rel), str(src / "train" / rel)) for rel, _ in made["train"] if rel.startswith(cls)]
        _tar_of(str(root / "train" / f"{cls}.tar"), files)
    _tar_of(str(root / "val.tar"), [(rel, str(src / "val" / rel)) for rel, _ in made["val"]])

    train, val = build_splits(data_cfg("tar", str(root)))
    assert len(train) == len(made["train"]) and len(val) == len(made["val"])
    assert train.classes == list(CLASSES)
    assert all(colour == target for colour, target in _labels_by_colour(train) + _labels_by_colour(val))

    dm = ClassificationDataModule(data_cfg("tar", str(root)), seed=0)
    dm.use_model_defaults(MODEL_DEFAULTS)
    images, targets, _ = next(iter(dm.train_dataloader()))
    assert images.shape == (2, 3, 16, 16)


def test_unreadable_images_are_skipped_and_counted(tmp_path):
    make_folder(str(tmp_path), per_class=(2, 1))
    broken = tmp_path / "train" / "n02" / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    truncated = tmp_path / "train" / "n03" / "truncated.jpg"
    truncated.write_bytes(b"\xff\xd8\xff\xe0" + bytes(40))
    dm = ClassificationDataModule(data_cfg("folder", str(tmp_path), batch_size=4), seed=0)
    dm.use_model_defaults(MODEL_DEFAULTS)
    dm.setup("fit")
    assert len(dm.train_set) == 8
    loader = torch.utils.data.DataLoader(dm.train_set, batch_size=8, collate_fn=collate_skipping)
    images, targets, skipped = next(iter(loader))
    assert sorted(skipped) == sorted([str(broken), str(truncated)])  # the files, by path
    assert images.shape[0] == 6 == targets.shape[0]
    assert collate_skipping([Unreadable("a.png"), Unreadable("b.png")]) == (None, None, ["a.png", "b.png"])


@pytest.mark.parametrize("fmt", ["folder", "tar", "image_folder"])
def test_missing_root_says_what_was_expected(tmp_path, fmt):
    with pytest.raises(DatasetLayoutError, match=r"data.root: .*does not exist; expected"):
        build_splits(data_cfg(fmt, str(tmp_path / "nowhere")))
    with pytest.raises(DatasetLayoutError, match="data.root: not set"):
        build_splits(data_cfg(fmt, None))


def test_wrong_layouts(tmp_path):
    # images directly in train/ (no class folders)
    os.makedirs(tmp_path / "train")
    os.makedirs(tmp_path / "val")
    _image(np.random.default_rng(0), 0).save(tmp_path / "train" / "a.png")
    with pytest.raises(DatasetLayoutError, match="no class sub-folders.*one folder per class"):
        build_splits(data_cfg("folder", str(tmp_path)))
    # no val split
    other = tmp_path / "other"
    make_folder(str(other))
    import shutil

    shutil.rmtree(other / "val")
    with pytest.raises(DatasetLayoutError, match=r"split folder .*val.* does not exist; expected an ImageNet-style"):
        build_splits(data_cfg("folder", str(other)))
    # tar format on a folder without tars
    with pytest.raises(DatasetLayoutError, match=r"found neither .*train.tar"):
        build_splits(data_cfg("tar", str(other)))


def test_too_many_classes_for_num_classes(tmp_path):
    make_folder(str(tmp_path))
    dm = ClassificationDataModule(data_cfg("folder", str(tmp_path), num_classes=2))
    with pytest.raises(ValueError, match="data.num_classes: 2, but the training split has 3 classes"):
        dm.setup("fit")


def test_image_folder_fixed_split(tmp_path):
    root = tmp_path / "flat"
    rng = np.random.default_rng(1)
    for label, cls in enumerate(CLASSES):
        os.makedirs(root / cls)
        for i in range(10):
            _image(rng, label).save(root / cls / f"{i}.png")
    a_train, a_val = build_splits(data_cfg("image_folder", str(root), val_fraction=0.2))
    b_train, b_val = build_splits(data_cfg("image_folder", str(root), val_fraction=0.2))
    assert len(a_val) == 6 and len(a_train) == 24
    assert list(a_val.indices) == list(b_val.indices)
    assert not set(a_train.indices) & set(a_val.indices)


def test_digits_split_is_fixed_and_disjoint():
    train, val = build_splits(data_cfg("digits", num_classes=10, img_size=32, val_fraction=0.2, split_seed=0))
    assert len(train) + len(val) == 1797 and len(val) == 359
    assert not set(train.indices) & set(val.indices)
    image, target = val[0]
    assert image.size == (32, 32) and image.mode == "RGB" and 0 <= target < 10
    _, val2 = build_splits(data_cfg("digits", num_classes=10, img_size=32, val_fraction=0.2, split_seed=0))
    assert list(val.indices) == list(val2.indices)


def test_synthetic_tensors_are_reproducible():
    train, val = build_splits(data_cfg("synthetic", num_classes=7, img_size=20, train_samples=5, val_samples=3))
    assert len(train) == 5 and len(val) == 3
    x, y = train[2]
    assert x.shape == (3, 20, 20) and 0 <= y < 7
    assert torch.equal(train[2][0], x) and not torch.equal(train[3][0], x)
    assert torch.equal(build_splits(data_cfg("synthetic", num_classes=7, img_size=20, train_samples=5))[0][2][0], x)


def test_epoch_sampler_depends_on_seed_and_epoch_only():
    data = list(range(50))

    def order(seed, epoch, replicas=1, rank=0):
        g = torch.Generator()
        sampler = EpochSampler(data, replicas, rank, seed, epoch, g)
        return list(sampler), g.initial_seed()

    assert order(3, 2) == order(3, 2)
    assert order(3, 2)[0] != order(3, 1)[0] and order(3, 2)[0] != order(4, 2)[0]
    assert order(3, 2)[1] != order(3, 1)[1]  # the loader generator (worker seeds) follows the epoch
    shards = [order(3, 0, 2, r)[0] for r in range(2)]
    assert sorted(shards[0] + shards[1]) == data and len(shards[0]) == 25
    g = torch.Generator()
    sampler = EpochSampler(data, 1, 0, 3, 0, g)
    sampler.set_epoch(2)
    assert list(sampler) == order(3, 2)[0] and g.initial_seed() == order(3, 2)[1]


@pytest.mark.parametrize("key, value, match", [
    ("batch_size", 0, "data.batch_size: must be >= 1"),
    ("format", "zip", "data.format: expected one of"),
    ("num_classes", 11, "data.num_classes: the digits dataset has 10 classes"),
    ("augment", dict(scale=[0.5, 1.5]), "data.augment.scale"),
    ("augment", dict(re_prob=2.0), "data.augment.re_prob: must be <= 1"),
    ("augment", dict(hlfip=0.5), "data.augment: unknown keys"),
    ("eval", dict(crop_pct=0.0), "data.eval.crop_pct: must be > 0"),
])
def test_out_of_range_data_config(key, value, match):
    cfg = data_cfg("digits", num_classes=10)
    cfg[key] = value
    with pytest.raises(ValueError, match=match):
        ClassificationDataModule(cfg)


def test_batch_larger_than_dataset(tmp_path):
    make_folder(str(tmp_path), per_class=(1, 1))
    dm = ClassificationDataModule(data_cfg("folder", str(tmp_path), batch_size=8))
    dm.use_model_defaults(MODEL_DEFAULTS)
    with pytest.raises(ValueError, match="data.batch_size: 8 exceeds the 3 training images"):
        dm.train_dataloader()


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "rand-m9-mstd0.5", "originalr-mstd0.5", "v0", "v0r-mstd0.5",
                                    "augmix-m5-w3-d2"])
def test_training_augmentation_takes_every_op_at_every_magnitude(policy):
    """Every augment op of the data module's training transform, at each magnitude 0..10, on random 32x32
    images, then the whole transform (rand-m9-mstd0.5-inc1 is the ImageNet recipes'): its PosterizeIncreasing
    keeps 0 bits at magnitude 10, which Pillow 13 refuses; 0 bits give an all-zero image, as older Pillow did."""
    import copy
    import random

    from namodels.data.augment import augment_ops

    cfg = data_cfg("digits", num_classes=10, img_size=32)
    cfg["augment"] = dict(cfg["augment"], auto_augment=policy)
    dm = ClassificationDataModule(cfg)
    dm.use_model_defaults(MODEL_DEFAULTS)
    train, _ = dm.transforms()
    ops = list(augment_ops(train))
    assert ops, train
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(8)]
    for op in {op.name: op for op in ops}.values():
        fixed = copy.copy(op)
        fixed.prob, fixed.magnitude_std = 1.0, 0.0
        for magnitude in range(11):
            fixed.magnitude = magnitude
            for image in images[:2]:
                out = fixed(image)
                assert out.size == image.size and out.mode == image.mode, (op.name, magnitude)
                if op.name == "PosterizeIncreasing" and magnitude == 10:
                    assert not np.asarray(out).any()  # 0 bits kept
    random.seed(0)
    np.random.seed(0)
    for i in range(400):
        out = train(images[i % len(images)])
        assert tuple(out.shape) == (3, 32, 32) and out.dtype == torch.uint8


def test_folder_readers_read_each_file_once_through_link_loops(tmp_path):
    """A link to a folder above it (a loop: os.walk(followlinks=True) lists every file 41 times, a random split
    then puts copies of an image in train and val) and a second path to a class folder add no sample; a file in
    both splits of the folder layout is an error."""
    from namodels.data.images import ImageFolder

    root = tmp_path / "flat"
    rng = np.random.default_rng(2)
    for label, cls in enumerate(CLASSES[:2]):
        os.makedirs(root / cls)
        for i in range(10):
            _image(rng, label).save(root / cls / f"{i}.png")
    os.symlink(root, root / CLASSES[0] / "loop")
    os.symlink(root / CLASSES[1], root / CLASSES[0] / "alias")
    train, val = build_splits(data_cfg("image_folder", str(root), val_fraction=0.2))
    assert (len(train), len(val)) == (16, 4) and train.classes == list(CLASSES[:2])
    real = [{os.path.realpath(ds.filename(int(i))) for i in ds.indices} for ds in (train, val)]  # reader indices
    assert len(real[0]) == 16 and len(real[1]) == 4 and not real[0] & real[1]
    assert _labels_by_colour(train) + _labels_by_colour(val) == [(y, y) for _, y in _labels_by_colour(train)
                                                                 + _labels_by_colour(val)]
    gan = ImageFolder(str(root), resolution=8, hflip=False)
    assert len(gan.files) == 20 and len({os.path.realpath(f) for f in gan.files}) == 20

    folder = tmp_path / "imagenet"
    make_folder(str(folder))
    os.symlink(folder / "train", folder / "train" / CLASSES[0] / "up")
    train, val = build_splits(data_cfg("folder", str(folder)))
    assert (len(train), len(val)) == (12, 6)
    os.symlink(folder / "val" / CLASSES[1], folder / "train" / CLASSES[2] / "peek")
    with pytest.raises(DatasetLayoutError, match=r"2 files of the 'train' split are also in the 'val' split"):
        build_splits(data_cfg("folder", str(folder)))


def test_cuda_worker_context_starts_workers_from_a_preloaded_fork_server():
    """The context of CUDA-using loader workers: a fork server that has the data modules imported, whose workers
    load the same batches as the main process does."""
    from torch.utils.data import DataLoader

    from namodels.data import datamodule

    context = datamodule.cuda_worker_context()
    assert context.get_start_method() == "forkserver"
    from multiprocessing import forkserver

    assert forkserver._forkserver._preload_modules[:2] == ["__main__", datamodule.__name__]
    data = torch.arange(24.0).view(12, 2)
    loaded = list(DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context=context))
    assert torch.equal(torch.cat(loaded), data)
