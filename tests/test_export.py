"""NAT / DiNAT / DiNAT_s through the export routes timm users take: ``torch.export``, ONNX (both of
``torch.onnx.export``'s exporters, through timm's ``onnx_export`` helper, run by onnxruntime) and
``torch.jit.trace``; ``torch.jit.script`` refuses by name.

While a call is traced (``ops.backends.tracing()``) the NA ops record their backend's ``traced_attention``: plain
tensor ops, index tables as constants, no decision on the example's values or batch size.  The automatic backend
(``backend=None``) then takes gemm's (the first in ``ops.PREFERENCE`` that has one), ``backend="naive"`` its own.
Every exported program is compared with the eager model on inputs of the example's and of another batch size.

The default selection exports nat_mini / dinat_mini through torch.export, jit.trace and the TorchScript ONNX exporter,
and single NA calls of both traced forms through both ONNX exporters; the other model, backend and exporter cases, and
every other registered model size through torch.export, are in slow_tests.txt (a whole model takes 30 s or more
through the dynamo exporter).

Tolerance: the exported program's logits against the eager model's, within 1e-4 of the largest logit (both
float32; the traced gemm form sums in another order than eager gemm, onnxruntime differs from torch's kernels).
"""
from __future__ import annotations

import onnxruntime
import pytest
import timm
import torch
from timm.utils.onnx import onnx_export

import namodels  # noqa: F401  (registers the models)
import ops
from namodels.models import block as block_def
from namodels.models import layers, tape
from ops import backends
from ops.gemm import torch_tiled

SIZE = 64  # stages of 16, 8, 4 and 2 tokens: clamped DiNAT dilations and windows padded to 7x7 both run
REL_TOL = 1e-4
DEFAULT = None  # the automatic backend: gemm's traced form on the CPU


def _model(name: str, backend):
    torch.manual_seed(0)
    model = timm.create_model(name, backend=backend).eval()
    with torch.no_grad():  # a random RPB of order 1, so the bias tables matter in the logits
        for block in model.modules():
            if isinstance(block, layers.NeighborhoodAttention2D):
                block.rpb.normal_()
    return model


def _images(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def _eager(model, x):
    with torch.no_grad():
        return model(x)


def _check(got, ref, what: str):
    got = torch.as_tensor(got)
    assert got.shape == ref.shape, what
    err = (got - ref).abs().max().item()
    assert err <= REL_TOL * ref.abs().max().item(), f"{what}: max |diff| {err:.3g}, max |logit| {ref.abs().max():.3g}"


def _no_block_plans(model) -> bool:
    return not any("_eager_plans" in m.__dict__ for m in model.modules())


# --- the routes -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", [DEFAULT, "naive"], ids=["default", "naive"])
@pytest.mark.parametrize("name", ["nat_mini", "dinat_mini", "dinat_s_tiny"])
def test_torch_export_matches_eager(name, backend):
    model = _model(name, backend)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (_images(2),), dynamic_shapes=({0: batch},)).module()
    assert _no_block_plans(model)  # the eager block path was not consulted
    for x in (_images(2, seed=1), _images(3, seed=2)):
        _check(program(x), _eager(model, x), f"torch.export, batch {x.shape[0]}")


EVERY_MODEL = timm.list_models(module=["nat", "dinat_s", "tiny"])  # every registered NAT / DiNAT / DiNAT_s name


@pytest.mark.parametrize("name", [n for n in EVERY_MODEL if n not in ("nat_mini", "dinat_mini", "dinat_s_tiny")])
def test_every_model_exports(name):
    """The sizes not exported above (their other kernel sizes, dilations, depths and widths) through
    ``torch.export``, the route every other one shares the traced forms with."""
    model = _model(name, DEFAULT)
    program = torch.export.export(model, (_images(1),)).module()
    x = _images(1, seed=1)
    _check(program(x), _eager(model, x), f"torch.export of {name}")


@pytest.mark.parametrize("backend", [DEFAULT, "naive"], ids=["default", "naive"])
@pytest.mark.parametrize("name", ["nat_mini", "dinat_mini", "dinat_s_tiny"])
def test_jit_trace_matches_eager(name, backend):
    model = _model(name, backend)
    traced = torch.jit.trace(model, (_images(2),), check_trace=False)  # checked below on other inputs
    assert _no_block_plans(model)
    for x in (_images(2, seed=1), _images(3, seed=2)):
        _check(traced(x), _eager(model, x), f"torch.jit.trace, batch {x.shape[0]}")


def _onnx_logits(path, x) -> torch.Tensor:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


