"""The fused backend's launch decisions for a fixed battery of problems, against a committed golden table.

``decide.decide_forward`` / ``decide_backward`` (dry: nothing runs) decide each problem of ``PROBLEMS`` three times: as
Triton's interpreter does, and for an emulated sm_80 and sm_90 GPU (``decide.capability`` replaced), so the Hopper
kernels' decisions are covered without a GPU.  Every decision of the plans (kernel family and why, tile configs, the
kernels' decided constexprs, batch chunks, layouts, the dRPB mode, the Hopper kernels' tiles) is compared with
``tests/data/fused_decisions.json``.  A change to a decision fails here; where the change is meant, regenerate the
table and review its diff:

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/test_fused_decisions.py --write
"""
import contextlib
import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of triton code
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from ops.fused import autotune, decide, hopper, kernels  # noqa: E402
from ops.window import NAParams  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fused_decisions.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICES = {"interpreter": None, "sm80": (8, 0), "sm90": (9, 0)}

# name: (spatial, window, stride, dilation, causal, batch, heads, kv heads, head dim, dtype, rpb, deterministic dRPB)
PROBLEMS = {
    "1d-small": ((64,), (3,), (1,), (1,), (False,), 2, 4, 4, 16, "fp32", False, False),
    "1d-rpb-bf16": ((200,), (13,), (1,), (1,), (False,), 2, 4, 4, 32, "bf16", True, False),
    "1d-stride-gqa": ((128,), (7,), (2,), (1,), (False,), 2, 4, 2, 64, "fp16", False, False),
    "1d-dilated-rpb-det": ((96,), (5,), (1,), (4,), (False,), 2, 4, 4, 32, "fp32", True, True),
    "1d-causal": ((130,), (9,), (1,), (1,), (True,), 2, 4, 4, 128, "bf16", False, False),
    "1d-large-window": ((4096,), (1025,), (1,), (1,), (False,), 1, 2, 2, 128, "bf16", False, False),
    "1d-batch-chunks": ((8,), (3,), (1,), (1,), (False,), 9000, 8, 8, 16, "fp32", True, False),
    "2d-nat": ((14, 14), (7, 7), (1, 1), (1, 1), (False, False), 2, 2, 2, 32, "bf16", True, False),
    "2d-dinat": ((56, 56), (7, 7), (1, 1), (8, 8), (False, False), 1, 2, 2, 32, "fp16", False, False),
    "2d-stride": ((20, 24), (5, 9), (2, 3), (1, 1), (False, False), 2, 4, 4, 64, "fp32", True, True),
    "2d-causal-dilated": ((16, 16), (3, 5), (1, 1), (2, 1), (True, False), 2, 4, 2, 16, "bf16", False, False),
    "2d-large-window": ((48, 48), (33, 33), (1, 1), (1, 1), (False, False), 1, 2, 2, 64, "fp16", False, False),
    "2d-large-stride": ((64, 64), (33, 33), (16, 16), (1, 1), (False, False), 1, 2, 1, 128, "bf16", False, False),
    "3d-small": ((6, 8, 8), (3, 3, 3), (1, 1, 1), (1, 1, 1), (False,) * 3, 2, 2, 2, 32, "fp32", True, False),
    "3d-causal": ((8, 12, 12), (5, 7, 7), (1, 1, 1), (1, 1, 1), (True, False, False), 2, 4, 4, 64, "bf16", False,
                  False),
    "3d-mixed": ((10, 10, 10), (3, 5, 3), (2, 1, 3), (1, 2, 1), (False,) * 3, 2, 2, 2, 128, "fp32", True, False),
    "3d-large-window": ((16, 16, 16), (11, 11, 11), (1, 1, 1), (1, 1, 1), (False,) * 3, 1, 2, 2, 128, "bf16", False,
                        False),
    "3d-large-causal": ((16, 24, 24), (11, 11, 11), (1, 1, 1), (1, 1, 1), (True, False, False), 1, 2, 2, 64, "fp16",
                        False, False),
}

FORWARD_FLAGS = ("TMA", "HOST_DESC", "MASK_IN_DOT", "BIAS_TILES", "FOLD_SCALE", "IDX64", "PREC", "STORE_LSE",
                 "GATHER_ROWS")
DQ_FLAGS = ("TMA", "HOST_DESC", "MASK_IN_DOT", "BIAS_TILES", "DS_BOXES", "STORE_DS", "DS_ATOMIC", "IDX64", "PREC")
DKDV_FLAGS = ("TMA", "HOST_DESC", "MASK_IN_DOT", "BIAS_TILES", "QUERY_ROWS", "BISECT", "IDX64", "PREC")


@contextlib.contextmanager
def emulated(device):
    """Decisions as for ``device`` (a ``DEVICES`` key): the probe replaced, and the interpreter's rules off for a
    GPU; an H100's 132 SMs for the Hopper kernels' tile order."""
    saved = decide.capability, kernels.interpreted, hopper.multiprocessors
    if DEVICES[device] is not None:
        decide.capability = lambda _device: DEVICES[device]
        kernels.interpreted = lambda: False
        hopper.multiprocessors = lambda _device: 132
    try:
        yield
    finally:
        decide.capability, kernels.interpreted, hopper.multiprocessors = saved


