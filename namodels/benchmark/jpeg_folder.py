"""An ImageNet-like folder of JPEG files made offline, for input-pipeline benchmarks and tests.

``python -m namodels.benchmark.jpeg_folder OUT --train 10000 --val 1000 --classes 100``

The images are crops of the colour photos that ship inside scikit-image (so the JPEG entropy, and with it the
decode cost, is that of photographs, not of flat colour or noise), resized to sizes drawn like ImageNet's:
most images are 500 px on their long side, at 4:3, 3:2 or 1:1, landscape four times in five; the rest have a long
side between 200 and 1000 px and an aspect between 1:2 and 2:1.  A random colour shift and JPEG quality 85-96 make
every file different.  ``--odd N`` adds ``N`` files per split that a GPU JPEG decoder refuses or that need care
(CMYK and greyscale JPEGs, progressive JPEGs, PNGs, one truncated file), as ImageNet itself has a few.

Files are written atomically (a temporary name, then a rename), so an interrupted run leaves no half file; an
existing file is kept, so a second run only completes the folder.
"""
from __future__ import annotations

import argparse
import io
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image

from ..data.images import SKIMAGE_IMAGES

LONG_SIDE = 500
ASPECTS = ((4 / 3, 0.6), (3 / 2, 0.25), (1.0, 0.15))
ODD_KINDS = ("cmyk", "gray", "progressive", "png", "truncated")


def _photos() -> list[np.ndarray]:
    import skimage.data

    photos = []
    for name in SKIMAGE_IMAGES:
        arr = np.asarray(getattr(skimage.data, name)())
        if arr.ndim == 2:
            arr = np.repeat(arr[..., None], 3, axis=-1)
        photos.append(np.ascontiguousarray(arr[..., :3]).astype(np.uint8))
    return photos


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """``(width, height)`` drawn like ImageNet's image sizes (see the module docstring)."""
    if rng.random() < 0.75:
        long_side = LONG_SIDE
        aspects, weights = zip(*ASPECTS)
        aspect = aspects[rng.choice(len(aspects), p=np.asarray(weights) / sum(weights))]
    else:
        long_side = int(rng.integers(200, 1001))
        aspect = float(np.exp(rng.uniform(np.log(1.0), np.log(2.0))))
    short_side = max(16, int(round(long_side / aspect)))
    return (long_side, short_side) if rng.random() < 0.8 else (short_side, long_side)


def make_image(rng: np.random.Generator, photos: list[np.ndarray]) -> Image.Image:
    """A random crop of a random photo, resized to an ImageNet-like size, colour shifted."""
    photo = photos[int(rng.integers(len(photos)))]
    h, w = photo.shape[:2]
    ch, cw = int(rng.integers(h // 3, h + 1)), int(rng.integers(w // 3, w + 1))
    top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    crop = Image.fromarray(photo[top:top + ch, left:left + cw])
    image = crop.resize(image_size(rng), Image.BICUBIC)
    gain = rng.uniform(0.7, 1.3, size=3)
    arr = np.clip(np.asarray(image, dtype=np.float32) * gain, 0, 255).astype(np.uint8)
    return Image.fromarray(arr)


def encode(image: Image.Image, kind: str, rng: np.random.Generator) -> tuple[bytes, str]:
    """``(file bytes, extension)`` for a normal JPEG (``kind='jpeg'``) or one of :data:`ODD_KINDS`."""
    buf = io.BytesIO()
    quality = int(rng.integers(85, 97))
    if kind == "jpeg":
        image.save(buf, "JPEG", quality=quality)
    elif kind == "cmyk":
        image.convert("CMYK").save(buf, "JPEG", quality=quality)
    elif kind == "gray":
        image.convert("L").save(buf, "JPEG", quality=quality)
    elif kind == "progressive":
        image.save(buf, "JPEG", quality=quality, progressive=True)
    elif kind == "png":
        image.save(buf, "PNG")
        return buf.getvalue(), ".png"
    elif kind == "truncated":
        image.save(buf, "JPEG", quality=quality)
        return buf.getvalue()[: len(buf.getvalue()) // 3], ".JPEG"
    else:
        raise ValueError(f"kind: expected 'jpeg' or one of {ODD_KINDS}, got {kind!r}")
    return buf.getvalue(), ".JPEG"


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _make_split(args: tuple) -> int:
    root, split, start, stop, classes, odd, seed = args
    photos = _photos()
    written = 0
    for i in range(start, stop):
        rng = np.random.default_rng([seed, ("train", "val").index(split), i])
        kind = ODD_KINDS[i % len(ODD_KINDS)] if i < odd else "jpeg"
        folder = os.path.join(root, split, f"n{i % classes:08d}")
        stem = os.path.join(folder, f"{split}_{i:08d}")
        if any(os.path.exists(stem + ext) for ext in (".JPEG", ".png")):
            continue
        os.makedirs(folder, exist_ok=True)
        data, ext = encode(make_image(rng, photos), kind, rng)
        _write(stem + ext, data)
        written += 1
    return written


def make_folder(root: str, train: int, val: int, classes: int, odd: int = 0, seed: int = 0,
                workers: int | None = None) -> int:
    """Writes ``root/train/<class>/*`` and ``root/val/<class>/*``; returns the number of files written."""
    for name, value, low in (("train", train, 1), ("val", val, 1), ("classes", classes, 1), ("odd", odd, 0)):
        if int(value) < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    workers = workers or os.cpu_count() or 1
    jobs = []
    for split, count in (("train", train), ("val", val)):
        chunk = max(1, -(-count // workers))
        jobs += [(root, split, s, min(count, s + chunk), classes, odd, seed) for s in range(0, count, chunk)]
    if workers == 1:
        return sum(map(_make_split, jobs))
    with ProcessPoolExecutor(workers) as pool:
        return sum(pool.map(_make_split, jobs))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("--train", type=int, default=10000)
    p.add_argument("--val", type=int, default=1000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--odd", type=int, default=0, help="files per split that need a CPU decode or are unreadable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None)
    a = p.parse_args(argv)
    # the package's function, not __main__'s: worker processes look the function up by its module name
    from namodels.benchmark.jpeg_folder import make_folder as make

    n = make(a.root, a.train, a.val, a.classes, a.odd, a.seed, a.workers)
    print(f"wrote {n} files under {a.root}")


if __name__ == "__main__":
    main()
