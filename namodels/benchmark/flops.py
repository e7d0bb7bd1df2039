"""GMACs of one forward: torch's ``FlopCounterMode`` for the dense operators, plus neighborhood attention
counted analytically.

``FlopCounterMode`` counts matmuls, convolutions and SDPA, but not our NA kernels (a Triton custom op,
or gathers + einsums that do not match the work NA defines).  So the counting forward routes every NA
call to the ``count`` backend defined here: it adds the MACs NA must do and returns a placeholder of the
right shape without running any counted operator.  MACs of one NA call::

    B * heads_q * N * W * (D + Dv)      # q.k over W keys, then p.v; W = keys a query visits

with ``W = ops.window.keys_per_query(params)`` (prod(K), fewer on causal axes) and ``N`` the number of
query tokens of the call (maps padded up to the kernel count their padding).  Softmax, RPB and scaling
are not counted (as for every other operator: only multiply-accumulates).  GMACs = FLOPs / 2 for the
dense part.  SDPA on CPU (``_scaled_dot_product_flash_attention_for_cpu``) has no formula in torch; one is
added here so dense baselines count the same on every device.
"""
from __future__ import annotations

import threading

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import ops
from ops.window import NAParams, keys_per_query

from ..backend import set_backend

__all__ = ["BACKEND", "COUNT_BACKEND", "count_macs", "na_macs"]

COUNT_BACKEND = "count"


class _Tally(threading.local):
    macs: list | None = None  # [float] while a count is running


_tally = _Tally()


def na_macs(params: NAParams, batch: int, heads_q: int, head_dim: int, value_dim: int) -> float:
    """Multiply-accumulates of one NA call (see the module docstring)."""
    return float(batch * heads_q * params.num_tokens * keys_per_query(params) * (head_dim + value_dim))


class CountingBackend:
    """NA backend for FLOP counting only: adds the call's MACs to the running tally and returns
    placeholders (``out`` = the values, ``lse`` = 0) of the right shapes and dtypes."""

    name = COUNT_BACKEND

    def unsupported(self, problem) -> str | None:
        if _tally.macs is None:
            return "only serves namodels.benchmark.flops.count_macs (returns placeholders, not attention)"
        return None

    def debug_only(self, problem) -> bool:
        return True

    def attention(self, q, k, v, params: NAParams, rpb, scale, need_lse=True):
        hq, hkv = q.shape[-2], v.shape[-2]
        _tally.macs[0] += na_macs(params, q.shape[0], hq, q.shape[-1], v.shape[-1])
        out = v if hq == hkv else v.repeat_interleave(hq // hkv, dim=-2)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return out.clone(), torch.zeros(q.shape[:-1], dtype=lse_dtype, device=q.device)


BACKEND = CountingBackend()


def _ensure_registered() -> None:
    if COUNT_BACKEND not in ops.available_backends():
        ops.register_backend(COUNT_BACKEND, __name__)


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    b, h, n, d = query_shape
    m, dv = key_shape[-2], value_shape[-1]
    return 2 * b * h * n * m * d + 2 * b * h * n * m * dv


def _custom_formulas() -> dict:
    aten = torch.ops.aten
    formulas = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        formulas[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flops
    return formulas


@torch.no_grad()
def count_macs(model: nn.Module, inputs) -> dict:
    """MACs of ``model(*inputs)`` (eval mode, no autocast): ``{'macs', 'na_macs', 'dense_macs'}``.

    Run it with a batch of one for per-sample numbers (what timm's benchmark reports as ``infer_gmacs``).
    """
    _ensure_registered()
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    was_training = model.training
    model.eval()
    # no tensor may require grad: FlopCounterMode's module tracker hooks the autograd graph of module inputs and
    # fails on a parameter passed straight into a submodule (StyleNAT's constant input)
    grad_flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in grad_flags:
        p.requires_grad_(False)
    _tally.macs = [0.0]
    try:
        with set_backend(model, COUNT_BACKEND), FlopCounterMode(display=False,
                                                                  custom_mapping=_custom_formulas()) as counter:
            model(*inputs)
        na = _tally.macs[0]
    finally:
        _tally.macs = None
        model.train(was_training)
        for p, flag in grad_flags:
            p.requires_grad_(flag)
    dense = counter.get_total_flops() / 2
    return {"macs": dense + na, "na_macs": na, "dense_macs": dense}
