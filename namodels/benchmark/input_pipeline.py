"""Images/s of the input pipeline alone: the training (or validation) loader of ``data=imagenet`` on a folder,
through each pipeline and loader worker count, up to the normalised batch on the device, with no model.

    python -m namodels.benchmark.input_pipeline ROOT --pipelines cpu gpu --workers 4 8 15 --batches 60 --out DIR
    python -m namodels.benchmark.input_pipeline ROOT --pipelines gpu --launchers main workers --workers 6 --stages

``ROOT`` is an ImageNet-layout folder (``ROOT/train/<class>/*``, ``ROOT/val/<class>/*``; make one offline with
``python -m namodels.benchmark.jpeg_folder ROOT``).  The data settings are those of ``configs/data/imagenet.yaml``
(the official recipe's augmentation), read from the YAML, not repeated here.  Each row times ``--batches``
batches after ``--warmup`` batches (worker start-up and first decodes excluded), synchronising the device at both
ends; rows go to ``OUT/input_pipeline.jsonl`` as they are measured (appended, never overwritten) and a table is
printed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Sequence

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from ..data.datamodule import ClassificationDataModule

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "data", "imagenet.yaml")
MODEL_DATA = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), interpolation="bicubic", crop_pct=0.875)


def data_config(root: str, pipeline: str, workers: int, batch_size: int, num_classes: int | None = None) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG), resolve=False)
    cfg.update(root=root, pipeline=pipeline, num_workers=workers, batch_size=batch_size, val_batch_size=batch_size)
    if num_classes is not None:
        cfg["num_classes"] = num_classes
    return cfg


def _data_module(root: str, pipeline: str, workers: int, batch_size: int, decoder: str,
                 launcher: str = "main") -> ClassificationDataModule:
    """The recipe's data module on ``root`` with the given pipeline, workers and GPU stage settings."""
    classes = len(os.listdir(os.path.join(root, "train")))
    cfg = data_config(root, pipeline, workers, batch_size, classes)
    cfg["gpu"] = {**cfg.get("gpu", {}), "workers": workers, "decoder": decoder, "launcher": launcher}
    dm = ClassificationDataModule(cfg, seed=0)
    dm.use_model_defaults(MODEL_DATA)
    return dm


def measure(root: str, pipeline: str, workers: int, split: str = "train", batches: int = 60, warmup: int = 10,
            batch_size: int = 128, decoder: str = "auto", launcher: str = "main") -> dict:
    """One row: images/s of ``split``'s loader with ``pipeline`` and ``workers`` loader workers (the GPU
    pipeline's work launched by ``launcher``)."""
    dm = _data_module(root, pipeline, workers, batch_size, decoder, launcher)
    cfg = dm.cfg
    device = dm._device()
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    normalize = dm.device_transform()
    images, start, skipped = 0, None, 0
    it = iter(loader)
    for step in tqdm(range(warmup + batches), desc=f"{pipeline} x{workers} {split}", leave=False):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start, images = time.perf_counter(), 0
        try:
            x, y, lost = next(it)
        except StopIteration:
            it = iter(loader)
            x, y, lost = next(it)
        skipped += len(lost)
        if x is None:
            continue
        x = normalize(x.to(device, non_blocking=True), training=split == "train")
        images += x.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del it
    gpu = dm.pipeline() == "gpu"
    return dict(split=split, pipeline=dm.pipeline(), decoder=cfg["gpu"]["decoder"] if gpu else "PIL (workers)",
                launcher=launcher if gpu else "-", workers=workers, batch_size=batch_size,
                images=images, seconds=round(seconds, 3), images_per_s=round(images / seconds, 1),
                skipped=skipped, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                cpus=os.cpu_count(), torch=torch.__version__)


