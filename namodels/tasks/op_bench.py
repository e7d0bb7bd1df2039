"""``eval.py task=ops``: the Hydra front end of the op benchmark :mod:`ops.bench` (same core, same flags)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def argv_from_config(task) -> list[str]:
    """``ops.bench`` command-line arguments for a ``task=ops`` config."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(task, resolve=True)
    problems = plain["problems"]
    if isinstance(problems, (list, tuple)):
        problems = ",".join(str(p) for p in problems)
    argv = ["--problems", str(problems), "--backends", ",".join(str(b) for b in plain["backends"]),
            "--dtype", str(plain["dtype"]), "--check", str(int(plain["check"])),
            "--warmup", str(plain["warmup"]), "--rep", str(plain["rep"]), "--rounds", str(int(plain.get("rounds", 1)))]
    for spec in plain.get("custom") or []:
        argv += ["--custom", str(spec)]
    if plain.get("backward"):
        argv.append("--backward")
    if plain.get("autotune"):
        argv.append("--autotune")
    if plain.get("out"):
        argv += ["--out", str(plain["out"])]
    return argv


def run(cfg):
    import torch

    from namodels.tasks.run_dirs import assign_run_folder
    from namodels.tasks.runner import check_stage

    check_stage(cfg, "eval", "eval.py")
    assign_run_folder(cfg)  # this evaluation's own folder (a no-op under eval.py, which chose it already)
    if not torch.cuda.is_available():
        raise RuntimeError("task=ops: the op benchmark times GPU kernels and needs a CUDA device (none is visible)")
    from ops import bench

    argv = argv_from_config(cfg.task)
    if cfg.task.get("out"):
        os.makedirs(os.path.dirname(str(cfg.task.out)) or ".", exist_ok=True)
    log.info("python -m ops.bench %s", " ".join(argv))
    return bench.main(argv)