@pytest.mark.parametrize("backend", [DEFAULT, "naive"], ids=["default", "naive"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("name", ["nat_mini", "dinat_mini", "dinat_s_tiny"])
def test_onnx_export_through_timm_matches_eager(tmp_path, name, dynamo, backend):
    """timm's ``onnx_export`` (what its ``onnx_export.py`` runs): the ONNX checker, a dynamic batch axis."""
    model = _model(name, backend)
    path = tmp_path / f"{name}.onnx"
    onnx_export(model, str(path), example_input=_images(2), use_dynamo=dynamo, check=True)
    for x in (_images(2, seed=1), _images(3, seed=2)):
        _check(_onnx_logits(path, x), _eager(model, x), f"onnxruntime, batch {x.shape[0]}")


def test_jit_script_refuses_with_the_routes_that_work():
    model = _model("nat_mini", DEFAULT)
    _eager(model, _images(1))  # (an eager call leaves the per-block plan caches that scripting used to trip on)
    for module in (model, model.levels[0].blocks[0], model.levels[0].blocks[0].attn):
        with pytest.raises(RuntimeError, match=r"torch.jit.script cannot compile .*torch.jit.trace, torch.export"):
            torch.jit.script(module)


# --- what the routes rely on ------------------------------------------------------------------------------------

class _NA(torch.nn.Module):
    """One NA call, ``(out, lse)``; ``rpb`` is set as a parameter where a case has one."""

    def __init__(self, rank, kernel_size, dilation=1, is_causal=False, backend=None):
        super().__init__()
        self.rank, self.backend = rank, backend
        self.args = dict(kernel_size=kernel_size, dilation=dilation, is_causal=is_causal)
        self.rpb = None

    def forward(self, q, k, v):
        return ops.neighborhood_attention(self.rank, q, k, v, **self.args, rpb=self.rpb, backend=self.backend,
                                          return_lse=True)


PROBLEMS = {  # spatial, kernel, dilation, causal, query heads, kv heads, rpb
    "2d-rpb": ((11, 13), 5, 1, False, 2, 2, True),
    "2d-dilated-gqa": ((12, 10), (3, 5), (3, 2), False, 4, 2, True),
    "2d-causal": ((9, 13), (3, 5), (2, 1), (True, False), 2, 1, False),
    "1d": ((20,), 5, 3, False, 2, 2, True),
    "3d-causal": ((5, 6, 7), 3, 1, (True, False, False), 2, 2, False),
}


def _oracle_case(problem, backend, seed=0):
    """The module, its float64 inputs and the oracle's ``(out, lse)``."""
    from tests.oracle import oracle_attention

    spatial, kernel, dilation, causal, hq, hkv, with_rpb = problem
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, *spatial, hq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, *spatial, hkv, 8, generator=g, dtype=torch.float64) for _ in range(2))
    module = _NA(len(spatial), kernel, dilation, causal, backend)
    params = ops.functional.make_params(spatial, kernel, 1, dilation, causal)
    if with_rpb:
        module.rpb = torch.nn.Parameter(torch.randn(hq, *params.rpb_shape, generator=g, dtype=torch.float64))
    ref = oracle_attention(q, k, v, params.spatial, params.kernel_size, params.stride, params.dilation,
                           params.is_causal, rpb=module.rpb)
    return module, (q, k, v), ref


CHUNKED = ["2d-dilated-gqa", "3d-causal"]  # several chunks of tiles (gemm) and of queries (naive) at 100 kB


@pytest.mark.parametrize("backend", [DEFAULT, "naive"], ids=["default", "naive"])
@pytest.mark.parametrize("problem,chunk_bytes", [(PROBLEMS[p], None) for p in PROBLEMS]
                         + [(PROBLEMS[p], 100_000) for p in CHUNKED],
                         ids=list(PROBLEMS) + [f"{p}-chunks" for p in CHUNKED])
def test_traced_forms_match_the_oracle(problem, chunk_bytes, backend, monkeypatch):
    """The traced forms, exported, against the dense-mask oracle in float64: every window rule, GQA, RPB, lse, and
    graphs of several chunks."""
    if chunk_bytes is not None:
        monkeypatch.setattr(torch_tiled, "CHUNK_BYTES", chunk_bytes)
        monkeypatch.setattr("ops.naive.CHUNK_BYTES", chunk_bytes)
    module, inputs, (ref, ref_lse) = _oracle_case(problem, backend)
    out, lse = torch.export.export(module, inputs).module()(*inputs)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", [DEFAULT, "naive"], ids=["default", "naive"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_traced_forms_run_in_onnxruntime(tmp_path, dynamo, backend):
    """One NA call (RPB, GQA, dilation) through each ONNX exporter, with a dynamic batch axis, in onnxruntime."""
    module, inputs, _ = _oracle_case(PROBLEMS["2d-dilated-gqa"], backend)
    module = module.float()
    inputs = tuple(t.float() for t in inputs)
    names = ["q", "k", "v"]
    path = tmp_path / "na.onnx"
    if dynamo:
        torch.onnx.export(module, inputs, path, input_names=names, output_names=["out", "lse"], dynamo=True,
                          dynamic_shapes=({0: "batch"},) * 3)
    else:
        torch.onnx.export(module, inputs, path, input_names=names, output_names=["out", "lse"], dynamo=False,
                          dynamic_axes={n: {0: "batch"} for n in names + ["out", "lse"]})
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (2, 3):
        x = tuple(torch.cat([t] * 2)[:batch] + 0.1 * i for i, t in enumerate(inputs))
        with torch.no_grad():
            ref, ref_lse = module(*x)
        out, lse = session.run(None, {n: t.numpy() for n, t in zip(names, x)})
        torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(lse), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["key", "value"])