def _config(config):
    return None if config is None else [list(config.outer_tile), list(config.inner_tile), config.num_warps,
                                        config.num_stages, config.tma, config.maxnreg]


def _launches(chunks, names):
    if not chunks:
        return None
    first = chunks[0][0]
    return {"chunks": len(chunks), "grid": list(first.grid), **{name: first.meta.get(name) for name in names}}


def _hopper(record):
    if record is None:
        return None
    fields = {"grid": list(record.grid)}
    for name in ("q_tile", "kv_tile", "masked", "persistent"):
        if hasattr(record, name):
            value = getattr(record, name)
            fields[name] = list(value) if isinstance(value, tuple) else value
    return fields


def decisions(name: str, device: str) -> dict:
    """Every decision of the problem's forward and backward plans on ``device``, as JSON values."""
    spatial, window, stride, dilation, causal, batch, heads, kv_heads, dim, dtype, rpb, deterministic = PROBLEMS[name]
    params = NAParams(spatial, window, stride, dilation, causal)
    dtype = DTYPES[dtype]
    q = torch.zeros(batch, *spatial, heads, dim, dtype=dtype)
    k, v = (torch.zeros(batch, *spatial, kv_heads, dim, dtype=dtype) for _ in range(2))
    bias = torch.zeros(heads, *(2 * w - 1 for w in window)) if rpb else None
    scale = dim ** -0.5
    with emulated(device):
        fwd = decide.decide_forward(q, k, v, bias, params, scale, True, dry=True)
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[:-1])
        bwd = decide.decide_backward(q, k, v, bias, out, lse, out, None, params, scale, deterministic, rpb, dry=True)
    return {
        "forward": {"hopper_why": fwd.choices.hopper_why, "config": _config(fwd.config), "source": fwd.config_source,
                    "launch": _launches(fwd.launches, FORWARD_FLAGS), "as_tokens": fwd.as_tokens,
                    "rpb_direct": fwd.rpb_direct, "host_layouts": fwd.host_desc_layouts is not None,
                    "bias_tiles": None if fwd.bias_tiles is None else fwd.bias_tiles[1], "hopper": _hopper(fwd.hopper)},
        "backward": {"dq_hopper_why": bwd.choices.dq_hopper_why, "dkdv_hopper_why": bwd.choices.dkdv_hopper_why,
                     "dq_config": _config(bwd.dq_config), "dkdv_config": _config(bwd.dkdv_config),
                     "dq": _launches(bwd.dq_launches, DQ_FLAGS), "dkdv": _launches(bwd.dkdv_launches, DKDV_FLAGS),
                     "drpb_mode": bwd.drpb_mode, "drpb_atomic": bwd.drpb_atomic, "ds_window": bwd.ds_window,
                     "ds_tiles": bwd.ds_tiles, "offset_config": _config(bwd.offset_config),
                     "as_tokens": bwd.as_tokens, "rpb_direct": bwd.rpb_direct,
                     "hopper_dq": _hopper(bwd.hopper_dq), "hopper_dkdv": _hopper(bwd.hopper_dkdv)},
    }


def all_decisions() -> dict:
    return {f"{name}|{device}": json.loads(json.dumps(decisions(name, device)))
            for name in PROBLEMS for device in DEVICES}


@pytest.fixture
def untuned(monkeypatch, tmp_path):
    """The defaults: no tuning, no pinned configs, an empty tuning cache, torch's default float32 matmul setting."""
    monkeypatch.setenv("NAMODELS_FUSED_CACHE", str(tmp_path / "none.json"))
    monkeypatch.setattr(autotune, "_cache", {})
    monkeypatch.setattr(autotune, "_tune_override", False)
    monkeypatch.setattr(autotune, "_forced", {})
    monkeypatch.setattr(decide, "_PLANS", {})
    monkeypatch.setattr(decide, "BIAS_TILES", True)
    monkeypatch.setattr(hopper, "ENABLED", True)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.skipif(hopper.gluon is None, reason="the golden table was written with Triton's Gluon dialect present")
@pytest.mark.parametrize("device", sorted(DEVICES))
def test_decisions_match_the_golden_table(untuned, device):
    with open(GOLDEN, encoding="utf-8") as fh:
        golden = json.load(fh)
    assert {key.split("|")[0] for key in golden} == set(PROBLEMS), "regenerate the table (module docstring)"
    for name in PROBLEMS:
        key = f"{name}|{device}"
        got = json.loads(json.dumps(decisions(name, device)))
        assert got == golden[key], f"{key}: decisions differ from tests/data/fused_decisions.json"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    os.environ["NAMODELS_FUSED_CACHE"] = os.devnull
    autotune.set_autotune(False)
    torch.set_float32_matmul_precision("highest")
    with open(GOLDEN, "w", encoding="utf-8") as fh:
        json.dump(all_decisions(), fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"wrote {GOLDEN}")
