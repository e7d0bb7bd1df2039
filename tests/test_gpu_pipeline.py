"""The GPU input pipeline's worker side, decode, crop/resize and loader, checked on the CPU against timm's
transforms on the same files (the stages run on any device; CUDA-only decoders are checked by ``gpu`` tests)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation

from namodels.benchmark.input_pipeline import MODEL_DATA, data_config
from namodels.benchmark.jpeg_folder import make_folder
from namodels.data.datamodule import ClassificationDataModule
from namodels.data.encoded import CropSampler, EncodedImages, collate_encoded
from namodels.data.gpu_pipeline import GPUCollate, StagedLoader, TrainStage, ValStage

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    make_folder(str(root), train=30, val=15, classes=3, odd=5, workers=1)
    return str(root)


def _module(root: str, **data) -> ClassificationDataModule:
    cfg = data_config(root, "cpu", 0, 8, 3)
    cfg.update(data)
    dm = ClassificationDataModule(cfg)
    dm.use_model_defaults(MODEL_DATA)
    dm.setup()
    return dm


def test_workers_send_jpegs_as_bytes_and_decode_the_rest(folder):
    dm = _module(folder)
    encoded = EncodedImages(dm.train_set, CropSampler())
    kinds = {}
    for i in range(len(encoded)):
        sample = encoded[i]
        if not hasattr(sample, "encoded"):
            kinds.setdefault("unreadable", []).append(sample.path)
            continue
        with Image.open(sample.path) as im:
            kinds.setdefault((im.format, im.mode, sample.encoded), []).append(sample.path)
        if sample.encoded:
            assert sample.data.dim() == 1 and bytes(sample.data.numpy()) == open(sample.path, "rb").read()
        else:
            assert sample.data.dtype == torch.uint8 and sample.data.shape[0] == 3
        assert tuple(sample.size) == (im.size[1], im.size[0])
        top, left, h, w = sample.crop
        assert 0 <= top <= sample.size[0] - h and 0 <= left <= sample.size[1] - w
    # a truncated JPEG has a good header: the decode finds it (see the validation test)
    assert set(kinds) == {("JPEG", "RGB", True), ("JPEG", "L", True), ("JPEG", "CMYK", False),
                          ("PNG", "RGB", False)}


def test_validation_matches_timms_eval_transform_at_the_pixel_level(folder):
    dm = _module(folder)
    ev = dm.eval_settings()
    stage = ValStage("auto", CPU, 224, ev["crop_pct"], ev["interpolation"])
    encoded = EncodedImages(dm.val_set)
    batch = collate_encoded([encoded[i] for i in range(len(encoded))])
    images, targets, skipped = stage(batch)
    _, timm_eval = dm.transforms()
    reference = [s for s in (dm.val_set[i] for i in range(len(dm.val_set))) if isinstance(s, tuple)]
    assert len(skipped) == len(dm.val_set) - len(reference) == 1  # the truncated file, counted once
    assert images.shape == (len(reference), 3, 224, 224) and images.dtype == torch.uint8
    assert targets.tolist() == [t for _, t in reference]
    for image, (ref, _) in zip(images, reference):
        diff = (image.float() - ref.float()).abs()
        assert diff.mean() < 0.5 and diff.max() <= 40  # decoder rounding; timm resizes with PIL


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_training_crop_and_resize_match_timms_on_the_same_box(folder, interpolation):
    dm = _module(folder)
    stage = TrainStage("auto", CPU, 96, augment=None)
    encoded = EncodedImages(dm.train_set, CropSampler(interpolation=interpolation))
    samples = [s for s in (encoded[i] for i in range(12)) if hasattr(s, "encoded")]
    images, _, _ = stage(collate_encoded(samples), torch.Generator())
    mode = Image.BILINEAR if interpolation == "bilinear" else Image.BICUBIC
    for image, sample in zip(images, samples):
        with Image.open(sample.path) as im:
            pil = im.convert("RGB")
        top, left, h, w = sample.crop
        ref = torch.from_numpy(np.asarray(pil.resize((96, 96), mode, box=(left, top, left + w, top + h))))
        diff = (image.permute(1, 2, 0).float() - ref.float()).abs()
        assert diff.mean() < 1.0, sample.path


def test_crop_boxes_follow_timms_scale_and_aspect_distribution():
    """Area fraction and log-aspect histograms of the workers' boxes against timm's RandomResizedCrop drawn on a
    PIL image of the same size (independent draws of the same distribution)."""
    n, size = 4000, (375, 500)
    random.seed(0)
    ours = [CropSampler()(*size)[0] for _ in range(n)]
    pil = Image.new("RGB", (size[1], size[0]))
    random.seed(1)
    theirs = [RandomResizedCropAndInterpolation.get_params(pil, (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(n)]

    def hist(boxes, fn, bins):
        return np.histogram([fn(b) for b in boxes], bins=bins)[0] / len(boxes)

    area = lambda b: b[2] * b[3] / (size[0] * size[1])  # noqa: E731
    aspect = lambda b: math.log(b[3] / b[2])  # noqa: E731
    for fn, bins in ((area, np.linspace(0, 1, 11)), (aspect, np.linspace(-0.3, 0.3, 7))):
        assert np.abs(hist(ours, fn, bins) - hist(theirs, fn, bins)).max() < 0.03
    # both interpolations, evenly
    random.seed(2)
    picks = [CropSampler()(*size)[1] for _ in range(2000)]
    assert abs(picks.count("bicubic") / len(picks) - 0.5) < 0.04


def test_collate_runs_the_stage_in_the_loader_and_reseeds_per_epoch(folder):
    dm = _module(folder)
    encoded = EncodedImages(dm.train_set, CropSampler())
    flip = lambda x, g: x ^ torch.randint(0, 2, (x.shape[0], 1, 1, 1), generator=g, dtype=torch.uint8)  # noqa: E731
    collate = GPUCollate(TrainStage("auto", CPU, 32, flip), rank=0)

    def run(collate):
        random.seed(0)  # the crop draws (main-process loader)
        torch.manual_seed(5)  # what a worker's seed would be
        collate._generator = None
        loader = torch.utils.data.DataLoader(encoded, batch_size=8, collate_fn=collate)
        return [(x.clone(), y.clone(), s) for x, y, s in loader]

    first, second = run(collate), run(collate)
    assert sum(x.shape[0] + len(s) for x, _, s in first) == len(encoded)
    for (x1, y1, _), (x2, y2, _) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    other_rank = run(GPUCollate(TrainStage("auto", CPU, 32, flip), rank=1))
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, other_rank))


def test_sample_seeds_make_batches_independent_of_workers_and_their_age(folder):
    """With the sampler's per-sample seeds, crops and augmentations depend on (seed, epoch, rank) alone: the same
    with 0 or 2 workers, with workers kept across epochs, and different between epochs and ranks."""
    from namodels.data.datamodule import EpochSampler

    dm = _module(folder)
    encoded = EncodedImages(dm.train_set, CropSampler())
    flip = lambda x, g: x ^ torch.randint(0, 2, (x.shape[0], 1, 1, 1), generator=g, dtype=torch.uint8)  # noqa: E731

    def epochs(workers, rank=0, count=2):
        sampler = EpochSampler(encoded, 2, rank, 7, 0, torch.Generator(), sample_seeds=True)
        loader = torch.utils.data.DataLoader(encoded, batch_size=4, sampler=sampler, num_workers=workers,
                                             persistent_workers=workers > 0,
                                             collate_fn=GPUCollate(TrainStage("auto", CPU, 24, flip), rank))
        out = []
        for epoch in range(count):
            sampler.set_epoch(epoch)
            out.append([(x.clone(), y.clone()) for x, y, _ in loader])
        return out

    def staged(workers, count=2):
        sampler = EpochSampler(encoded, 2, 0, 7, 0, torch.Generator(), sample_seeds=True)
        loader = StagedLoader(encoded, TrainStage("auto", CPU, 24, flip), 0, ahead=2, batch_size=4,
                              sampler=sampler, num_workers=workers, persistent_workers=workers > 0)
        out = []
        for epoch in range(count):
            sampler.set_epoch(epoch)
            out.append([(x.clone(), y.clone()) for x, y, _ in loader])
        return out

    inline, pooled = epochs(0), epochs(2)
    for other in (pooled, staged(0), staged(2)):  # the stage in the workers or in this process
        for a, b in zip(inline, other):
            assert len(a) == len(b) > 0
            assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(inline[0], inline[1]))  # epochs differ
    other = epochs(0, rank=1, count=1)[0]
    assert not all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(inline[0], other))  # ranks differ


def test_stage_errors_reach_the_training_process(folder):
    dm = _module(folder)

    def broken(x, g):
        raise RuntimeError("augment failed")

    loader = torch.utils.data.DataLoader(EncodedImages(dm.train_set, CropSampler()), batch_size=4,
                                         collate_fn=GPUCollate(TrainStage("auto", CPU, 16, broken)))
    with pytest.raises(RuntimeError, match="augment failed"):
        next(iter(loader))
    staged = StagedLoader(EncodedImages(dm.train_set, CropSampler()), TrainStage("auto", CPU, 16, broken),
                          batch_size=4)
    batches = iter(staged)
    with pytest.raises(RuntimeError, match="augment failed"):
        next(batches)
    with pytest.raises(StopIteration):  # the pass is over, not hung
        next(batches)


def test_staged_passes_stop_their_thread(folder):
    """A pass left early (a step limit) stops its thread before the next pass resets the persistent workers;
    a finished pass leaves no thread behind."""
    import threading

    dm = _module(folder)
    identity = lambda x, g: x  # noqa: E731
    loader = StagedLoader(EncodedImages(dm.train_set, CropSampler()), TrainStage("auto", CPU, 16, identity),
                          ahead=1, batch_size=4, num_workers=2, persistent_workers=True)
    first = iter(loader)
    next(first)
    full = list(loader)  # a new pass while the first one's thread waits to hand over more
    assert not first.thread.is_alive()
    assert len(full) == len(loader) == len(first)
    assert not loader._running.thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "gpu-input-stage"]


def test_pipeline_choice_and_its_errors(folder):
    dm = _module(folder, pipeline="auto")
    assert dm.pipeline() == "cpu"  # no CUDA device here
    with pytest.raises(ValueError, match="data.pipeline"):
        _module(folder, pipeline="gpu").pipeline()
    with pytest.raises(ValueError, match="data.pipeline"):
        _module(folder, pipeline="fast")
    with pytest.raises(ValueError, match="data.gpu"):
        _module(folder, gpu={"decoder": "auto", "threads": 2})
    with pytest.raises(ValueError, match="data.gpu.decoder"):
        _module(folder, gpu={"decoder": "pillow"})
    assert _module(folder, format="synthetic", pipeline="gpu").pipeline() == "cpu"  # nothing to decode


@pytest.mark.gpu
@pytest.mark.parametrize("decoder", ["torchvision", "nvimgcodec"])
def test_gpu_decoders_match_the_cpu_path(folder, decoder):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if decoder == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec")
    cuda = torch.device("cuda", torch.cuda.current_device())
    dm = _module(folder)
    ev = dm.eval_settings()
    encoded = EncodedImages(dm.val_set)
    batch = collate_encoded([encoded[i] for i in range(len(encoded))])
    on_cpu = ValStage("auto", CPU, 224, ev["crop_pct"], ev["interpolation"])(batch)
    stage = ValStage(decoder, cuda, 224, ev["crop_pct"], ev["interpolation"])
    images, targets, skipped = stage(batch)
    assert stage.decoder.name == decoder
    assert images.device.type == "cuda" and images.shape[0] + len(skipped) == len(dm.val_set)
    # hardware and CUDA decoders may read a truncated file as far as it goes, where PIL refuses it
    assert len(skipped) <= 1
    ours = dict(zip([s.path for s in batch.samples if s.path not in skipped], images.cpu()))
    theirs = dict(zip([s.path for s in batch.samples if s.path not in on_cpu[2]], on_cpu[0]))
    for path, image in theirs.items():
        diff = (ours[path].float() - image.float()).abs()
        # nvJPEG upsamples chroma without libjpeg-turbo's smoothing: a few levels apart at colour edges
        assert diff.mean() < 3.0, (path, diff.mean().item())

    # the training process launches the GPU work on a side stream, or two loader processes do (CUDA IPC)
    for launcher in ("main", "workers"):
        dm = _module(folder, pipeline="gpu", batch_size=8,
                     gpu={"decoder": decoder, "launcher": launcher, "workers": 2, "prefetch": 2})
        loader = dm.train_dataloader()
        count = 0
        for images, targets, skipped in loader:
            assert images.device.type == "cuda" and images.dtype == torch.uint8 and images.shape[1:] == (3, 224, 224)
            count += images.shape[0] + len(skipped)
        assert count == len(loader) * 8, launcher


@pytest.mark.gpu
def test_staged_batches_are_complete_on_the_consumers_stream(folder):
    """The side stream's work is slow (a GPU sleep before the augmentation): a consumer on the current stream still
    reads finished batches, the same as the stage run synchronously on the current stream."""
    from namodels.data.datamodule import EpochSampler

    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    cuda = torch.device("cuda", torch.cuda.current_device())
    dm = _module(folder)
    encoded = EncodedImages(dm.train_set, CropSampler())

    def slow_flip(x, g):
        torch.cuda._sleep(20_000_000)
        return x ^ torch.randint(0, 2, (x.shape[0], 1, 1, 1), generator=g, dtype=torch.uint8).to(x.device)

    def batches(loader_type, **kwargs):
        sampler = EpochSampler(encoded, 1, 0, 3, 0, torch.Generator(), sample_seeds=True)
        stage = TrainStage("torchvision", cuda, 24, slow_flip)
        if loader_type is StagedLoader:
            loader = StagedLoader(encoded, stage, 0, ahead=3, batch_size=4, sampler=sampler, **kwargs)
        else:
            loader = torch.utils.data.DataLoader(encoded, batch_size=4, sampler=sampler,
                                                 collate_fn=GPUCollate(stage, 0), **kwargs)
        return [(x.clone(), y.clone()) for x, y, _ in loader]

    staged, synchronous = batches(StagedLoader, num_workers=2), batches(torch.utils.data.DataLoader)
    assert len(staged) == len(synchronous) > 0
    for (x1, y1), (x2, y2) in zip(staged, synchronous):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("fmt", ["tar", "image_folder"])
def test_every_file_layout_reaches_the_stage(folder, tmp_path, fmt):
    import tarfile

    if fmt == "tar":
        for split in ("train", "val"):
            with tarfile.open(tmp_path / f"{split}.tar", "w") as tar:
                tar.add(f"{folder}/{split}", arcname=".")
        dm = _module(str(tmp_path), format="tar")
    else:
        dm = _module(f"{folder}/train", format="image_folder", val_fraction=0.2)
    encoded = EncodedImages(dm.train_set, CropSampler())
    batch = collate_encoded([encoded[i] for i in range(len(encoded))])
    images, targets, skipped = TrainStage("auto", CPU, 32, None)(batch, torch.Generator())
    assert images.shape[0] + len(skipped) == len(dm.train_set) and len(skipped) <= 1
    assert targets.max() < 3


def test_images_over_the_pixel_limit_are_skipped_before_decoding(folder, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200 * 200)
    dm = _module(folder)
    encoded = EncodedImages(dm.train_set, CropSampler())
    samples = [encoded[i] for i in range(len(encoded))]
    refused = [s for s in samples if not hasattr(s, "encoded")]
    assert refused and all(hasattr(s, "path") for s in refused)
    assert all(s.size[0] * s.size[1] <= 200 * 200 for s in samples if hasattr(s, "encoded"))
