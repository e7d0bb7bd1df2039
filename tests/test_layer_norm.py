"""``ops.layer_norm``: the Triton LayerNorm against ``torch.nn.functional.layer_norm``.

* forward and the x / weight / bias gradients against a float64 reference, under ``TRITON_INTERPRET=1``
  on CPU: power-of-two and masked widths, row counts that leave a partial last block, several backward
  programs each walking several blocks, float32 and bfloat16, with and without affine parameters;
* the output dtype rule (autocast dtype under autocast, x's dtype without), gradient dtypes;
* the module as a drop-in for ``nn.LayerNorm`` and the torch fallback where the kernels do not apply;
* ``gpu``-marked: the kernels on CUDA on NAT-Tiny shapes under bf16 autocast.
"""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton kernels must be created in interpreter mode: before triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ops.layer_norm as ln  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(ln.triton is None or not (INTERPRET or torch.cuda.is_available()),
                                   reason="needs Triton: CUDA, or TRITON_INTERPRET=1 on CPU")
gpu = pytest.mark.gpu

# max |error| / max |reference| allowed: float32 math against float64; bfloat16 (8 significant bits)
# inputs and outputs against float64 math on the same (rounded) inputs
RELATIVE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def _inputs(shape, dtype, affine, seed=0):
    """x (shifted off zero mean, so the mean term matters), weight / bias (or None), an upstream grad."""
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    weight = (1 + 0.5 * torch.randn(C, generator=g)).to(dtype).requires_grad_() if affine else None
    bias = (0.5 * torch.randn(C, generator=g)).to(dtype).requires_grad_() if affine else None
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, weight, bias, dy