def stage_times(root: str, batches: int = 20, warmup: int = 3, batch_size: int = 128, decoder: str = "auto") -> dict:
    """Where a GPU training batch's time goes, in this process: per stage (decode, crop and resize, augmentation),
    the host time until the stage's call returns and the time until its GPU work is done, medians over
    ``batches`` batches after ``warmup``.  The files are read by four loader workers beforehand."""
    import statistics

    from torch.utils.data import DataLoader

    from ..data.encoded import collate_encoded

    if not torch.cuda.is_available():
        raise ValueError("--stages: needs a CUDA device")
    loader = _data_module(root, "gpu", 0, batch_size, decoder).train_dataloader()
    stage, device = loader.stage, loader.stage.device
    files = DataLoader(loader.dataset, batch_size=batch_size, sampler=loader.sampler, num_workers=4,
                       collate_fn=collate_encoded, drop_last=True)
    times: dict[str, list[float]] = {}
    generator = torch.Generator().manual_seed(0)
    for step, batch in enumerate(tqdm(files, total=warmup + batches, desc="stages", leave=False)):
        if step == warmup + batches:
            break
        torch.cuda.synchronize(device)
        marks = [time.perf_counter()]
        images, _ = stage.decode(batch)
        marks.append(time.perf_counter())
        torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        out = stage.crop(images)
        marks.append(time.perf_counter())
        torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        stage.augment(out, generator)
        marks.append(time.perf_counter())
        torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        if step < warmup:
            continue
        for i, name in enumerate(("decode", "crop_resize", "augment")):
            start, returned, done = marks[2 * i], marks[2 * i + 1], marks[2 * i + 2]
            times.setdefault(f"{name}_host_ms", []).append(1000 * (returned - start))
            times.setdefault(f"{name}_ms", []).append(1000 * (done - start))
    row = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return dict(row, batches=len(times.get("decode_ms", [])), batch_size=batch_size,
                decoder=getattr(stage.decoder, "name", decoder), device=torch.cuda.get_device_name(device),
                torch=torch.__version__)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m namodels.benchmark.input_pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("--pipelines", nargs="+", default=["cpu", "gpu"], choices=["cpu", "gpu"])
    p.add_argument("--workers", nargs="+", type=int, default=[4, 8])
    p.add_argument("--splits", nargs="+", default=["train"], choices=["train", "val"])
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--decoder", default="auto", choices=["auto", "nvimgcodec", "torchvision"])
    p.add_argument("--launchers", nargs="+", default=["main"], choices=["main", "workers"],
                   help="who launches the GPU pipeline's work: the loader's own process or each worker")
    p.add_argument("--stages", action="store_true",
                   help="also time the GPU stage's decode, crop/resize and augmentation per batch, in this process")
    p.add_argument("--out", default=None, help="folder for input_pipeline.jsonl (rows appended)")
    a = p.parse_args(argv)
    for name in ("batches", "warmup", "batch_size"):
        if getattr(a, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')}: too small ({getattr(a, name)})")
    if a.stages and not torch.cuda.is_available():
        p.error("--stages: the GPU stage's times need a CUDA device")
    if not os.path.isdir(os.path.join(a.root, "train")):
        p.error(f"root: {a.root!r} has no train/ folder (make one with python -m namodels.benchmark.jpeg_folder)")
    rows = []

    def keep(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "input_pipeline.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    for split in a.splits:
        for pipeline in a.pipelines:
            for launcher in a.launchers if pipeline == "gpu" else ["main"]:  # (the CPU pipeline launches nothing)
                for workers in a.workers:
                    keep(measure(a.root, pipeline, workers, split, a.batches, a.warmup, a.batch_size, a.decoder,
                                 launcher))
    print("| split | pipeline | decoder | launcher | workers | img/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['split']} | {r['pipeline']} | {r['decoder']} | {r['launcher']} | {r['workers']} | "
              f"{r['images_per_s']:,.0f} |")
    if a.stages:
        row = stage_times(a.root, a.batches, a.warmup, a.batch_size, a.decoder)
        keep(row)
        print("| stage | host ms / batch | until done, ms / batch |\n|---|---|---|")
        for name in ("decode", "crop_resize", "augment"):
            print(f"| {name} | {row[name + '_host_ms']} | {row[name + '_ms']} |")
    return rows


if __name__ == "__main__":
    main()
