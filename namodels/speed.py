"""What makes a training step fast, shared by the training tasks and the throughput benchmark: the
``torch.compile`` mode and the fastest implementation of the optimizer."""
from __future__ import annotations

import torch

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_mode(value) -> str | None:
    """The ``torch.compile`` mode a setting asks for: None (eager) for False / None / "none" / "eager", "default"
    for True, else one of ``COMPILE_MODES``.  ``reduce-overhead`` replays CUDA graphs, which removes the per-kernel
    host cost that bounds deep models such as NAT at training batch sizes."""
    if value in (None, False, "none", "eager", "false"):
        return None
    if value is True or value == "true":
        return "default"
    if value not in COMPILE_MODES:
        raise ValueError(f"compile: expected false, true or one of {COMPILE_MODES}, got {value!r}")
    return value


def optimizer_kwargs(opt: str, device: torch.device) -> dict:
    """The fastest torch implementation of the optimizer on this device, the same for every model: the
    fused (single-kernel) Adam/AdamW on CUDA, torch's default elsewhere."""
    fused = torch.device(device).type == "cuda" and opt.lower() in ("adam", "adamw")
    return {"fused": True} if fused else {}