def _reference(x, weight, bias, dy, eps=1e-5):
    """float64 F.layer_norm on the same values: output and the gradients of (x, weight, bias)."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    y = F.layer_norm(leaves[0], leaves[0].shape[-1:], leaves[1], leaves[2], eps)
    y.backward(dy.double())
    return y.detach(), [t.grad if t is not None else None for t in leaves]


def _check_against_reference(y, x, weight, bias, dy, tol):
    y_ref, grads_ref = _reference(x, weight, bias, dy)
    assert _relative_error(y, y_ref) < tol, "output"
    for name, leaf, grad_ref in zip(("x", "weight", "bias"), (x, weight, bias), grads_ref):
        if leaf is None:
            continue
        assert leaf.grad is not None, f"no gradient reached {name}"
        assert leaf.grad.dtype == leaf.dtype, f"{name} gradient dtype"
        assert _relative_error(leaf.grad, grad_ref) < tol, f"{name} gradient"


@needs_kernels
@pytest.mark.parametrize("C", [32, 64, 96, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_forward_and_gradients_match_float64(C, dtype, affine):
    x, weight, bias, dy = _inputs((2, 5, 7, C), dtype, affine, seed=C)
    y = ln.layer_norm(x, (C,), weight, bias, 1e-5, force_triton=True)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    _check_against_reference(y, x, weight, bias, dy, RELATIVE_TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("C", [64, 96])
def test_partial_blocks_and_backward_programs_walking_several_blocks(C):
    """70 rows in blocks of 8 (last block 6 rows), the backward over 3 programs of 3 blocks each (the
    last program's third block is past the end): dweight / dbias add up partial sums over programs."""
    x, weight, bias, dy = _inputs((70, C), torch.float32, affine=True, seed=1)
    rows = x.detach()
    y, stats = ln.layer_norm_forward(rows, weight.detach(), bias.detach(), 1e-5, torch.float32, block_rows=8)
    dx, dweight, dbias = ln.layer_norm_backward(dy, rows, weight.detach(), stats, block_rows=8, max_programs=3)
    y_ref, (dx_ref, dweight_ref, dbias_ref) = _reference(x, weight, bias, dy)
    assert _relative_error(y, y_ref) < 1e-5
    assert _relative_error(stats[0], rows.double().mean(-1)) < 1e-5
    assert _relative_error(stats[1], rows.double().var(-1, unbiased=False).add(1e-5).rsqrt()) < 1e-5
    assert _relative_error(dx, dx_ref) < 1e-5
    assert _relative_error(dweight, dweight_ref) < 1e-5
    assert _relative_error(dbias, dbias_ref) < 1e-5


@needs_kernels
@pytest.mark.parametrize("in_place", [False, True], ids=["new-output", "into-the-residual"])
def test_backward_adds_a_residual_gradient(in_place):
    """``residual``: dx comes back with the skip connection's gradient added (a bfloat16 dy, as a GEMM gives it),
    also written over the residual itself (``out=residual``)."""
    x, weight, bias, dy = _inputs((70, 64), torch.float32, affine=True, seed=4)
    rows = x.detach()
    _, stats = ln.layer_norm_forward(rows, weight.detach(), bias.detach(), 1e-5, torch.float32, block_rows=8)
    dy = dy.to(torch.bfloat16)
    residual = torch.randn(70, 64, generator=torch.Generator().manual_seed(5))
    expected = residual.double() + _reference(x, weight, bias, dy.float())[1][0]
    kept = residual.clone()
    dx, dweight, _ = ln.layer_norm_backward(dy, rows, weight.detach(), stats, residual=residual,
                                            out=residual if in_place else None, block_rows=8, max_programs=3)
    assert _relative_error(dx, expected) < 1e-5
    assert (dx.data_ptr() == residual.data_ptr()) == in_place
    if not in_place:
        assert torch.equal(residual, kept)
    assert _relative_error(dweight, _reference(x, weight, bias, dy.float())[1][1]) < 1e-5


@needs_kernels
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "per-sample-scale"])
def test_forward_adds_a_branch_and_backward_writes_its_gradient(scaled):
    """``add`` / ``add_scale``: the norm of ``x + scale[sample] * branch`` (a bfloat16 branch, 5 samples of 14 rows),
    with the sum returned; ``copy_dtype`` / ``copy_scale``: the backward also returns ``scale[sample] * dx`` in
    bfloat16, the branch's gradient."""
    x, weight, bias, dy = _inputs((70, 64), torch.float32, affine=True, seed=6)
    gen = torch.Generator().manual_seed(7)
    branch = torch.randn(70, 64, generator=gen).to(torch.bfloat16)
    scale = torch.tensor([0.0, 1.25, 1.25, 0.0, 1.25]) if scaled else None
    per_row = scale.repeat_interleave(14)[:, None].double() if scaled else 1.0
    summed = x.detach().double() + per_row * branch.double()
    y, stats, total = ln.layer_norm_forward(x.detach(), weight.detach(), bias.detach(), 1e-5, torch.float32,
                                            add=branch, add_scale=scale, block_rows=8)
    assert total.dtype == torch.float32 and _relative_error(total, summed) < 1e-6
    ref_x = summed.clone().requires_grad_(True)
    ref_y = F.layer_norm(ref_x, (64,), weight.detach().double(), bias.detach().double(), 1e-5)
    assert _relative_error(y, ref_y) < 1e-5
    (ref_dx,) = torch.autograd.grad(ref_y, ref_x, dy.double())
    dx, _, _, copy = ln.layer_norm_backward(dy, total, weight.detach(), stats, copy_dtype=torch.bfloat16,
                                            copy_scale=scale, block_rows=8, max_programs=3)
    assert _relative_error(dx, ref_dx) < 1e-5
    assert copy.dtype == torch.bfloat16 and _relative_error(copy, ref_dx * per_row) < 1e-2


