"""namodels.set_backend: the NA backend of a whole model, through the modules' public ``backend``."""
from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

import namodels
import ops
from namodels.backend import register_na_module
from namodels.models.stylenat import HydraNeighborhoodAttention, StyleNATGenerator

TINY_G = dict(size=32, channels=[32, 32, 16, 16], style_dim=16, n_mlp=2)


def _backends(model):
    return {m.backend for _, m in namodels.na_modules(model)}


@pytest.mark.parametrize("build, count", [
    (lambda: timm.create_model("nat_digits", backend="gemm"), 4),
    (lambda: timm.create_model("nat_mini", backend="gemm"), 18),
    (lambda: timm.create_model("dinat_s_tiny", backend="gemm"), 12),
    (lambda: timm.create_model("video_nat_nano", img_size=32, backend="gemm"), None),
    (lambda: StyleNATGenerator(**TINY_G, backend="gemm"), 8),
])
def test_set_backend_reaches_every_na_module(build, count):
    model = build()
    found = namodels.na_modules(model)
    assert found and (count is None or len(found) == count)
    assert _backends(model) == {"gemm"}
    setting = namodels.set_backend(model, "naive")  # plain call: the setting stays
    assert len(setting) == len(found) and _backends(model) == {"naive"}
    assert ops.current_backend() is None  # only the context manager selects it for the block


def test_set_backend_as_context_restores_each_module():
    model = nn.Sequential(ops.NeighborhoodAttention2D(8, 2, 3, backend="gemm"), ops.NeighborhoodAttention1D(8, 2, 3),
                          HydraNeighborhoodAttention(8, 2, [(3, 1)], backend="flex"))
    with namodels.set_backend(model, "naive") as setting:
        assert len(setting) == 3 and _backends(model) == {"naive"} and ops.current_backend() == "naive"
        with namodels.set_backend(model, None):
            assert _backends(model) == {None} and ops.current_backend() is None
        assert _backends(model) == {"naive"} and ops.current_backend() == "naive"
    assert [m.backend for m in model] == ["gemm", None, "flex"] and ops.current_backend() is None


def test_set_backend_restores_after_an_error_and_checks_the_name():
    model = nn.Sequential(ops.NeighborhoodAttention2D(8, 2, 3, backend="gemm"))
    with pytest.raises(RuntimeError, match="boom"):
        with namodels.set_backend(model, "naive"):
            raise RuntimeError("boom")
    assert model[0].backend == "gemm" and ops.current_backend() is None
    with pytest.raises(ValueError, match="backend: unknown backend 'nope'"):
        namodels.set_backend(model, "nope")
    assert model[0].backend == "gemm"


def test_set_backend_leaves_models_without_neighborhood_attention_alone():
    model = nn.Sequential(nn.Linear(4, 4))
    with namodels.set_backend(model, "naive") as setting:
        assert len(setting) == 0 and ops.current_backend() == "naive"


def test_forward_runs_on_the_backend_set(monkeypatch):
    """The modules pass their ``backend`` to the kernels: a model set to one backend calls only that one."""
    import ops.functional as registry

    model = timm.create_model("nat_digits").eval()
    calls = []
    real = registry.select_backend

    def spy(problem, requested):
        calls.append(requested if requested is not None else ops.current_backend())
        return real(problem, requested)

    monkeypatch.setattr(registry, "select_backend", spy)
    namodels.set_backend(model, "gemm")
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert calls and set(calls) == {"gemm"}


def test_register_na_module():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.backend = None

    model = nn.Sequential(Custom())
    assert namodels.na_modules(model) == []
    assert register_na_module(Custom) is Custom
    namodels.set_backend(model, "naive")
    assert model[0].backend == "naive"
    with pytest.raises(TypeError, match="nn.Module"):
        register_na_module(int)
