"""nat_digits (namodels/models/tiny.py): the default training model follows timm's conventions and runs
its attention through the project's NA kernels with the backend it is given."""
import pytest
import timm
import torch

import namodels  # noqa: F401
import ops
from namodels.models.tiny import TinyNAT


def test_shapes_and_timm_api():
    torch.manual_seed(0)
    model = timm.create_model("nat_digits", num_classes=7).eval()
    x = torch.randn(2, 3, 32, 32)
    features = model.forward_features(x)
    assert features.shape == (2, 4, 4, model.num_features)  # channels-last, as NAT
    assert model.forward_head(features, pre_logits=True).shape == (2, model.num_features)
    assert model(x).shape == (2, 7)
    model.reset_classifier(3)
    assert model(x).shape == (2, 3) and model.get_classifier().out_features == 3
    assert {n for n, _ in model.named_parameters() if n.endswith(".rpb")} == model.no_weight_decay()
    assert model.pretrained_cfg["input_size"] == (3, 32, 32)


def test_attention_runs_through_the_requested_backend(monkeypatch):
    calls = []
    real = ops.functional.select_backend

    def spy(problem, requested):
        calls.append(requested)
        return real(problem, requested)

    monkeypatch.setattr(ops.functional, "select_backend", spy)
    model = timm.create_model("nat_digits", backend="naive")
    model(torch.randn(1, 3, 32, 32)).sum().backward()
    assert calls and set(calls) == {"naive"} and len(calls) == 4  # four NA blocks
    assert all(p.grad is not None for p in model.parameters())


def test_backends_agree():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    naive = timm.create_model("nat_digits", backend="naive").double().eval()
    gemm = timm.create_model("nat_digits", backend="gemm").double().eval()
    gemm.load_state_dict(naive.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(naive(x), gemm(x), rtol=1e-9, atol=1e-9)


def test_invalid_architecture_arguments():
    with pytest.raises(ValueError, match="dilations: each level needs one dilation per block"):
        TinyNAT(kernel_sizes=((5, 3), (3,)), dilations=((1, 2), (1, 1)))
    with pytest.raises(ValueError, match="global_pool"):
        TinyNAT(global_pool="max")
    too_wide = TinyNAT(kernel_sizes=((5, 5), (3, 3)), dilations=((1, 2), (1, 1)))  # 5 * 2 > 8 tokens
    with pytest.raises(ValueError, match="kernel_size: axis 0: kernel_size \\* dilation"):
        too_wide(torch.randn(1, 3, 32, 32))
