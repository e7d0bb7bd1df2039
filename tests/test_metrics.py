"""The tasks' sync-free metrics (``namodels.tasks.metrics``) against torchmetrics' and plain computations."""
from __future__ import annotations

import math

import pytest
import torch
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from namodels.tasks.metrics import RunningMean, TopKAccuracy


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_accuracy_matches_torchmetrics(k):
    torch.manual_seed(0)
    ours, reference = TopKAccuracy(k), MulticlassAccuracy(10, top_k=k, average="micro")
    for batch in (7, 16, 1):
        logits, targets = torch.randn(batch, 10), torch.randint(0, 10, (batch,))  # no ties in random floats
        ours.update(logits, targets)
        reference.update(logits, targets)
    assert 0 < ours.compute().item() < 1
    assert ours.compute().item() == pytest.approx(reference.compute().item(), abs=1e-6)
    ours.reset()
    ours.update(torch.eye(4, 10) * 5, torch.arange(4))
    assert ours.compute().item() == 1.0


def test_top_k_accuracy_names_bad_arguments():
    with pytest.raises(ValueError, match="k: must be >= 1"):
        TopKAccuracy(0)
    with pytest.raises(ValueError, match="at least 5 classes"):
        TopKAccuracy(5).update(torch.randn(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits, targets"):
        TopKAccuracy(1).update(torch.randn(2, 3), torch.zeros(3, dtype=torch.long))


def test_running_mean_is_the_weighted_mean():
    values, weights = [2.5, 1.0, 4.0], [16, 16, 3]
    ours, reference = RunningMean(), MeanMetric()
    for v, w in zip(values, weights):
        ours.update(torch.tensor(v, dtype=torch.bfloat16), weight=w)
        reference.update(torch.tensor(v), weight=w)
    expected = sum(v * w for v, w in zip(values, weights)) / sum(weights)
    assert ours.compute().item() == pytest.approx(expected) == pytest.approx(reference.compute().item())
    ours.update(1.5)  # a number, weight 1
    assert ours.compute().item() == pytest.approx((expected * 35 + 1.5) / 36)


def test_running_mean_shows_a_nan_and_rejects_tensors_that_are_not_scalars():
    mean = RunningMean()
    mean.update(torch.tensor(1.0), weight=2)
    mean.update(torch.tensor(float("nan")), weight=2)
    assert math.isnan(mean.compute().item())
    with pytest.raises(ValueError, match="value: expected a scalar"):
        mean.update(torch.ones(3))
