"""Strategy factories that need Python objects a YAML file cannot spell (classes, policies), and how tasks log
values that are already the same on every process."""
from __future__ import annotations

import importlib

from lightning.pytorch.strategies import FSDPStrategy

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


def fsdp_strategy(wrap_classes=(), sharding_strategy: str = "FULL_SHARD", activation_checkpointing: bool = False,
                  state_dict_type: str = "full", **kwargs) -> FSDPStrategy:
    """Lightning's FSDPStrategy with one FSDP unit per module of ``wrap_classes`` (import paths)."""
    classes = {_import(p) for p in wrap_classes}
    return FSDPStrategy(
        auto_wrap_policy=classes or None,
        activation_checkpointing_policy=classes if activation_checkpointing else None,
        sharding_strategy=sharding_strategy, state_dict_type=state_dict_type, **kwargs,
    )