@needs_kernels
@pytest.mark.parametrize("scaled", [False, True], ids=["gamma", "per-sample-scale-and-gamma"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["", "residual"])
def test_a_layer_scaled_branch_and_the_gradient_of_its_scale(scaled, with_residual):
    """``add_gamma`` / ``copy_gamma``: the norm of ``x + scale[sample] * gamma * branch`` (a layer-scaled residual
    branch), the branch's gradient ``scale[sample] * gamma * dx`` and gamma's, ``sum(dx * scale[sample] * branch)``
    over rows (``gamma_input``); ``residual`` is part of dx, the gradient of the sum."""
    x, weight, bias, dy = _inputs((70, 48), torch.float32, affine=True, seed=8)
    gen = torch.Generator().manual_seed(9)
    branch = torch.randn(70, 48, generator=gen).to(torch.bfloat16)
    gamma = torch.randn(48, generator=gen)
    residual = torch.randn(70, 48, generator=gen) if with_residual else None
    scale = torch.tensor([0.0, 1.25, 1.25, 0.0, 1.25]) if scaled else None
    per_row = scale.repeat_interleave(14)[:, None].double() if scaled else 1.0
    ref_gamma = gamma.double().requires_grad_(True)
    ref_x = x.detach().double().requires_grad_(True)
    summed = ref_x + per_row * ref_gamma * branch.double()
    ref_y = F.layer_norm(summed, (48,), weight.detach().double(), bias.detach().double(), 1e-5)
    y, stats, total = ln.layer_norm_forward(x.detach(), weight.detach(), bias.detach(), 1e-5, torch.float32,
                                            add=branch, add_scale=scale, add_gamma=gamma, block_rows=8)
    assert _relative_error(total, summed) < 1e-6 and _relative_error(y, ref_y) < 1e-5
    loss = (ref_y * dy.double()).sum() + ((summed * residual.double()).sum() if with_residual else 0)
    ref_dx, ref_dgamma = torch.autograd.grad(loss, (ref_x, ref_gamma))
    dx, _, _, copy, dgamma = ln.layer_norm_backward(dy, total, weight.detach(), stats, residual=residual,
                                                    copy_dtype=torch.bfloat16, copy_scale=scale, copy_gamma=gamma,
                                                    gamma_input=branch, block_rows=8, max_programs=3)
    assert _relative_error(dx, ref_dx) < 1e-5
    assert _relative_error(copy, ref_dx * per_row * gamma.double()) < 1e-2
    assert dgamma.dtype == torch.float32 and _relative_error(dgamma, ref_dgamma) < 1e-5
    *_, no_dgamma = ln.layer_norm_backward(dy, total, weight.detach(), stats, copy_dtype=torch.bfloat16,
                                           copy_scale=scale, copy_gamma=gamma)
    assert no_dgamma is None


def test_a_scale_that_does_not_split_the_rows_is_refused():
    x = torch.randn(10, 8)
    with pytest.raises(ValueError, match="scale"):
        ln.layer_norm_forward(x, None, None, 1e-5, torch.float32, add=x, add_scale=torch.ones(3))


@needs_kernels
def test_gradients_only_where_asked():
    """x without grad, weight with grad, no bias: the kernel computes only dweight."""
    x, weight, _, dy = _inputs((3, 11, 64), torch.float32, affine=True, seed=2)
    x.requires_grad_(False)
    y = ln.layer_norm(x, 64, weight, None, force_triton=True)
    y.backward(dy)
    _, (_, dweight_ref, _) = _reference(x, weight, None, dy)
    assert x.grad is None
    assert _relative_error(weight.grad, dweight_ref) < 1e-5


@needs_kernels
def test_autocast_returns_autocast_dtype_with_ln_then_cast_values():
    """Under autocast the Triton path writes the autocast dtype (torch's LayerNorm returns float32 and
    the following Linear casts it); the values are torch's float32 output cast to bfloat16."""
    x, weight, bias, dy = _inputs((2, 5, 7, 64), torch.float32, affine=True, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ln.layer_norm(x, (64,), weight, bias, force_triton=True)
        y_torch = F.layer_norm(x, (64,), weight, bias)
    assert y.dtype == torch.bfloat16
    assert y_torch.dtype == torch.float32  # the behaviour the Triton path deliberately differs from
    # identical up to one bfloat16 step where float32 rounding differs
    assert (y.float() - y_torch.to(torch.bfloat16).float()).abs().max() <= 2 ** -7 * y_torch.abs().max()
    y.backward(dy.to(torch.bfloat16))
    assert x.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.float32
    _check_against_reference(y, x, weight, bias, dy.to(torch.bfloat16), RELATIVE_TOL[torch.bfloat16])


@needs_kernels
def test_output_dtype_without_autocast_and_explicit_out_dtype():
    x, weight, bias, _ = _inputs((4, 32), torch.bfloat16, affine=True)
    assert ln.layer_norm(x, (32,), weight.float(), bias.float(), force_triton=True).dtype == torch.bfloat16
    assert ln.layer_norm(x.float(), (32,), weight, bias, force_triton=True).dtype == torch.float32
    assert ln.layer_norm(x, (32,), weight, bias, out_dtype=torch.float32, force_triton=True).dtype == torch.float32
    # the torch path honours an explicit out_dtype too
    assert ln.layer_norm(x, (32,), weight, bias, out_dtype=torch.float32).dtype == torch.float32


@needs_kernels
def test_non_contiguous_one_dim_and_empty_inputs():
    x, weight, bias, dy = _inputs((6, 5, 40), torch.float32, affine=True, seed=4)
    x_t = x.detach().transpose(0, 1).requires_grad_()  # [5, 6, 40], rows not in memory order
    y = ln.layer_norm(x_t, (40,), weight, bias, force_triton=True)
    y.backward(dy.transpose(0, 1))
    _check_against_reference(y, x_t, weight, bias, dy.transpose(0, 1), 1e-5)

    one_row = x.detach()[0, 0]
    assert torch.allclose(ln.layer_norm(one_row, (40,), weight, bias, force_triton=True),
                          F.layer_norm(one_row, (40,), weight, bias), atol=1e-5)

    empty = torch.zeros(0, 3, 40, requires_grad=True)
    w = weight.detach().clone().requires_grad_()
    y = ln.layer_norm(empty, (40,), w, bias, force_triton=True)
    assert y.shape == (0, 3, 40)
    y.sum().backward()
    assert empty.grad.shape == empty.shape and torch.equal(w.grad, torch.zeros_like(w))


def test_bad_arguments_raise_value_error_naming_them():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="eps"):
        ln.layer_norm(x, (32,), eps=-1e-5)
    with pytest.raises(ValueError, match="eps"):
        ln.layer_norm(x, (32,), eps=float("nan"))
    with pytest.raises(ValueError, match="out_dtype"):
        ln.layer_norm(x, (32,), out_dtype=torch.int32)


def test_module_is_a_drop_in_for_nn_layer_norm():
    torch.manual_seed(5)
    reference = torch.nn.LayerNorm(96, eps=1e-6)
    with torch.no_grad():
        reference.weight.normal_()
        reference.bias.normal_()
    module = ln.LayerNorm(96, eps=1e-6, force_triton=INTERPRET)
    assert isinstance(module, torch.nn.LayerNorm)
    assert repr(module) == repr(reference)
    assert module.state_dict().keys() == reference.state_dict().keys()
    module.load_state_dict(reference.state_dict())
    x = torch.randn(2, 5, 7, 96)
    torch.testing.assert_close(module(x), reference(x), atol=1e-5, rtol=1e-5)
    # no affine parameters / no bias, as nn.LayerNorm
    for kwargs in ({"elementwise_affine": False}, {"bias": False}):
        plain, ours = torch.nn.LayerNorm(96, **kwargs), ln.LayerNorm(96, force_triton=INTERPRET, **kwargs)
        assert ours.state_dict().keys() == plain.state_dict().keys()
        torch.testing.assert_close(ours(x), plain(x), atol=1e-5, rtol=1e-5)


def test_torch_path_on_cpu_unless_forced(monkeypatch):
    """Not forced, a CPU tensor never reaches the Triton function (patched here to fail)."""
    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton path was taken")

    monkeypatch.setattr(ln.LayerNormFunction, "apply", no_triton)
    x = torch.randn(2, 5, 7, 64)
    module = ln.LayerNorm(64)
    torch.testing.assert_close(module(x), F.layer_norm(x, (64,), module.weight, module.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(x).dtype == torch.float32  # torch's own autocast rule on the torch path
    # forced, but outside what the kernels cover: also torch
    assert ln.layer_norm(x, (7, 64), force_triton=True).shape == x.shape  # several normalised dims
    assert ln.layer_norm(x.double(), (64,), force_triton=True).dtype == torch.float64
    wide = torch.randn(2, ln.MAX_COLUMNS + 1)
    assert ln.layer_norm(wide, (ln.MAX_COLUMNS + 1,), force_triton=True).shape == wide.shape
    with pytest.raises(AssertionError, match="Triton path was taken"):
        ln.layer_norm(x, (64,), force_triton=True)


def test_torch_path_while_compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not ln.triton_path_applies(torch.randn(4, 64), (64,), force_triton=True)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(128, 56, 56, 64), (128, 28, 28, 128), (128, 14, 14, 256), (128, 7, 7, 512)])
def test_gpu_matches_torch_on_nat_tiny_shapes_under_bf16_autocast(shape):
    """float32 residual input, bf16 autocast, as in a training step: the Triton LayerNorm against
    F.layer_norm followed by the cast its Linear would do."""
    torch.manual_seed(0)
    C = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).requires_grad_()
    weight = (1 + 0.5 * torch.randn(C, device="cuda")).requires_grad_()
    bias = (0.5 * torch.randn(C, device="cuda")).requires_grad_()
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    assert ln.triton_path_applies(x, (C,), weight, bias)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ln.layer_norm(x, (C,), weight, bias)
        y_torch = F.layer_norm(x, (C,), weight, bias).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert (y.float() - y_torch.float()).abs().max() <= 2 ** -7 * y_torch.float().abs().max()
    grads = torch.autograd.grad(y, (x, weight, bias), dy)
    grads_torch = torch.autograd.grad(y_torch, (x, weight, bias), dy)
    for name, grad, grad_torch in zip(("x", "weight", "bias"), grads, grads_torch):
        assert grad.dtype == torch.float32, name
        assert _relative_error(grad, grad_torch.double()) < 1e-4, name
