"""``eval.py task=throughput`` defaults per device: the options left ``null`` in ``configs/task/throughput.yaml``
take the values of ``device_defaults.cuda`` or ``device_defaults.cpu`` (a CPU measures a few rows in minutes;
the GPU list measures every model), then :func:`namodels.benchmark.task.run` measures."""
from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda:N`` -> ``cuda``."""
    device = str(device or "auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":")[0]


def apply_device_defaults(task: DictConfig) -> dict:
    """Fills the task's ``null`` options from its ``device_defaults`` entry for the device it runs on; returns
    what was filled in (``{}`` when the device has no entry)."""
    defaults = task.get("device_defaults") or {}
    device = resolve_device(task.get("device"))
    chosen = OmegaConf.to_container(defaults.get(device), resolve=True) if defaults.get(device) else {}
    unknown = set(chosen) - set(task) - {"device_defaults"}
    if unknown:
        raise ValueError(f"task.device_defaults.{device}: unknown keys {sorted(unknown)}; known: "
                         f"{sorted(k for k in task if k != 'device_defaults')}")
    filled = {key: value for key, value in chosen.items() if task.get(key) is None}
    with open_dict(task):
        for key, value in filled.items():
            task[key] = value
    return filled


def run(cfg: DictConfig):
    from namodels.benchmark.task import run as measure

    filled = apply_device_defaults(cfg.task)
    if filled:
        log.info("throughput on %s: %s (task.device_defaults; set the keys to override)",
                 resolve_device(cfg.task.get("device")), ", ".join(f"{k}={v}" for k, v in sorted(filled.items())))
    return measure(cfg)
