"""Lightning data module for image classification (every ``data.format`` of :mod:`namodels.data.sources`).

Two input pipelines (``data.pipeline``) make the same uint8 batches:

* ``cpu``: timm's ``create_transform`` (RandomResizedCrop, flips, color jitter, RandAugment) run by the loader
  workers on decoded PIL images;
* ``gpu``: the workers read encoded files (and draw each sample's crop box); decoding (nvJPEG, the hardware
  JPEG engines through nvImageCodec where installed), crop and resize and the same augmentations run batched on
  the training GPU, launched on a side stream of the training process a few batches ahead (or by the loader
  processes themselves: ``data.gpu.launcher``, :mod:`namodels.data.gpu_pipeline`).  A CPU's
  share of a GPU machine cannot decode and augment ImageNet as fast as one GPU trains NAT; the GPU pipeline can.

``auto`` takes ``gpu`` for image files when the run trains on CUDA, else ``cpu``; in-memory sources (``digits``,
``synthetic``) have no files to decode and take ``cpu``.  The data configs choose ``cpu``: the GPU pipeline's rate
alone is measured, a whole training run on it is not yet (docs/performance.md).  Normalisation and random erasing run on the
batch's device after the transfer for both (``on_after_batch_transfer``, :mod:`namodels.data.device_transforms`).
Mean/std, interpolation and crop_pct default to the model's pretrained config.

Reproducibility: the training order depends only on ``(seed, epoch)``, the dataloader worker seeds on
``(seed, epoch, rank)`` (the GPU pipeline's draws on each sample's seed, see :class:`EpochSampler`), so a run
resumed from an end-of-epoch checkpoint sees the same batches as an uninterrupted one (the main-process RNGs are
reseeded per epoch by the task module).
"""
from __future__ import annotations

import copy
import logging
import os
import time

import lightning.pytorch as pl
import torch
from timm.data import create_transform
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from ..utils.checks import check_choice, check_range
from .decoding import Unreadable
from .device_transforms import DeviceNormalize
from .encoded import CropSampler, EncodedImages, collate_encoded
from .gpu_augment import GPUAugment
from .gpu_decode import DECODERS
from .gpu_pipeline import GPUCollate, StagedLoader, TrainStage, ValStage
from .sources import FORMATS, SyntheticImages, build_splits, check_paths

log = logging.getLogger(__name__)

DEFAULT_AUGMENT = dict(
    scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5, vflip=0.0, color_jitter=0.4, auto_augment=None,
    interpolation="random", re_prob=0.0, re_mode="pixel", re_count=1,
)
DEFAULT_EVAL = dict(crop_pct=None, interpolation=None, mean=None, std=None)
DEFAULT_GPU = dict(decoder="auto", launcher="main", workers=6, prefetch=2)
LAUNCHERS = ("main", "workers")
PIPELINES = ("auto", "gpu", "cpu")
FILE_FORMATS = ("folder", "tar", "image_folder")  # the formats with files to decode
GPU_WORKER_TIMEOUT_S = 300


def cuda_worker_context():
    """The multiprocessing context of loader workers that use CUDA: ``forkserver``, with this module (so torch,
    timm and every class a worker unpickles) and the main script imported once, in the server.

    A CUDA process cannot fork, so such workers need a fresh interpreter.  Under ``spawn`` each one imports the main
    script and then the dataset's modules while unpickling its arguments, and the parent's write of those arguments
    blocks on the pipe until the child has read them: the workers start one after another, each paying the imports.
    Forked from a server that has the modules, they start together, in a fraction of that.  (The server is started
    once per process, with whatever preload was set first.)"""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", __name__])
    return context


def epoch_seed(seed: int, epoch: int, rank: int = 0) -> int:
    """A 63-bit seed for (run seed, epoch, rank); distinct epochs and ranks give unrelated streams."""
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + int(rank) * 104_729 + 12_345) % (2 ** 63)