def test_traced_gemm_keeps_non_finite_values_in_their_windows(bad):
    """The traced gemm form takes the contained products for any values (no check frozen at export time): a NaN
    reaches exactly the outputs whose windows hold it, as in the eager backends."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 16, 2, 8, generator=g) for _ in range(3))
    module = _NA(2, 5, dilation=2)
    program = torch.export.export(module, (q, k, v))  # finite example: nothing to see at export time
    (k if bad == "key" else v)[0, 3, 4, 1, 2] = float("nan")
    out, _ = program.module()(q, k, v)
    ref, _ = module(q, k, v)  # eager gemm, which checks the values
    want = ~torch.isfinite(ref)
    assert 0 < int(want.any(-1).sum()) < 50
    assert torch.equal(~torch.isfinite(out), want)


def test_attention_weights_api_exports():
    """``na2d_qk`` / ``na2d_av`` (gemm's PN / NN under their autograd functions) through ``torch.export``: no
    finiteness check on the example's values, the tile tables as constants."""

    class Weights(torch.nn.Module):
        def forward(self, q, k, v):
            attn = torch.softmax(ops.na2d_qk(q * 0.3, k, 5, dilation=2), dim=-1)
            return ops.na2d_av(attn, v, 5, dilation=2)

    q, k, v = (torch.randn(2, 12, 12, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    program = torch.export.export(Weights(), (q, k, v)).module()
    torch.testing.assert_close(program(q, k, v), ops.na2d(q, k, v, 5, dilation=2, scale=0.3, backend="naive"))


def test_automatic_choice_while_tracing_takes_a_backend_with_a_traced_form(monkeypatch):
    problem = backends.Problem(params=ops.functional.make_params((16, 16), 7), dtype=torch.float32,
                               device=torch.device("cpu"), head_dim=32, value_dim=32, heads_q=2, heads_kv=2,
                               has_rpb=True, requires_grad=False)
    monkeypatch.setattr(torch.jit, "is_tracing", lambda: True)
    assert backends.tracing()
    assert backends.select_backend(problem, None).name == "gemm"
    gemm = backends.load_backend("gemm")
    monkeypatch.setattr(gemm, "unsupported", lambda problem: "out of memory")  # the next with a traced form
    assert backends.select_backend(problem, None).name == "naive"
    assert backends.select_backend(problem, "naive").name == "naive"  # an explicit choice stands


def test_exporting_a_backend_without_a_traced_form_names_the_fix():
    """A model built with a backend that has no traced form and cannot serve the traced call (here flex: CPU tensors
    that require grad, though the model runs eagerly under ``torch.no_grad``) stops with the backend's reason and
    the backends that record a traced form.  (fused is interpreted on this test's CPU, so it would serve.)"""
    model = timm.create_model("nat_mini", backend="flex", embed_dim=16, depths=(1, 1, 1, 1),
                              num_heads=(1, 2, 2, 4)).eval()  # (a small NAT: the refusal is at its first NA call)
    with pytest.raises(ValueError, match=r"cannot serve this problem: .*to export.*backend=None or 'naive'.*"
                                         r"namodels.set_backend\(model, None\)"):
        torch.jit.trace(model, (_images(1),), check_trace=False)
    namodels.set_backend(model, None)  # the named fix
    x = _images(1)
    _check(torch.jit.trace(model, (x,), check_trace=False)(x), _eager(model, x), "torch.jit.trace after the fix")


def test_the_block_tape_steps_aside_while_tracing(monkeypatch):
    block = layers.NATBlock(32, 2, kernel_size=3, backend="fused").eval()
    x = torch.randn(1, 7, 8, 32)
    monkeypatch.setattr(torch.jit, "is_tracing", lambda: True)
    assert "traced" in tape.route(block, block_def.block_parts(block), x)
    assert "_tape_settings" not in block.__dict__
