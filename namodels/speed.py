"""What makes a training step fast, shared by the training tasks and the throughput benchmark: the
``torch.compile`` mode and options, the fastest implementation of the optimizer, and the backward on the calling
thread."""
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


# Inductor options added to every compile mode, for every model alike.  Combo kernels launch independent pointwise
# kernels of a graph (weight casts, bias-gradient casts, elementwise epilogues) as one: a CUDA-graph step pays a
# fixed GPU-side gap per kernel node, and a deep model's compiled training step is made of thousands of small
# kernels.  Pointwise only: combined reductions ran slower than separate ones (docs/speed.md, "Inductor options:
# pointwise combo kernels", holds the measurements).
COMPILE_OPTIONS = {"combo_kernels": True, "combo_kernels_pointwise_only": True}


def compile_options(mode: str) -> dict:
    """Inductor options of ``torch.compile`` in ``mode`` (a ``COMPILE_MODES`` name) plus ``COMPILE_OPTIONS``:
    ``torch.compile`` takes a mode or options, not both, so the mode is spelled out as its options."""
    from torch._inductor import list_mode_options

    return {**list_mode_options(mode), **COMPILE_OPTIONS}


def compiled(module, mode: str):
    """``torch.compile(module)`` in ``mode`` with the project's inductor options."""
    return torch.compile(module, options=compile_options(mode))


def optimizer_kwargs(opt: str, device: torch.device) -> dict:
    """The fastest torch implementation of the optimizer on this device, the same for every model: the
    fused (single-kernel) Adam/AdamW on CUDA, torch's default elsewhere."""
    fused = torch.device(device).type == "cuda" and opt.lower() in ("adam", "adamw")
    return {"fused": True} if fused else {}


def calling_thread_backward():
    """Context manager: backward passes run on the thread that calls them.

    By default torch runs the CUDA part of a backward on a worker thread of its own while the calling thread waits.
    Where the host bounds an eager step (a deep model at small feature maps, such as NAT-Tiny's 30 blocks), the same
    backward costs clearly more host time on the worker thread, and one backward per step gains nothing from it
    (measured step times: docs/speed.md, "Backward on the calling thread").
    """
    return torch.autograd.set_multithreading_enabled(False)


class CallingThreadBackward:
    """LightningModule mixin: Lightning's ``backward`` hook (automatic and manual optimisation) runs inside
    :func:`calling_thread_backward`."""

    def backward(self, loss, *args, **kwargs):
        with calling_thread_backward():
            super().backward(loss, *args, **kwargs)
