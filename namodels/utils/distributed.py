"""Strategy factories that need Python objects a YAML file cannot spell (classes, policies), and how tasks log
values that are already the same on every process."""
from __future__ import annotations

import importlib
import os

import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

# ``self.log(name, value, **SYNCED)`` for a value every process already holds (torchmetrics' compute, counts
# merged across processes): Lightning would otherwise warn under DDP that it is not synchronised; the max of
# equal values keeps it exact.  The reduction runs once, when Lightning collects the epoch's metrics.
SYNCED = dict(sync_dist=True, reduce_fx="max")


def _import(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"trainer.strategy.wrap_classes: cannot import {path!r}: {err}") from err


def process_count(devices, num_nodes: int = 1, accelerator: str = "gpu") -> int:
    """Training processes a trainer with these settings starts: devices per node (``-1`` / ``"auto"``: every GPU
    torch sees; a list or ``"0,1"``: those devices) times nodes, or the processes a launcher (torchrun) started."""
    if isinstance(devices, str):
        devices = devices.strip()
        devices = [d for d in devices.split(",") if d.strip()] if "," in devices else \
            (devices if devices == "auto" else int(devices))
    if devices in (-1, "auto"):
        per_node = torch.cuda.device_count() if accelerator in ("gpu", "cuda", "auto") else 1
    elif isinstance(devices, int):
        per_node = devices
    else:
        per_node = len(devices)
    return max(per_node * int(num_nodes), int(os.environ.get("WORLD_SIZE", 1)))


def ddp_strategy(devices=-1, num_nodes: int = 1, accelerator: str = "gpu", **kwargs):
    """Lightning's DDPStrategy (``kwargs``) where the trainer starts more than one process; ``"auto"`` (Lightning's
    single-device strategy) where it starts one: DDP around a single process only adds its gradient hooks and a
    bucketed all-reduce to every step (docs/performance.md measures what that costs)."""
    if process_count(devices, num_nodes, accelerator) <= 1:
        return "auto"
    return DDPStrategy(**kwargs)


def fsdp_strategy(wrap_classes=(), sharding_strategy: str = "FULL_SHARD", activation_checkpointing: bool = False,
                  state_dict_type: str = "full", **kwargs) -> FSDPStrategy:
    """Lightning's FSDPStrategy with one FSDP unit per module of ``wrap_classes`` (import paths)."""
    classes = {_import(p) for p in wrap_classes}
    return FSDPStrategy(
        auto_wrap_policy=classes or None,
        activation_checkpointing_policy=classes if activation_checkpointing else None,
        sharding_strategy=sharding_strategy, state_dict_type=state_dict_type, **kwargs,
    )
