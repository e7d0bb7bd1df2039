"""Where classification images come from: the formats behind ``data.format``.

Every source returns a :class:`LabeledImages` dataset of ``(PIL.Image, class index)`` pairs read by one
of timm's readers (folders: :class:`FolderReader`, timm's ``ReaderImageFolder`` over
:func:`~namodels.data.files.find_image_files`, which follows links but reads every file once; tar shards:
``ReaderImageInTar``), or built in memory (``digits``, ``synthetic``).  Files that cannot be decoded
(truncated, not images, decompression bombs, dangling symlinks) come back as
:class:`~namodels.data.decoding.Unreadable` with their path; the collate function drops them and passes the
paths on, so the task counts unreadable *files*.  16-bit images are scaled to 8 bits
(:func:`~namodels.data.decoding.open_rgb`).

Formats (``data.format``):

* ``digits``: sklearn's 8x8 handwritten digits (1797 real images, shipped with scikit-learn), upsampled
  to ``data.img_size``; a fixed split by ``data.val_fraction`` and ``data.split_seed``.
* ``folder``: ImageNet layout, ``root/<train_split>/<class>/*.JPEG`` and ``root/<val_split>/<class>/*``; a file
  in both splits (through a link) is an error.
* ``tar``: the same as tar files: ``root/<split>.tar`` (a tar of class folders, or a tar of per-class
  tars such as ``ILSVRC2012_img_train.tar``) or a folder ``root/<split>/`` of per-class ``<class>.tar``
  shards.
* ``image_folder``: one folder of class sub-folders, ``root/<class>/*``, split by ``data.val_fraction``.
* ``synthetic``: random image tensors of the configured size and class count (throughput runs; no
  decoding, no augmentation).
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from timm.data.readers.img_extensions import get_img_extensions
from timm.data.readers.reader import Reader
from timm.data.readers.reader_image_folder import ReaderImageFolder
from timm.data.readers.reader_image_in_tar import ReaderImageInTar
from timm.utils.misc import natural_key
from torch.utils.data import Dataset

from .decoding import Unreadable, UnreadableImage, open_rgb
from .files import find_image_files

log = logging.getLogger(__name__)

FORMATS = ("digits", "folder", "tar", "image_folder", "synthetic")


class DatasetLayoutError(ValueError):
    """The dataset path is missing or not laid out as the chosen ``data.format`` expects."""


_LAYOUTS = {
    "folder": "an ImageNet-style folder: {root}/{train}/<class>/<image> and {root}/{val}/<class>/<image>",
    "tar": ("tar shards: {root}/{train}.tar and {root}/{val}.tar (a tar of <class>/ folders or of <class>.tar "
            "files), or folders {root}/{train}/ and {root}/{val}/ of <class>.tar shards"),
    "image_folder": "one folder of class sub-folders: {root}/<class>/<image>",
}


def _layout(fmt: str, root: str, train: str, val: str) -> str:
    return _LAYOUTS[fmt].format(root=root, train=train, val=val)


class LabeledImages(Dataset):
    """``(image, target)`` pairs from a timm reader; :class:`Unreadable` for a file that cannot be decoded."""

    def __init__(self, reader, indices: Sequence[int] | None = None, transform: Callable | None = None,
                 classes: Sequence[str] = ()):
        self.reader = reader
        self.indices = None if indices is None else np.asarray(indices)
        self.transform = transform
        self.classes = list(classes)

    def __len__(self) -> int:
        return len(self.reader) if self.indices is None else len(self.indices)

    def __getitem__(self, index: int):
        index = int(index if self.indices is None else self.indices[index])
        name = self.filename(index)
        try:
            source, target = self.reader[index]  # folder readers open the file here (a dangling link fails)
            image = open_rgb(source, name)  # decodes now, so a truncated file fails here, not in a transform
        except UnreadableImage as err:
            log.warning("skipping unreadable image %s", err)
            return Unreadable(name)
        except OSError as err:
            log.warning("skipping unreadable image %s: %s", name, err)
            return Unreadable(name)
        return (self.transform(image) if self.transform is not None else image), int(target)

    def filename(self, index: int) -> str:
        """The sample's file: an absolute path (folders), ``<shard>/<member>`` (tars) or ``#<index>``."""
        if isinstance(self.reader, ReaderImageInTar):
            sample_ti, parent_fn, child_ti = self.reader.samples[index]
            return os.path.join(self.reader.root, parent_fn or "", child_ti.name if child_ti else "", sample_ti.name)
        try:
            return os.path.abspath(self.reader._filename(index, absolute=True))
        except Exception:  # in-memory readers have no file names
            return f"#{index}"


class _ArrayReader:
    """A reader over in-memory images (uint8 ``[N, H, W, C]``) with the timm reader interface."""

    def __init__(self, images: np.ndarray, targets: np.ndarray):
        self.images, self.targets = images, targets

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return Image.fromarray(self.images[index]), int(self.targets[index])

    def _filename(self, index):
        return f"#{index}"


