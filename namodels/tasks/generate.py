"""Sampling from a trained generator: a PNG grid plus one PNG per seed.

Every image is a function of its seed only (``z`` drawn from ``torch.Generator().manual_seed(seed)``
on CPU), so ``seed0042.png`` is the same image whatever the batch size or device.
"""
from __future__ import annotations

import math
import os
import re
from typing import Sequence

import torch
from torchvision.utils import save_image
from tqdm.auto import tqdm

from namodels.data.images import to_unit_range
from namodels.tasks.generators import DISPLAY_TILE, load_generator, save_grid

__all__ = ["save_grid", "generate_images"]


def check_no_earlier_images(out_dir: str) -> None:
    """Refuses a folder that already holds generated images: new ones would mix with them."""
    earlier = sorted(f for f in os.listdir(out_dir) if f == "grid.png" or re.fullmatch(r"seed\d+\.png", f)) \
        if os.path.isdir(out_dir) else []
    if earlier:
        raise ValueError(f"out_dir: {out_dir!r} already holds images of an earlier run ({', '.join(earlier[:3])}"
                         f"{', ...' if len(earlier) > 3 else ''}); choose an empty folder (eval.py gives every run "
                         "a new one unless task.out_dir or run_version is set)")


@torch.no_grad()
def generate_images(generator, out_dir: str, num_images: int = 16, seeds: Sequence[int] | None = None,
                    seed: int = 0, truncation: float = 1.0, batch_size: int = 8, grid: bool = True,
                    individual: bool = True, device=None, min_tile: int | None = DISPLAY_TILE,
                    progress: bool = False) -> dict:
    """Generates images for ``seeds`` (default ``seed .. seed + num_images - 1``) with the
    truncation trick at ``truncation`` (1 = off).

    Writes ``out_dir/grid.png`` (tiles of models smaller than ``min_tile`` pixels enlarged, see
    :func:`~namodels.tasks.generators.grid_image`) and ``out_dir/seed%06d.png`` (as generated);
    ``progress`` shows a progress bar over the images.  Returns ``{"grid": path | None, "images": [paths],
    "seeds": [...]}``.
    """
    if not 0 <= truncation <= 1.5:
        raise ValueError(f"truncation: expected psi in [0, 1.5], got {truncation}")
    seeds = list(seeds) if seeds is not None else list(range(seed, seed + num_images))
    if not seeds:
        raise ValueError("num_images: nothing to generate")
    check_no_earlier_images(out_dir)
    device = device or next(generator.parameters()).device
    generator.eval()
    z = generator.seeded_latents(seeds)
    os.makedirs(out_dir, exist_ok=True)
    result = {"grid": None, "images": [], "seeds": seeds}
    batches = []
    with tqdm(total=len(seeds), desc="generate", unit="img", disable=not progress) as bar:
        for i in range(0, len(seeds), batch_size):
            images = generator(z[i:i + batch_size].to(device), truncation=truncation).float().cpu()
            if individual:
                for s, img in zip(seeds[i:i + batch_size], images):
                    path = os.path.join(out_dir, f"seed{s:06d}.png")
                    save_image(to_unit_range(img), path)
                    result["images"].append(path)
            if grid:
                batches.append(images)
            bar.update(images.shape[0])
    if grid:
        result["grid"] = save_grid(torch.cat(batches), os.path.join(out_dir, "grid.png"), min_tile=min_tile)
    return result


# ---------------------------------------------------------------------------------------------
# eval.py entry points (configs/task/generate.yaml, fid.yaml)
# ---------------------------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def generator_from_eval_config(cfg) -> tuple:
    """(generator on its device, description) for eval.py's ``ckpt_path`` / ``weights`` /
    ``model`` settings and the task's ``which`` / ``device``."""
    from omegaconf import OmegaConf

    ckpt_path = cfg.get("ckpt_path")
    if not ckpt_path:
        raise ValueError(f"ckpt_path: task={cfg.task.name} needs a generator checkpoint (a train.py .ckpt, an exported "
                         "g_ema.safetensors or a released StyleNAT .pt)")
    which = cfg.task.get("which", "auto")
    if which == "auto":
        which = {"raw": "g"}.get(str(cfg.get("weights", "auto")), "g_ema")
    if which not in ("g", "g_ema"):
        raise ValueError(f"task.which: expected auto, g_ema or g, got {which!r}")
    model = cfg.get("model") or {}
    gen_cfg = model.get("generator")
    gen_cfg = OmegaConf.to_container(gen_cfg, resolve=True) if gen_cfg is not None and not isinstance(gen_cfg, dict) \
        else gen_cfg
    path = os.path.expanduser(str(ckpt_path))
    # model.generator (e.g. model=stylenat_ffhq1024) describes released files; ours carry their config.
    generator = load_generator(path, which, release_cfg=gen_cfg, backend=model.get("backend"))
    return generator.to(_device(cfg.task.get("device", "auto"))), f"{path} ({which})"


def run(cfg) -> dict:
    """eval.py task=generate."""
    import json

    import ops

    from namodels.tasks.run_dirs import assign_run_folder

    assign_run_folder(cfg)  # this run's own folder (a no-op under eval.py, which chose it already)
    generator, source = generator_from_eval_config(cfg)
    t = cfg.task
    seeds = list(t.seeds) if t.get("seeds") is not None else None
    with ops.use_backend(cfg.model.get("backend") if cfg.get("model") else None):
        result = generate_images(generator, str(t.out_dir), num_images=int(t.num_images), seeds=seeds,
                                 seed=int(t.seed), truncation=float(t.truncation), batch_size=int(t.batch_size),
                                 grid=bool(t.grid), individual=bool(t.individual),
                                 min_tile=t.get("grid_min_tile", DISPLAY_TILE), progress=bool(t.get("progress", True)))
    summary = {"checkpoint": source, "grid": result["grid"], "num_images": len(result["seeds"]),
               "seeds": result["seeds"], "truncation": float(t.truncation), "out_dir": str(t.out_dir)}
    print(json.dumps(summary, indent=2), flush=True)
    return summary


@torch.no_grad()
def images_per_second(generator, batch_size: int = 16, iters: int = 10, warmup: int = 2, backend: str | None = None,
                      dtype: torch.dtype | None = torch.bfloat16) -> dict:
    """Generator throughput (eval mode, autocast to ``dtype`` on CUDA) under one NA backend: median
    time of ``iters`` timed forwards after ``warmup``, timed by the benchmark's step timer
    (:func:`namodels.benchmark.timing.time_steps`: CUDA events on GPUs).  For throughput tables
    (``eval.py`` throughput task, ``benchmarks/stylenat_bench.py``)."""
    import itertools

    import ops
    from namodels.benchmark.timing import TimingSettings, median_ms, time_steps

    device = next(generator.parameters()).device
    cuda = device.type == "cuda"
    generator.eval()
    zs = [torch.randn(batch_size, generator.style_dim, device=device) for _ in range(3)]
    calls = itertools.count()

    def forward():
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=cuda and dtype is not None):
            return generator(zs[next(calls) % len(zs)])

    # exactly `warmup` + `iters` calls: no wall-time caps
    settings = TimingSettings(warmup=warmup, iters=iters, min_iters=iters, cap_s=math.inf, warmup_cap_s=math.inf)
    with ops.use_backend(backend):
        times_ms = time_steps(forward, device, settings)
    median = median_ms(times_ms) / 1000
    return {"backend": backend or "auto", "batch": batch_size, "median_s": median, "images_per_s": batch_size / median,
            "iters": iters}