def sample_seed(epoch_key: int, position: int) -> int:
    """The seed of the sample at ``position`` of an epoch's order (SplitMix64's finaliser: neighbouring
    positions give unrelated seeds)."""
    z = (int(epoch_key) + (int(position) + 1) * 0x9E3779B97F4A7C15) % 2 ** 64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2 ** 64
    return (z ^ (z >> 31)) % 2 ** 63


class EpochSampler(DistributedSampler):
    """Shuffled, rank-sharded order that is a function of ``(seed, epoch)`` only (also for one process).

    It also reseeds the data loader's generator on every ``set_epoch`` (Lightning calls it before each
    epoch) from ``(seed, epoch, rank)``, so the worker seeds drawn from it follow the epoch and differ between
    ranks.  The epoch is set at construction because the first epoch's iterator may be created before
    Lightning's ``set_epoch`` call.

    With ``sample_seeds`` it yields ``(index, seed)`` pairs instead of indices: each sample's random draws then
    depend on ``(seed, epoch, rank, position)`` alone, not on which worker takes it or how long that worker has
    lived, so loaders whose workers persist across epochs stay exactly reproducible.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, epoch: int, generator: torch.Generator,
                 sample_seeds: bool = False):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.loader_generator, self.sample_seeds = generator, bool(sample_seeds)
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.loader_generator.manual_seed(epoch_seed(self.seed, epoch, self.rank))

    def __iter__(self):
        if not self.sample_seeds:
            return super().__iter__()
        key = epoch_seed(self.seed, self.epoch, self.rank)
        return ((index, sample_seed(key, position)) for position, index in enumerate(super().__iter__()))


def collate_skipping(batch):
    """Collates ``(image, target)`` pairs, dropping the samples whose file was unreadable.

    Returns ``(images, targets, skipped)`` with ``skipped`` the list of the dropped files' paths;
    ``images`` and ``targets`` are ``None`` if every sample of the batch was unreadable.
    """
    skipped = [sample.path for sample in batch if isinstance(sample, Unreadable)]
    kept = [sample for sample in batch if not isinstance(sample, Unreadable)]
    if not kept:
        return None, None, skipped
    images, targets = default_collate(kept)
    return images, targets, skipped


class ClassificationDataModule(pl.LightningDataModule):
    """Train/val loaders for a ``data`` config (see ``configs/data/*.yaml`` for the keys)."""

    def __init__(self, data: dict, seed: int = 0):
        super().__init__()
        self.cfg = self._checked(copy.deepcopy(dict(data)))
        self.seed = int(seed)
        self.model_defaults: dict = {}
        self.train_set = self.val_set = None
        self._device_transform: DeviceNormalize | None = None
        self.batch_fetched_at: float | None = None  # perf_counter() when the last batch left the loader

    # ---- configuration -------------------------------------------------------------------------
    @staticmethod
    def _checked(cfg: dict) -> dict:
        check_choice("data.format", cfg.get("format"), FORMATS)
        check_range("data.num_classes", cfg.get("num_classes"), 1, integer=True)
        check_range("data.img_size", cfg.get("img_size"), 1, integer=True)
        check_range("data.batch_size", cfg.get("batch_size"), 1, integer=True)
        check_range("data.val_batch_size", cfg.get("val_batch_size"), 1, integer=True, allow_none=True)
        check_range("data.num_workers", cfg.get("num_workers", 0), 0, integer=True)
        if cfg["format"] == "digits" and cfg["num_classes"] != 10:
            raise ValueError(f"data.num_classes: the digits dataset has 10 classes, got {cfg['num_classes']}")
        aug = {**DEFAULT_AUGMENT, **(cfg.get("augment") or {})}
        unknown = set(aug) - set(DEFAULT_AUGMENT)
        if unknown:
            raise ValueError(f"data.augment: unknown keys {sorted(unknown)}; known: {sorted(DEFAULT_AUGMENT)}")
        scale = aug["scale"]
        if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"data.augment.scale: expected [low, high] with 0 < low <= high <= 1, got {scale}")
        ratio = aug["ratio"]
        if len(ratio) != 2 or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"data.augment.ratio: expected [low, high] with 0 < low <= high, got {ratio}")
        for key in ("hflip", "vflip", "re_prob"):
            check_range(f"data.augment.{key}", aug[key], 0, 1)
        check_range("data.augment.color_jitter", aug["color_jitter"] or 0.0, 0)
        check_range("data.augment.re_count", aug["re_count"], 1, integer=True)
        check_choice("data.augment.re_mode", aug["re_mode"], ("const", "rand", "pixel"))
        cfg["augment"] = aug
        ev = {**DEFAULT_EVAL, **(cfg.get("eval") or {})}
        unknown = set(ev) - set(DEFAULT_EVAL)
        if unknown:
            raise ValueError(f"data.eval: unknown keys {sorted(unknown)}; known: {sorted(DEFAULT_EVAL)}")
        check_range("data.eval.crop_pct", ev["crop_pct"], 0, 1, low_open=True, allow_none=True)
        cfg["eval"] = ev
        cfg["pipeline"] = check_choice("data.pipeline", cfg.get("pipeline", "cpu"), PIPELINES)
        gpu = {**DEFAULT_GPU, **(cfg.get("gpu") or {})}
        unknown = set(gpu) - set(DEFAULT_GPU)
        if unknown:
            raise ValueError(f"data.gpu: unknown keys {sorted(unknown)}; known: {sorted(DEFAULT_GPU)}")
        check_choice("data.gpu.decoder", gpu["decoder"], DECODERS)
        check_choice("data.gpu.launcher", gpu["launcher"], LAUNCHERS)
        check_range("data.gpu.workers", gpu["workers"], 0, integer=True)
        check_range("data.gpu.prefetch", gpu["prefetch"], 1, integer=True)
        cfg["gpu"] = gpu
        return cfg

    @property
    def batch_size(self) -> int:
        return int(self.cfg["batch_size"])

    @property
    def num_classes(self) -> int:
        return int(self.cfg["num_classes"])

    def use_model_defaults(self, model_data_config: dict) -> None:
        """Mean/std/interpolation/crop_pct from the model (timm ``resolve_model_data_config``)."""
        self.model_defaults = dict(model_data_config)
        self._device_transform = None  # made again from the new mean/std

    def eval_settings(self) -> dict:
        """The resolved evaluation preprocessing (what eval.py reports)."""
        ev, md = self.cfg["eval"], self.model_defaults
        pick = lambda key, default: ev[key] if ev[key] is not None else md.get(key, default)  # noqa: E731
        return dict(
            img_size=int(self.cfg["img_size"]),
            crop_pct=float(pick("crop_pct", 0.875)),
            interpolation=str(pick("interpolation", "bicubic")),
            mean=tuple(pick("mean", (0.485, 0.456, 0.406))),
            std=tuple(pick("std", (0.229, 0.224, 0.225))),
        )

    def transforms(self):
        ev, aug = self.eval_settings(), self.cfg["augment"]
        size = (3, ev["img_size"], ev["img_size"])
        from .augment import train_transform  # timm's, with augment ops that every allowed Pillow accepts

        # uint8 out of the workers: normalisation and random erasing are the device's (``device_transform``)
        train = train_transform(
            size, scale=tuple(aug["scale"]), ratio=tuple(aug["ratio"]), hflip=aug["hflip"],
            vflip=aug["vflip"], color_jitter=aug["color_jitter"] or 0.0, auto_augment=aug["auto_augment"],
            interpolation=aug["interpolation"], mean=ev["mean"], normalize=False,
        )
        val = create_transform(size, is_training=False, interpolation=ev["interpolation"], mean=ev["mean"],
                               crop_pct=ev["crop_pct"], normalize=False)
        return train, val

    def device_transform(self) -> DeviceNormalize:
        """Normalisation (the resolved mean/std) and the training split's random erasing, for device batches."""
        ev, aug = self.eval_settings(), self.cfg["augment"]
        return DeviceNormalize(ev["mean"], ev["std"], aug["re_prob"], aug["re_mode"], aug["re_count"])

    def _device(self) -> torch.device:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.strategy.root_device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def pipeline(self) -> str:
        """``'gpu'`` or ``'cpu'``: ``data.pipeline`` resolved for this source and the run's device."""
        choice, fmt, device = self.cfg["pipeline"], self.cfg["format"], self._device()
        if choice == "cpu" or fmt not in FILE_FORMATS:
            return "cpu"
        if device.type != "cuda":
            if choice == "gpu":
                raise ValueError(f"data.pipeline: 'gpu' needs a run on a CUDA device, this one runs on {device}; "
                                 "use data.pipeline=cpu (or auto)")
            return "cpu"
        return "gpu"

    def _gpu_loader(self, dataset, stage, batch_size: int, **kwargs) -> DataLoader:
        """A DataLoader that reads files in its workers and runs ``stage`` on the GPU: in this process on a side
        stream (``data.gpu.launcher=main``, :class:`StagedLoader`), or in the workers (``workers``; started by a fork
        server, as they use CUDA, which a plain fork of the training process cannot: :func:`cuda_worker_context`).

        The workers persist across epochs: their start costs seconds (with a CUDA context and decoder each under
        ``workers``), paid once per run instead of once per epoch and validation pass.  The training draws follow
        the sampler's per-sample seeds, so a worker's age changes nothing."""
        workers = int(self.cfg["gpu"]["workers"])
        _, rank, _ = self._distribution()
        if self.cfg["gpu"]["launcher"] == "main":
            return StagedLoader(dataset, stage, rank, ahead=int(self.cfg["gpu"]["prefetch"]), batch_size=batch_size,
                                num_workers=workers, persistent_workers=workers > 0,
                                prefetch_factor=4 if workers else None, **kwargs)
        cuda = workers > 0 and stage.device.type == "cuda"
        return DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=GPUCollate(stage, rank),
                          multiprocessing_context=cuda_worker_context() if cuda else None,
                          persistent_workers=workers > 0,
                          prefetch_factor=int(self.cfg["gpu"]["prefetch"]) if workers else None,
                          # a worker that stops answering (a GPU decoder that cannot start) fails the run, not hangs it
                          timeout=GPU_WORKER_TIMEOUT_S if workers else 0, **kwargs)

    def gpu_augment(self) -> GPUAugment:
        """The training split's flips and RandAugment / colour jitter, batched on the device."""
        ev, aug = self.eval_settings(), self.cfg["augment"]
        return GPUAugment(hflip=aug["hflip"], vflip=aug["vflip"], auto_augment=aug["auto_augment"],
                          color_jitter=aug["color_jitter"] or 0.0, mean=ev["mean"], interpolation=aug["interpolation"])

    def check_source(self) -> None:
        """Fails on a missing ``data.root`` or split path before the run builds its model and trainer."""
        check_paths(self.cfg)

    # ---- Lightning hooks -------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.train_set, self.val_set = build_splits(self.cfg)
        found = len(self.train_set.classes)
        if found > self.num_classes:
            raise ValueError(
                f"data.num_classes: {self.num_classes}, but the training split has {found} classes "
                f"(first: {self.train_set.classes[:5]}); set data.num_classes={found}"
            )
        if found < self.num_classes:
            log.warning("data.num_classes=%d but the training split has %d classes", self.num_classes, found)
        if not isinstance(self.train_set, SyntheticImages):
            self.train_set.transform, self.val_set.transform = self.transforms()
        log.info("data %s: %d train / %d val images, %d classes", self.cfg.get("name", self.cfg["format"]),
                 len(self.train_set), len(self.val_set), found)

    def _distribution(self):
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 1, 0, 0
        return trainer.world_size, trainer.global_rank, trainer.current_epoch

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Stamps when the loader handed the batch over (what :class:`~namodels.tasks.input_monitor.InputWaitMonitor`
        counts as waiting for input; the transfer and the device transforms that follow are not)."""
        self.batch_fetched_at = time.perf_counter()
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """The uint8 images of a batch on its device, normalised (random erasing as well while training)."""
        images, targets, skipped = batch
        if images is not None:
            if self._device_transform is None:
                self._device_transform = self.device_transform()
            trainer = getattr(self, "trainer", None)
            images = self._device_transform(images, training=trainer is not None and trainer.training)
        return images, targets, skipped

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        world, rank, epoch = self._distribution()
        generator = torch.Generator()
        gpu_pipeline = self.pipeline() == "gpu"
        sampler = EpochSampler(self.train_set, world, rank, self.seed, epoch, generator, sample_seeds=gpu_pipeline)
        if len(sampler) < self.batch_size:
            shared = f" per process ({len(self.train_set)} images over {world} processes)" if world > 1 else ""
            more = " (or raise data.train_samples)" if self.cfg["format"] == "synthetic" else ""
            raise ValueError(f"data.batch_size: {self.batch_size} exceeds the {len(sampler)} training images"
                             f"{shared}; lower data.batch_size{more}")
        if gpu_pipeline:
            aug = self.cfg["augment"]
            crops = CropSampler(aug["scale"], aug["ratio"], aug["interpolation"])
            gpu = self.cfg["gpu"]
            stage = TrainStage(gpu["decoder"], self._device(), int(self.cfg["img_size"]), self.gpu_augment())
            log.info("data: GPU input pipeline on %s (decoder %s, %d loader processes)", stage.device,
                     gpu["decoder"], gpu["workers"])
            return self._gpu_loader(EncodedImages(self.train_set, crops), stage, self.batch_size, sampler=sampler,
                                    generator=generator, drop_last=True)
        return self._loader(self.train_set, self.batch_size, sampler=sampler, generator=generator, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        batch_size = int(self.cfg.get("val_batch_size") or self.batch_size)
        if self.pipeline() == "gpu":
            ev = self.eval_settings()
            stage = ValStage(self.cfg["gpu"]["decoder"], self._device(), ev["img_size"], ev["crop_pct"],
                             ev["interpolation"])
            world, rank, _ = self._distribution()
            # Lightning shards DataLoaders only: this loader brings its own sampler, as Lightning's would be
            sampler = DistributedSampler(self.val_set, world, rank, shuffle=False) if world > 1 else None
            return self._gpu_loader(EncodedImages(self.val_set), stage, batch_size, sampler=sampler)
        return self._loader(self.val_set, batch_size)

    def _worker_count(self) -> int:
        """``data.num_workers``, capped at the CPUs this process may run on: more loader workers than CPUs only
        contend (torch warns that the loader may slow down or freeze), as the ImageNet configs' 6-10 workers would
        on a small machine.  The cap is logged once, naming the key."""
        workers = int(self.cfg.get("num_workers", 0))
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if workers <= cpus:
            return workers
        if not getattr(self, "_logged_worker_cap", False):
            self._logged_worker_cap = True
            log.info("data.num_workers=%d: %d loader workers instead, one per CPU of this machine", workers, cpus)
        return cpus

    def _loader(self, dataset, batch_size, **kwargs) -> DataLoader:
        workers = self._worker_count()
        return DataLoader(
            dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate_skipping,
            pin_memory=bool(self.cfg.get("pin_memory", False)) and torch.cuda.is_available(),
            # persistent workers would carry RNG state across epochs and break exact resumption
            persistent_workers=False, prefetch_factor=4 if workers else None, **kwargs,
        )