def fixed_split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/val index split (independent of the training seed)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction: must be in (0, 1), got {val_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * val_fraction)))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def digits_arrays(img_size: int) -> tuple[np.ndarray, np.ndarray]:
    """sklearn digits (values 0..16 on 8x8) as uint8 RGB ``[N, img_size, img_size, 3]`` and targets."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().div(16.0).unsqueeze(1)  # [N, 1, 8, 8] in [0, 1]
    images = torch.nn.functional.interpolate(images, size=(img_size, img_size), mode="bilinear",
                                             align_corners=False)
    images = images.clamp(0, 1).mul(255).round().to(torch.uint8).expand(-1, 3, -1, -1)
    return images.permute(0, 2, 3, 1).contiguous().numpy(), digits.target.astype(np.int64)


def _require_dir(path: str, what: str, layout: str):
    if not os.path.exists(path):
        raise DatasetLayoutError(f"data.root: {what} {path!r} does not exist; expected {layout}")


class FolderReader(ReaderImageFolder):
    """timm's ``ReaderImageFolder`` over :func:`~namodels.data.files.find_image_files`: the same samples (every
    image under ``root``, labelled by the name of its folder, in natural order) except that a link loop or a
    folder reached under two paths adds no sample, where timm's ``os.walk(followlinks=True)`` lists a file again
    for every path to it.  ``real_paths[i]`` is sample ``i``'s file with its links resolved."""

    def __init__(self, root: str, class_to_idx: dict | None = None):
        Reader.__init__(self)  # not ReaderImageFolder's, which walks the folder with os.walk
        self.root = root
        files = find_image_files(root, get_img_extensions(as_set=True), sort=False)  # sorted below, as timm does
        prefix = len(os.path.join(root, ""))
        # timm's labels: the name of the folder holding the file ('' for a file directly in root)
        labels = [(f.path[prefix:].rsplit(os.sep, 2)[-2:-1] or [""])[0] for f in files]
        if not class_to_idx:
            class_to_idx = {c: i for i, c in enumerate(sorted(set(labels), key=natural_key))}
        kept = sorted(((f, class_to_idx[label]) for f, label in zip(files, labels) if label in class_to_idx),
                      key=lambda item: natural_key(item[0].path))
        self.samples = [(f.path, target) for f, target in kept]
        self.real_paths = [f.real for f, _ in kept]
        self.class_to_idx = class_to_idx


def _folder_reader(path: str, layout: str, class_to_idx: dict | None):
    if not os.path.isdir(path):
        raise DatasetLayoutError(f"data.root: split folder {path!r} does not exist; expected {layout}")
    class_dirs = [d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))]
    if not class_dirs:
        loose = [f for f in os.listdir(path) if os.path.splitext(f)[1].lower() in get_img_extensions(as_set=True)]
        hint = f" (found {len(loose)} images directly in it: put them in one folder per class)" if loose else ""
        raise DatasetLayoutError(f"data.root: {path!r} has no class sub-folders{hint}; expected {layout}")
    reader = FolderReader(path, class_to_idx)
    if len(reader) == 0:
        raise DatasetLayoutError(
            f"data.root: no images ({', '.join(sorted(get_img_extensions()))}) under {path!r}; expected {layout}"
        )
    return reader


def _tar_reader(root: str, split: str, layout: str, class_to_idx: dict | None):
    as_file, as_dir = os.path.join(root, split + ".tar"), os.path.join(root, split)
    if os.path.isfile(as_file):
        path = as_file
    elif os.path.isdir(as_dir) and glob.glob(os.path.join(as_dir, "*.tar")):
        path = as_dir
    else:
        raise DatasetLayoutError(
            f"data.root: found neither {as_file!r} nor .tar shards in {as_dir!r}; expected {layout}"
        )
    try:
        reader = ReaderImageInTar(path, class_map=class_to_idx or "")
    except (AssertionError, ValueError) as err:  # timm asserts on empty tars
        raise DatasetLayoutError(f"data.root: cannot read tar shards at {path!r} ({err}); expected {layout}") from err
    return reader


def _classes(reader) -> list[str]:
    return [name for name, _ in sorted(reader.class_to_idx.items(), key=lambda kv: kv[1])] \
        if hasattr(reader, "class_to_idx") else \
        [name for name, _ in sorted(reader.class_name_to_idx.items(), key=lambda kv: kv[1])]


