"""Gradient clipping with the fused AdamW the recipes use on CUDA (``namodels.tasks.clipping``): Lightning's mixed
precision refuses to clip for it, so the tasks clip themselves.  CPU torch has the fused AdamW too, which lets these
tests run the GPU recipes' combination on CPU."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import namodels.tasks.classification as classification
import namodels.tasks.gan as gan
import namodels.tasks.video as video
from namodels.tasks.clipping import clip_gradients, unscales_in_step
from namodels.tasks.runner import fit
from tests.test_train import DEV_OVERRIDES, FAST, compose_cfg


@pytest.fixture
def fused_adamw(monkeypatch):
    """The tasks build their fused Adam / AdamW on CPU as they do on CUDA."""
    for module in (classification, video, gan):
        monkeypatch.setattr(module, "optimizer_kwargs", lambda name, device: {"fused": True})


@pytest.fixture
def clip_norm_calls(monkeypatch):
    calls = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(parameters, max_norm, *args, **kwargs):
        calls.append(max_norm)
        return clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    return calls


@pytest.mark.parametrize("task", ["classification", "video"])
def test_mixed_precision_run_clips_with_the_fused_adamw(task, tmp_path, fused_adamw, clip_norm_calls):
    extra = FAST if task == "classification" else []
    cfg = compose_cfg("train", DEV_OVERRIDES[task] + extra + [
        "threads=1", "logger=csv", f"paths.root_dir={tmp_path}", "trainer.fast_dev_run=true",
        "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=0.5"])
    summary = fit(cfg)  # Lightning's own clipping raised here for the fused optimizer
    assert summary["global_step"] == 1
    assert clip_norm_calls == [0.5]


def _problem(seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(5))]
    grads = [torch.randn(7, 5) * 10, torch.randn(5) * 10]
    return params, grads


def _module(plugin):
    return SimpleNamespace(trainer=SimpleNamespace(precision_plugin=plugin))


@pytest.mark.parametrize("precision, algorithm", [("16-mixed", None), ("16-mixed", "value"), ("bf16-mixed", "norm")])
def test_fused_step_after_clipping_matches_the_unfused_reference(precision, algorithm):
    params, grads = _problem()
    ref_params = copy.deepcopy(params)
    fused = torch.optim.AdamW(params, lr=0.1, fused=True)
    reference = torch.optim.AdamW(ref_params, lr=0.1)
    assert unscales_in_step(fused) and not unscales_in_step(reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if precision == "16-mixed" else None
    plugin = MixedPrecision(precision, "cpu", scaler=scaler)
    scale = scaler.scale(torch.ones(())).item() if scaler else 1.0  # (the scaler starts on its first scale)
    for p, g in zip(params, grads):  # what backward leaves under the scaler
        p.grad = g * scale
    clip_gradients(_module(plugin), fused, 2.0, algorithm)
    if scaler:
        scaler.step(fused)
        scaler.update()
    else:
        fused.step()
    for p, g in zip(ref_params, grads):
        p.grad = g.clone()
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(ref_params, 2.0)
    else:
        assert torch.nn.utils.clip_grad_norm_(ref_params, 2.0) > 2.0  # the clip bites
    reference.step()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r)


def test_non_finite_scaled_gradients_skip_the_fused_step():
    params, grads = _problem()
    before = [p.detach().clone() for p in params]
    fused = torch.optim.AdamW(params, lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    params[0].grad = grads[0].clone()
    params[1].grad = torch.full_like(grads[1], float("inf"))
    clip_gradients(_module(MixedPrecision("16-mixed", "cpu", scaler=scaler)), fused, 2.0, None)
    scaler.step(fused)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert scaler.get_scale() == 512.0


def test_no_value_clips_nothing():
    params, grads = _problem()
    for p, g in zip(params, grads):
        p.grad = g.clone()
    fused = torch.optim.AdamW(params, lr=0.1, fused=True)
    clip_gradients(_module(MixedPrecision("bf16-mixed", "cpu")), fused, None, None)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
