"""A full model training step on the GPU, per backend: a NAT-Mini training step runs on `fused` and matches
`naive`'s gradients within bf16 tolerance.

The reference is the same step in float32 on `naive` (TF32 off). Both bf16 runs (naive and fused)
carry bf16 rounding error against it; fused passes when its error is no worse than naive's own
bf16 error plus a small margin, so the tolerance is measured, not guessed.
Run on a CUDA machine: ``pytest -m gpu tests/test_gpu_training.py``.
"""
from __future__ import annotations

import contextlib

import pytest
import timm
import torch

import namodels  # noqa: F401  (registers the models)
import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _step(model, images, labels, backend, dtype):
    model.zero_grad(set_to_none=True)
    with ops.use_backend(backend), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("name", ["nat_mini", "dinat_mini"])
def test_training_step_fused_matches_naive(name):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = timm.create_model(name, num_classes=10, drop_path_rate=0.0).cuda().train()
    with torch.no_grad():  # zero-initialised biases would hide a wrong dRPB
        for n, p in model.named_parameters():
            if n.endswith("rpb"):
                p.normal_(0, 0.5)
    images = torch.randn(2, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 10, (2,), device="cuda")
    ref_loss, ref = _step(model, images, labels, "naive", torch.float32)
    naive_loss, naive = _step(model, images, labels, "naive", torch.bfloat16)
    fused_loss, fused = _step(model, images, labels, "fused", torch.bfloat16)
    assert torch.isfinite(fused_loss)
    assert abs(fused_loss - ref_loss) <= abs(naive_loss - ref_loss) + 2e-2 * abs(ref_loss)
    rpb_names = [n for n in ref if n.endswith("rpb")]
    assert rpb_names, "the model has no relative position bias: the test would not check dRPB"
    worst = []
    for n in ref:
        err_naive, err_fused = _rel(naive[n], ref[n]), _rel(fused[n], ref[n])
        worst.append((err_fused, err_naive, n))
        assert err_fused <= 2 * err_naive + 1e-2, f"{n}: fused rel err {err_fused:.3g}, naive bf16 {err_naive:.3g}"
    worst.sort(reverse=True)
    print(f"\n{name}: worst fused/naive rel errors vs fp32 naive: {worst[:3]}")


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_compiled_training_step_matches_eager(mode):
    """NAT-Mini compiled (CUDA graphs in reduce-overhead) gives the eager step's loss and gradients within bf16
    tolerance, on the fused kernels, over several steps (the graph is replayed, not only recorded), without
    recompiling.  The CUDA-graph run takes its backward on the calling thread, as the training tasks run it; the
    default mode on torch's worker thread."""
    from namodels.speed import calling_thread_backward

    torch.manual_seed(0)
    model = timm.create_model("nat_mini", num_classes=10, drop_path_rate=0.0, backend="fused").cuda().train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("rpb"):
                p.normal_(0, 0.5)
    images = torch.randn(8, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 10, (8,), device="cuda")
    # compiled first, on empty caches: what the fused op caches while a graph is warmed up or recorded must
    # stay out of the graph's memory pool
    from ops.fused import rpb_grad

    rpb_grad._SLOT_TABLES.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(compiled(images), labels)
            with calling_thread_backward() if mode == "reduce-overhead" else contextlib.nullcontext():
                loss.backward()
    compiled_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    eager_loss, eager = _step(model, images, labels, "fused", torch.bfloat16)
    assert abs(loss.item() - eager_loss.item()) <= 2e-2 * abs(eager_loss.item())
    for n, grad in compiled_grads.items():
        assert _rel(grad, eager[n]) < 5e-2, n
