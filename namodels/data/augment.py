"""The training transform: timm's ``create_transform`` with its PIL ops made safe for every Pillow we allow.

timm's auto-augment ops (:mod:`timm.data.auto_augment`) hand their arguments to Pillow unchecked.  Its posterize
passes the bits to keep straight to ``PIL.ImageOps.posterize``; ``PosterizeIncreasing`` (every ``rand-*-inc1``
policy, such as the ImageNet recipes' ``rand-m9-mstd0.5-inc1``, AugMix and the ``v0r`` / ``originalr`` AutoAugment
policies) keeps 0 bits at magnitude 10, where timm clamps the magnitudes it draws: ``mstd0.5`` around 9 gets there
in about 2% of its draws, about one training image in 700 under ``rand-m9-mstd0.5-inc1``; plain ``Posterize``
(RandAugment without ``inc1``, the ``v0`` policy) keeps 0 bits below magnitude 2.5.  Older Pillow turned 0 bits
into an all-zero image; Pillow 13 raises ``ValueError``, which ends the run from inside a loader worker.

:func:`train_transform` builds timm's transform and then swaps, in every ``AugmentOp`` it holds (RandAugment,
AutoAugment and AugMix keep their ops in lists), each op function listed in :data:`SAFE_OPS` for one that takes
every argument timm's level functions produce.  The op objects, their probabilities, magnitudes and sampling stay
timm's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from PIL import Image, ImageOps
from timm.data import auto_augment, create_transform

__all__ = ["train_transform", "make_pillow_safe", "augment_ops", "posterize", "SAFE_OPS"]


def posterize(img: Image.Image, bits_to_keep: int, **__: Any) -> Image.Image:
    """timm's ``posterize`` for any number of bits: 8 or more keep the image, 0 or fewer give an all-zero image
    (what ``ImageOps.posterize`` gave for 0 bits before Pillow 13 started refusing it), 1 to 7 are Pillow's."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)  # every band of the image to 0, its mode kept
    return ImageOps.posterize(img, bits_to_keep)


# timm's op function -> the replacement that accepts every argument timm's level functions give it
SAFE_OPS: dict[Callable, Callable] = {auto_augment.posterize: posterize}


def augment_ops(transform: Any) -> Iterator[auto_augment.AugmentOp]:
    """Every ``AugmentOp`` inside ``transform``: in a ``Compose`` (``transforms``), a RandAugment or AugMix
    (``ops``) or an AutoAugment (``policy``: a list of sub-policies, each a list of ops)."""
    if isinstance(transform, auto_augment.AugmentOp):
        yield transform
    elif isinstance(transform, (list, tuple)):
        for item in transform:
            yield from augment_ops(item)
    else:
        for attr in ("transforms", "ops", "policy"):
            children = getattr(transform, attr, None)
            if isinstance(children, (list, tuple)):
                yield from augment_ops(children)


def make_pillow_safe(transform: Any) -> Any:
    """Swaps the functions of ``transform``'s augment ops listed in :data:`SAFE_OPS` (in place); returns it."""
    for op in augment_ops(transform):
        op.aug_fn = SAFE_OPS.get(op.aug_fn, op.aug_fn)
    return transform


def train_transform(input_size, **kwargs: Any):
    """``timm.data.create_transform(input_size, is_training=True, **kwargs)`` with Pillow-safe augment ops."""
    return make_pillow_safe(create_transform(input_size, is_training=True, **kwargs))
