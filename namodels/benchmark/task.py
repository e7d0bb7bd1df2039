"""``eval.py task=throughput``: the Hydra front end of :mod:`namodels.benchmark.throughput` (same core)."""
from __future__ import annotations

import json
import logging
import sys

from .throughput import BenchOptions, _raise_recompile_limit, run_benchmarks
from .timing import TimingSettings

log = logging.getLogger(__name__)

_FIELDS = ("models", "backends", "precisions", "batch_size", "img_size", "frames", "infer", "train", "channels_last",
           "compile", "opt", "lr", "device", "back_to_back", "rounds", "deadline_s", "resume", "chart",
           "skip_dense_for_dilated")


def options_from_config(task) -> BenchOptions:
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(task, resolve=True)
    values = {k: plain[k] for k in _FIELDS if plain.get(k) is not None}
    if plain.get("timing"):
        values["timing"] = TimingSettings(**plain["timing"])
    for key in ("models", "backends", "precisions"):
        if key in values:
            values[key] = [str(v) for v in values[key]]
    return BenchOptions(**values)


def run(cfg) -> list[dict]:
    from namodels.tasks.runner import check_stage

    check_stage(cfg, "eval", "eval.py")
    if cfg.get("threads"):
        import torch

        torch.set_num_threads(int(cfg.threads))
    options = options_from_config(cfg.task)
    _raise_recompile_limit()
    rows = run_benchmarks(options, str(cfg.task.out_dir), command="python eval.py " + " ".join(sys.argv[1:]))
    log.info("throughput: %d rows written to %s", len(rows), cfg.task.out_dir)
    print(json.dumps({"rows": len(rows), "out_dir": str(cfg.task.out_dir)}), flush=True)
    return rows
