"""``torch.compile`` settings shared by training and the throughput benchmark."""
from __future__ import annotations

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