def check_paths(cfg: dict) -> None:
    """The dataset's root and split paths exist (no directory scan, no decoding): a wrong ``data.root`` fails
    at once, before a trainer or model is built."""
    fmt = cfg.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"data.format: unknown format {fmt!r}; choose one of {FORMATS}")
    if fmt in ("digits", "synthetic"):
        return
    root, train, val = cfg.get("root"), cfg.get("train_split", "train"), cfg.get("val_split", "val")
    if not root:
        raise DatasetLayoutError(f"data.root: not set; format {fmt!r} expects {_layout(fmt, '<root>', train, val)}")
    root = os.path.expanduser(str(root))
    layout = _layout(fmt, root, train, val)
    _require_dir(root, "dataset root", layout)
    for split in ((train, val) if fmt != "image_folder" else ()):
        if fmt == "folder" and not os.path.isdir(os.path.join(root, split)):
            raise DatasetLayoutError(
                f"data.root: split folder {os.path.join(root, split)!r} does not exist; expected {layout}")
        if fmt == "tar" and not (os.path.isfile(os.path.join(root, split + ".tar"))
                                 or glob.glob(os.path.join(root, split, "*.tar"))):
            raise DatasetLayoutError(f"data.root: found neither {os.path.join(root, split + '.tar')!r} nor .tar "
                                     f"shards in {os.path.join(root, split)!r}; expected {layout}")


def build_splits(cfg: dict) -> tuple[Dataset, Dataset]:
    """Train and validation datasets (without transforms) for a ``data`` config."""
    fmt = cfg.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"data.format: unknown format {fmt!r}; choose one of {FORMATS}")
    root, train, val = cfg.get("root"), cfg.get("train_split", "train"), cfg.get("val_split", "val")

    if fmt == "digits":
        images, targets = digits_arrays(int(cfg["img_size"]))
        reader = _ArrayReader(images, targets)
        tr, va = fixed_split(len(images), float(cfg.get("val_fraction", 0.2)), int(cfg.get("split_seed", 0)))
        classes = [str(i) for i in range(10)]
        return LabeledImages(reader, tr, classes=classes), LabeledImages(reader, va, classes=classes)

    if fmt == "synthetic":
        return _synthetic(cfg, "train"), _synthetic(cfg, "val")

    if not root:
        raise DatasetLayoutError(f"data.root: not set; format {fmt!r} expects {_layout(fmt, '<root>', train, val)}")
    root = os.path.expanduser(str(root))
    layout = _layout(fmt, root, train, val)
    _require_dir(root, "dataset root", layout)

    if fmt == "image_folder":
        reader = _folder_reader(root, layout, None)
        tr, va = fixed_split(len(reader), float(cfg.get("val_fraction", 0.1)), int(cfg.get("split_seed", 0)))
        classes = _classes(reader)
        return LabeledImages(reader, tr, classes=classes), LabeledImages(reader, va, classes=classes)

    make = _folder_reader if fmt == "folder" else (lambda p, lay, c: _tar_reader(root, p, lay, c))
    train_reader = make(os.path.join(root, train) if fmt == "folder" else train, layout, None)
    classes = _classes(train_reader)
    # The validation split reuses the training class indices, so a class missing in val cannot shift them.
    val_reader = make(os.path.join(root, val) if fmt == "folder" else val, layout, dict(
        (name, i) for i, name in enumerate(classes)))
    if fmt == "folder":
        _check_disjoint(train_reader, val_reader, train, val)
    return LabeledImages(train_reader, classes=classes), LabeledImages(val_reader, classes=classes)


def _check_disjoint(train_reader: FolderReader, val_reader: FolderReader, train: str, val: str) -> None:
    """No file (after resolving links) is in both splits: validating on training images would overstate accuracy."""
    val_files = set(val_reader.real_paths)
    shared = [path for (path, _), real in zip(train_reader.samples, train_reader.real_paths) if real in val_files]
    if shared:
        raise DatasetLayoutError(
            f"data.root: {len(shared)} files of the {train!r} split are also in the {val!r} split through links "
            f"(first: {shared[0]!r}); a validation image must not be trained on")


class SyntheticImages(Dataset):
    """Random uint8 image tensors and labels (normalised on the device like decoded images): for throughput, not
    accuracy.

    A fixed pool of images (made once, seeded) is cycled, so the input pipeline costs only the
    batch copy and a throughput run measures the model, not the random number generator.
    """

    POOL = 64

    def __init__(self, n: int, size: int, num_classes: int, seed: int):
        self.n, self.size, self.num_classes, self.seed = n, size, num_classes, seed
        self.classes = [str(i) for i in range(num_classes)]
        self.transform = None  # part of the dataset interface; nothing to apply
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (min(n, self.POOL), 3, size, size), generator=g, dtype=torch.uint8)
        self.targets = torch.randint(num_classes, (n,), generator=g)

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return self.images[index % len(self.images)], int(self.targets[index])


def _synthetic(cfg: dict, split: str) -> SyntheticImages:
    n = int(cfg.get(f"{split}_samples", 1024))
    if n < 1:
        raise ValueError(f"data.{split}_samples: must be >= 1, got {n}")
    return SyntheticImages(n, int(cfg["img_size"]), int(cfg["num_classes"]), seed=0 if split == "train" else 1)
