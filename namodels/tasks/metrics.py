"""Metrics that a training or validation step can update without waiting for the GPU.

torchmetrics' ``MeanMetric`` checks every update for NaNs with ``if nans.any()`` (unless ``nan_strategy="disable"``,
which then ignores the weights): a host read of a GPU value, so every step that updates it waits for the GPU to
finish the step's forward before the host may queue the backward.  :class:`RunningMean` keeps the weighted sum and
the total weight on the device and is read only by ``compute`` (once per epoch).
"""
from __future__ import annotations

import torch
from torchmetrics import Metric


class RunningMean(Metric):
    """Weighted mean of scalar values (e.g. a per-batch loss weighted by the batch size), synchronised across
    processes by summing both states.  A NaN or inf value makes the mean NaN / inf, as it should show."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("weighted_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor | float, weight: float = 1.0) -> None:
        """``value``: a scalar tensor (on any device; moved, not read) or a number; ``weight``: a number."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"value: expected a scalar, got a tensor of shape {tuple(value.shape)}")
            value = value.detach().reshape(()).to(self.weighted_sum.device, torch.float64, non_blocking=True)
        self.weighted_sum += value * float(weight)
        self.weight += float(weight)

    def compute(self) -> torch.Tensor:
        return (self.weighted_sum / self.weight).float()


class TopKAccuracy(Metric):
    """Fraction of samples whose target is among the ``k`` highest logits (torchmetrics' micro-averaged
    ``MulticlassAccuracy(top_k=k)``), kept as two sums on the device.  torchmetrics' version checks its inputs and
    one-hot encodes them, reading GPU values on the host at every update.  ``compute`` returns a fraction."""

    full_state_update = False

    def __init__(self, k: int = 1, **kwargs):
        super().__init__(**kwargs)
        if int(k) < 1:
            raise ValueError(f"k: must be >= 1, got {k!r}")
        self.k = int(k)
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``logits [N, C]`` (C >= k), ``targets [N]`` class indices."""
        if logits.dim() != 2 or targets.shape != logits.shape[:1]:
            raise ValueError(f"logits, targets: expected [N, C] and [N], got {tuple(logits.shape)} and "
                             f"{tuple(targets.shape)}")
        if logits.shape[1] < self.k:
            raise ValueError(f"logits: top-{self.k} accuracy needs at least {self.k} classes, got {logits.shape[1]}")
        top = logits.topk(self.k, dim=1).indices
        self.correct += (top == targets.to(top.device).unsqueeze(1)).any(dim=1).sum()
        self.total += targets.shape[0]

    def compute(self) -> torch.Tensor:
        return self.correct.double().div(self.total).float()
