"""The device half of the GPU input pipeline: decode, crop and resize, augment, batched on the training GPU.

Loader workers read a batch's files (:mod:`namodels.data.encoded`: encoded JPEGs, the few files only the CPU
decodes as pixels, each training sample's RandomResizedCrop box drawn).  Then, on the training GPU:

1. the JPEGs are decoded batched (:mod:`namodels.data.gpu_decode`); a file the GPU decoder refuses is decoded on
   the CPU, and one nobody can decode is skipped and reported like an unreadable file;
2. each image is cropped to its box and resized to the training size with its interpolation (antialiased, as PIL
   resizes in timm's transform), or for validation resized on the short side to ``img_size / crop_pct`` and
   centre-cropped (timm's eval transform), the whole batch in one launch (:mod:`namodels.data.gpu_resize`);
3. the batch's augmentations run with per-sample random parameters (:class:`~namodels.data.gpu_augment.GPUAugment`:
   flips, RandAugment as one launch per layer, or colour jitter), drawn from a generator seeded by the batch's
   first sample seed (the sampler derives it from the run's seed, the epoch and the position).

Who launches that work (``data.gpu.launcher``):

* ``main`` (:class:`StagedLoader`): the training process, on a thread and a side stream of its own, a few
  batches ahead; the workers only read files.  The pipeline's kernels then share the training process's CUDA context and overlap the
  training step's kernels.
* ``workers`` (:class:`GPUCollate` as the loaders' collate function): each loader process, in its own CUDA
  context; the batch reaches the training process through CUDA IPC.  The GPU switches between contexts in time
  slices, so the training step waits while a loader's kernels run (docs/performance.md has the cost).

The result is the uint8 batch the CPU pipeline's workers would have made; normalisation and random erasing follow
on the training stream as for every pipeline (:mod:`namodels.data.device_transforms`), mixup / cutmix in the task.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Callable

import torch
from torch.utils.data import DataLoader

from .decoding import UnreadableImage, open_rgb
from .encoded import EncodedBatch, EncodedSample, _chw, collate_encoded
from .gpu_decode import make_decoder
from .gpu_resize import resize_crops

log = logging.getLogger(__name__)

DECODER_THREADS = 8  # the decoder's host threads when the training process decodes for itself


class _Stage:
    """Decoding shared by the training and validation stages.  The decoder is made on first use in the process
    that runs the stage (a loader worker), not pickled with it."""

    def __init__(self, decoder: str, device: torch.device):
        self.decoder_name, self.device = decoder, torch.device(device)
        self.decoder_threads = 2  # per process that decodes: many loader processes, or the training process alone
        self._decoder = None
        self.cpu_decodes = 0  # files the GPU decoder refused (decoded on the CPU instead)

    def __getstate__(self):
        return {**self.__dict__, "_decoder": None}

    @property
    def decoder(self):
        if self._decoder is None:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._decoder = make_decoder(self.decoder_name, self.device, self.decoder_threads)
        return self._decoder

    def decode(self, batch: EncodedBatch) -> tuple[list[tuple[EncodedSample, torch.Tensor]], list[str]]:
        """``([(sample, uint8 [3, H, W] on the device)], unreadable paths)``."""
        files = batch.encoded_data()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        decoded = iter(self.decoder(files, stream) if files else [])
        files = iter(files)
        images, skipped = [], list(batch.skipped)
        for sample in batch.samples:
            data = next(files) if sample.encoded else None
            image = next(decoded) if sample.encoded else sample.data
            if image is None:  # refused by the GPU decoder: the CPU decodes what it can
                self.cpu_decodes += 1
                try:
                    image = _chw(open_rgb(_bytes_io(data), sample.path))
                except UnreadableImage as err:
                    log.warning("skipping unreadable image %s", err)
                    skipped.append(sample.path)
                    continue
            if image.device != self.device:
                image = image.to(self.device, non_blocking=True)
            if tuple(image.shape[1:]) != tuple(sample.size):  # a header that lied about the size
                log.warning("skipping image %s: header size %s, decoded %s", sample.path, sample.size,
                            tuple(image.shape[1:]))
                skipped.append(sample.path)
                continue
            images.append((sample, image))
        return images, skipped


class TrainStage(_Stage):
    """Decode, RandomResizedCrop to ``img_size`` (the worker's boxes), then ``augment`` (uint8 in and out)."""

    def __init__(self, decoder: str, device: torch.device, img_size: int, augment: Callable | None):
        super().__init__(decoder, device)
        self.size, self.augment = (int(img_size),) * 2, augment

    def __call__(self, batch: EncodedBatch, generator: torch.Generator):
        images, skipped = self.decode(batch)
        targets = torch.tensor([s.target for s, _ in images], dtype=torch.long)
        if not images:
            return None, None, skipped
        out = self.crop(images)
        if self.augment is not None:
            out = self.augment(out, generator)
        return out, targets.to(self.device, non_blocking=True), skipped

    def crop(self, images: list[tuple[EncodedSample, torch.Tensor]]) -> torch.Tensor:
        """Each decoded image's RandomResizedCrop box resized to ``img_size``: uint8 ``[N, 3, S, S]``."""
        return resize_crops([image for _, image in images], [sample.crop for sample, _ in images],
                            [(*self.size, 0, 0)] * len(images), [sample.interpolation for sample, _ in images],
                            self.size)


class ValStage(_Stage):
    """Decode, resize the short side to ``floor(img_size / crop_pct)``, centre crop ``img_size`` (timm's eval
    transform with torchvision's Resize and CenterCrop rounding)."""

    def __init__(self, decoder: str, device: torch.device, img_size: int, crop_pct: float, interpolation: str):
        super().__init__(decoder, device)
        self.size, self.interpolation = int(img_size), interpolation
        self.scale_size = int(img_size / crop_pct)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        if height <= width:
            return self.scale_size, int(self.scale_size * width / height)
        return int(self.scale_size * height / width), self.scale_size

    def __call__(self, batch: EncodedBatch, generator: torch.Generator | None = None):
        images, skipped = self.decode(batch)
        targets = torch.tensor([s.target for s, _ in images], dtype=torch.long)
        if not images:
            return None, None, skipped
        windows, placements = [], []
        for _, image in images:
            h, w = self.resized_size(*image.shape[1:])
            windows.append((0, 0, *image.shape[1:]))
            placements.append((h, w, int(round((h - self.size) / 2.0)), int(round((w - self.size) / 2.0))))
        out = resize_crops([image for _, image in images], windows, placements, [self.interpolation] * len(images),
                           (self.size, self.size))
        return out, targets.to(self.device, non_blocking=True), skipped


class GPUCollate:
    """A DataLoader ``collate_fn`` that runs ``stage`` on the collated :class:`EncodedBatch` in the worker and
    returns ``(images, targets, skipped)`` on the stage's device.

    The batch's augmentations draw from a generator seeded by the batch's first sample seed where the sampler
    hands seeds over (then the draws do not depend on the worker), else by the worker's seed (which the loader
    draws from its generator, reseeded per epoch) and ``rank``, on first use in each worker."""

    def __init__(self, stage, rank: int = 0):
        self.stage, self.rank = stage, int(rank)
        self._generator: torch.Generator | None = None

    def __getstate__(self):
        return {**self.__dict__, "_generator": None}

    def __call__(self, samples):
        return self.run(collate_encoded(samples))

    def run(self, batch: EncodedBatch):
        """The stage on an already collated batch."""
        seeds = [s.seed for s in batch.samples if s.seed is not None]
        if seeds:
            return self.stage(batch, torch.Generator().manual_seed((seeds[0] + 1) % 2 ** 63))
        if self._generator is None:
            self._generator = torch.Generator().manual_seed((torch.initial_seed() + 1_000_003 * self.rank) % 2 ** 63)
        return self.stage(batch, self._generator)


def _bytes_io(data: torch.Tensor):
    import io

    return io.BytesIO(data.numpy().tobytes())


class StagedLoader(DataLoader):
    """A DataLoader whose workers only read files (:class:`EncodedBatch`, no CUDA) and whose iterator runs
    ``stage`` in this process, on a thread and a CUDA stream of its own, up to ``ahead`` batches before the
    consumer takes them.

    One process launches all the GPU work, so the pipeline's kernels share the training process's CUDA context:
    the GPU overlaps them with the training step's kernels instead of switching between the contexts of separate
    loader processes, which it does in time slices.  The stage's host work per batch is small (one decode call,
    one resize launch, one launch per augmentation layer) and runs beside the training loop: the decoder's wait
    does not hold the loop up.  A batch handed over is safe on the consumer's current stream: that stream waits
    for the stage's event and the batch's memory is recorded on it.  An error in the stage is raised by the
    consumer's ``next``."""

    def __init__(self, dataset, stage, rank: int = 0, ahead: int = 2, **kwargs):
        kwargs["collate_fn"] = collate_encoded
        super().__init__(dataset, **kwargs)
        self.stage, self.rank, self.ahead = stage, int(rank), int(ahead)
        stage.decoder_threads = DECODER_THREADS
        self.runner = GPUCollate(stage, rank)
        self._running: _StagedBatches | None = None

    def __iter__(self):
        # the previous pass's thread stops before the workers' iterator is reset for the next one
        if self._running is not None:
            self._running.close()
        self._running = _StagedBatches(super().__iter__(), self.runner, self.stage.device, self.ahead)
        return self._running


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()
STOP_WAIT_S = 60.0  # how long closing a pass waits for its thread to leave the workers' iterator


class _StagedBatches:
    """One pass of a :class:`StagedLoader`: the stage thread fills ``ready`` with ``(batch, event)``."""

    def __init__(self, batches, runner: GPUCollate, device: torch.device, ahead: int):
        self.batches, self.runner, self.device = batches, runner, device
        self.length = len(batches)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: queue.Queue = queue.Queue(maxsize=max(1, ahead))
        self.stop = threading.Event()
        self.finished = False
        self.thread = threading.Thread(target=self._work, name="gpu-input-stage", daemon=True)
        self.thread.start()

    def __iter__(self):
        return self

    def __len__(self):
        return self.length

    def _work(self) -> None:
        try:
            with torch.cuda.device(self.device) if self.stream is not None else contextlib.nullcontext():
                for batch in self.batches:
                    if self.stop.is_set():
                        return
                    if self.stream is None:
                        item = (self.runner.run(batch), None)
                    else:
                        with torch.cuda.stream(self.stream):
                            out = self.runner.run(batch)
                            event = torch.cuda.Event()
                            event.record(self.stream)
                        item = (out, event)
                    if not self._put(item):
                        return
            self._put(_END)
        except BaseException as err:  # handed to the consumer, raised there
            self._put(_Failure(err))

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self):
        if self.finished:
            raise StopIteration
        while True:
            try:
                item = self.ready.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    self.finished = True
                    raise RuntimeError("the GPU input stage's thread stopped without a batch or an error")
        if item is _END or isinstance(item, _Failure):
            self.finished = True
            self.thread.join()
            if item is _END:
                raise StopIteration
            raise item.error
        out, event = item
        if event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(event)
            for t in out:
                if isinstance(t, torch.Tensor):
                    t.record_stream(consumer)
        return out

    def close(self) -> None:
        """Stops the thread (the batches it prepared are dropped)."""
        self.finished = True
        self.stop.set()
        self.thread.join(STOP_WAIT_S)
        if self.thread.is_alive():
            log.warning("the GPU input stage's thread did not stop within %.0f s", STOP_WAIT_S)
