"""The NAT block's one definition (``namodels.models.block``) on its two routes: the tape (``namodels.models.tape``,
one autograd node in eager mode) and the primitives' torch forms.

The reference is the block with the naive NA backend, which runs the torch forms (the naive backend is the dense-mask
oracle's twin, see test_naive.py); the tape runs the fused kernels (Triton's interpreter on CPU)."""
import copy
import logging

import pytest
import timm
import torch
import torch.nn.utils.parametrize
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

import namodels  # noqa: F401  (registers the models)
from namodels.models import block as block_def
from namodels.models import layers, stage_casts, tape
from ops.fused import decide as fused_decide
from ops.layer_norm import LayerNorm as FastLayerNorm

B, H, W, C = 2, 7, 8, 32


def _block(drop_path=0.0, **kwargs) -> layers.NATBlock:
    torch.manual_seed(0)
    args = dict(dim=C, num_heads=2, kernel_size=3, dilation=2, mlp_ratio=2.0, drop_path=drop_path, backend="fused")
    block = layers.NATBlock(**{**args, **kwargs}).train()
    with torch.no_grad():  # away from the init's ones and zeros, so every parameter's gradient path shows
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return block


def _reference(block: layers.NATBlock) -> layers.NATBlock:
    ref = copy.deepcopy(block)
    ref.attn.backend = "naive"  # a backend the tape does not take: the torch forms run
    return ref


@pytest.fixture
def block_calls(monkeypatch):
    """The plans of the calls that took the tape."""
    calls = []
    real = tape.route

    def counted(block, parts, x):
        settings = real(block, parts, x)
        if not isinstance(settings, str):
            calls.append(settings)
        return settings

    monkeypatch.setattr(tape, "route", counted)
    return calls


def _route(block, x):
    return tape.route(block, block_def.block_parts(block), x)


def _step(block, x, autocast: bool):
    """Output, input gradient and parameter gradients of a weighted sum of the output."""
    x = x.detach().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = block(x)
    weights = torch.linspace(-1, 1, y.numel(), device=x.device).view(y.shape)
    (y.float() * weights).sum().backward()
    grads = {name: p.grad for name, p in block.named_parameters()}
    return y.detach().float(), x.grad, grads


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _assert_close(got, ref, tol):
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = got, ref
    assert _rel(y, y_ref) < tol
    assert _rel(dx, dx_ref) < tol
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert grads[name] is not None, name
        assert _rel(grads[name], grads_ref[name]) < tol, name


# blocks the tape computes: block arguments, input shape
VARIANTS = {
    "dilated": (dict(), (B, H, W, C)),  # kernel 3, dilation 2 (DiNAT's dilated blocks)
    "layer-scale": (dict(layer_scale=0.5), (B, H, W, C)),
    "fast-norm": (dict(norm_layer=FastLayerNorm), (B, H, W, C)),
    "padded-kernel": (dict(kernel_size=7, dilation=1, layer_scale=0.5), (B, 5, 6, C)),  # padded to 7x7
    "padded-dilation": (dict(dilation_mode="pad"), (B, 5, 5, C)),  # padded to kernel * dilation
}


@pytest.mark.parametrize("variant", VARIANTS)
# (under bf16 autocast both sides are within about 2% of a float64 run, in different directions)
@pytest.mark.parametrize("autocast,tol", [(False, 1e-5), (True, 3e-2)], ids=["float32", "autocast"])
def test_training_step_matches_the_reference(block_calls, variant, autocast, tol):
    kwargs, shape = VARIANTS[variant]
    block = _block(**kwargs)
    x = torch.randn(shape)
    got = _step(block, x, autocast)
    assert block.path == "tape" and block.path_reason is None
    assert len(block_calls) == 1 and block_calls[0].grad
    ref = _step(_reference(block), x, autocast)
    assert len(block_calls) == 1
    _assert_close(got, ref, tol)


@pytest.mark.parametrize("layer_scale", [None, 0.5], ids=["plain", "layer-scale"])
def test_stochastic_depth_matches_the_reference_with_the_same_draws(block_calls, layer_scale):
    block = _block(drop_path=0.5, layer_scale=layer_scale)
    x = torch.randn(4, H, W, C)
    torch.manual_seed(3)
    got = _step(block, x, autocast=False)
    assert len(block_calls) == 1
    torch.manual_seed(3)  # the block draws both residuals' per-sample scales first, in one tensor
    masks = torch.empty(2, 4).bernoulli_(0.5).div_(0.5)
    assert 0 < masks[0].count_nonzero() < 4 or 0 < masks[1].count_nonzero() < 4  # the draw keeps and drops samples

    ref = _reference(block)

    gammas = (ref.gamma1, ref.gamma2) if layer_scale else (1.0, 1.0)

    class Reference(torch.nn.Module):
        def forward(self, x):
            x = x + masks[0].view(-1, 1, 1, 1) * gammas[0] * ref.attn(ref.norm1(x))
            return x + masks[1].view(-1, 1, 1, 1) * gammas[1] * ref.mlp(ref.norm2(x))

    reference = Reference()
    reference.named_parameters = ref.named_parameters
    _assert_close(got, _step(reference, x, autocast=False), 1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_inference_matches_the_reference(block_calls, variant, monkeypatch):
    """Inference (nothing needs a gradient) runs the tape's forward with no tape and nothing saved."""
    kwargs, shape = VARIANTS[variant]
    block = _block(**kwargs).eval()
    x = torch.randn(shape)
    monkeypatch.setattr(tape._BlockFunction, "apply", None)  # (no autograd node is built)
    with torch.no_grad():
        got = block(x)
        assert len(block_calls) == 1 and not block_calls[0].grad
        ref = _reference(block)(x)
    assert _rel(got, ref) < 1e-5


def test_frozen_parameters_get_no_gradient(block_calls):
    block = _block(layer_scale=0.5)
    for p in (block.attn.rpb, block.norm1.weight, block.mlp.fc2.bias, block.gamma1):
        p.requires_grad_(False)
    x = torch.randn(B, H, W, C)
    y, dx, grads = _step(block, x, autocast=False)
    assert len(block_calls) == 1
    _, dx_ref, grads_ref = _step(_reference(block), x, autocast=False)
    assert _rel(dx, dx_ref) < 1e-5
    for name, p in block.named_parameters():
        if p.requires_grad:
            assert _rel(grads[name], grads_ref[name]) < 1e-5, name
        else:
            assert grads[name] is None, name


def _with_hook(block):
    block.mlp.fc1.register_forward_hook(lambda *args: None)
    return block


def _tanh_gelu(block):
    block.mlp.act = torch.nn.GELU(approximate="tanh")
    return block


@pytest.mark.parametrize("make,reason", [
    (lambda: _block(attn_drop=0.1), "attention dropout"),
    (lambda: _block(proj_drop=0.1), "proj_drop active"),
    (lambda: _block(backend="naive"), "'naive' NA backend"),
    (lambda: _with_hook(_block()), "hooks on fc1"),
    (lambda: _tanh_gelu(_block()), "GELU"),
], ids=["attn-drop", "proj-drop", "naive-backend", "hook", "tanh-gelu"])
def test_blocks_the_tape_does_not_compute_run_the_torch_forms(make, reason):
    assert reason in _route(make(), torch.randn(B, H, W, C))


@pytest.mark.parametrize("make,x_shape", [
    (lambda: _block(layer_scale=1e-5), (B, H, W, C)),
    (lambda: _block(norm_layer=FastLayerNorm), (B, H, W, C)),
    (lambda: _block(dilation_mode="pad"), (B, 5, 5, C)),  # padded to kernel * dilation
    (lambda: _block(kernel_size=7, dilation=1), (B, 5, 6, C)),  # padded to the kernel
], ids=["layer-scale", "fast-norm", "padded-dilation", "padded-kernel"])
def test_blocks_the_hand_written_path_refused_take_the_tape(make, x_shape):
    assert not isinstance(_route(make(), torch.randn(x_shape)), str)


def test_the_switch_and_dropout_outside_training():
    block = _block(attn_drop=0.1, proj_drop=0.1)
    x = torch.randn(B, H, W, C)
    assert not isinstance(_route(block.eval(), x), str)  # inactive dropout does not matter
    tape.ENABLED = False
    try:
        assert "off" in _route(block, x)
    finally:
        tape.ENABLED = True


class _OpCounter(TorchDispatchMode):
    """Counts aten calls, except those Triton's interpreter makes while it runs a kernel."""

    NO_KERNEL = {"empty", "empty_like", "new_empty", "detach", "t", "expand"}

    def __init__(self):
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # views and allocations launch no kernel
        self.count += not (self.paused or func.is_view or func.__name__.split(".")[0] in self.NO_KERNEL)
        return func(*args, **(kwargs or {}))

    def uncounted(self, fn):
        def call(*args, **kwargs):
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return call


def _ops_per_step(block, x, monkeypatch) -> int:
    x = x.detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    counter = _OpCounter()
    with monkeypatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", counter.uncounted(InterpretedFunction.run))
        with counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = block(x)
            y.sum().backward()
    return counter.count


def test_the_tape_issues_fewer_ops_than_the_torch_forms(monkeypatch):
    """What makes it host-light: aten calls per training step of a block with stochastic depth, under autocast (the
    Triton kernels are launches, not aten calls), on the tape and on the torch forms."""
    block = _block(drop_path=0.2, dilation=1)
    x = torch.randn(1, 5, 5, C)
    _ops_per_step(block, x, monkeypatch)  # (the first call of each path also plans its NA launches)
    ops_block = _ops_per_step(block, x, monkeypatch)
    monkeypatch.setattr(tape, "ENABLED", False)
    _ops_per_step(block, x, monkeypatch)
    ops_torch = _ops_per_step(block, x, monkeypatch)
    assert ops_block < 0.75 * ops_torch, (ops_block, ops_torch)


def test_a_block_is_one_autograd_node():
    block = _block(drop_path=0.2)
    x = torch.randn(B, H, W, C, requires_grad=True)
    y = block(x)
    inputs = [fn for fn, _ in y.grad_fn.next_functions if fn is not None]
    assert all(type(fn).__name__ == "AccumulateGrad" for fn in inputs)
    assert {id(fn.variable) for fn in inputs} == {id(x)} | {id(p) for p in block.parameters()}


TINY = dict(embed_dim=16, depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4), kernel_size=3, drop_path_rate=0.0,
            num_classes=5)  # stages of 8x8, 4x4, 2x2 and 1x1 (the last two padded to the window)


def _tiny_pair(name="nat_mini", **kwargs):
    torch.manual_seed(0)
    model = timm.create_model(name, backend="fused", **{**TINY, **kwargs}).train()
    reference = copy.deepcopy(model)
    for m in reference.modules():
        if isinstance(m, layers.NeighborhoodAttention2D):
            m.backend = "naive"
    return model, reference


def _logits_and_grads(model, x):
    """A model's logits for ``x`` and its parameters' gradients of their summed logsumexp."""
    logits = model(x)
    logits.logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_model_training_step_with_gradient_checkpointing_matches_the_reference(block_calls):
    """A whole model (stochastic depth off, so both runs see the same function) with checkpointed stages: the
    recomputed forward takes the tape too."""
    model, reference = _tiny_pair()
    model.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 32, 32)
    results = [_logits_and_grads(m, x) for m in (model, reference)]
    assert len(block_calls) == 10  # five blocks, each run again by the checkpointed backward
    (logits, grads), (logits_ref, grads_ref) = results
    assert _rel(logits, logits_ref) < 1e-5
    for name in grads_ref:
        assert _rel(grads[name], grads_ref[name]) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["nat_tiny", "dinat_tiny"])
def test_gpu_model_training_step_matches_the_reference(block_calls, name):
    """NAT-/DiNAT-Tiny, batch 8 at 224, bf16 autocast: the tape against the torch forms on the same fused
    kernels (each checked against the oracle in test_fused.py), after a validation-style call under
    ``torch.inference_mode`` (whose cast buffers the training step must not write)."""
    torch.manual_seed(0)
    model = timm.create_model(name, backend="fused", drop_path_rate=0.0).cuda().train()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(x)
    block_calls.clear()
    results = []
    for enabled in (True, False):
        tape.ENABLED = enabled
        try:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            logits.float().logsumexp(-1).sum().backward()
        finally:
            tape.ENABLED = True
        results.append((logits.float(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(block_calls) == sum(len(level.blocks) for level in model.levels)
    (logits, grads), (logits_ref, grads_ref) = results
    assert _rel(logits, logits_ref) < 1e-2
    for n in grads_ref:
        assert _rel(grads[n], grads_ref[n]) < 3e-2, n


def test_a_layer_parametrised_after_the_first_call_turns_the_tape_off():
    """Parametrisation swaps a module's class in place: the kept structure check must see it."""
    block = _block()
    x = torch.randn(B, H, W, C)
    assert not isinstance(_route(block, x), str)

    class Doubled(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    torch.nn.utils.parametrize.register_parametrization(block.attn.qkv, "weight", Doubled())
    assert "qkv is a ParametrizedLinear" in _route(block, x)
    ref = _reference(block)
    with torch.no_grad():
        assert _rel(block(x), ref(x)) < 1e-5 and block.path == "ops"  # the parametrisation applies


def test_inference_follows_weights_changed_in_place_and_through_data(block_calls):
    """Nothing is kept from one inference call to the next: the casts and bias tiles follow a weight changed in place
    (optimizer step, ``load_state_dict``) and one changed through ``.data`` (an EMA teacher updated that way), which
    leaves the version counter alone."""
    block = _block().eval()
    x = torch.randn(B, H, W, C)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = block(x)
        block.mlp.fc2.weight.mul_(2)
        block.attn.qkv.bias.add_(0.5)
        second = block(x)
        ref_second = _reference(block)(x)
        block.mlp.fc1.weight.data.mul_(-1)
        block.attn.rpb.data.add_(1.0)
        third = block(x)
        ref_third = _reference(block)(x)
    assert len(block_calls) == 3
    assert _rel(second, first) > 1e-2 and _rel(third, second) > 1e-2
    assert _rel(second, ref_second) < 2e-2
    assert _rel(third, ref_third) < 2e-2


def _stage_step(stage, x):
    """Output and gradients of a bf16 autocast step of a stage (a float32 input: under CPU autocast a whole model
    would hand its blocks bfloat16 maps, which the tape leaves to the torch forms)."""
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = stage(x)
    y.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    return y.detach().float(), x.grad, grads


def test_stage_casts_are_one_buffer_refilled_in_place_between_steps(block_calls):
    """A stage's blocks read their weight casts from one buffer, which the next step refills in place (same memory)
    with the weights as they are then, ``.data`` writes included."""
    model, reference = _tiny_pair()
    stage, ref_stage = model.levels[1], reference.levels[1]
    x = torch.randn(2, 4, 4, 32)
    _assert_close(_stage_step(stage, x), _stage_step(ref_stage, x), 2e-2)
    buffer = stage_casts.STAGE_BUFFERS[stage.blocks]
    assert len(buffer.sources) == 16  # both blocks' eight GEMM weights
    first_ptr = buffer.views[0].data_ptr()
    for s in (stage, ref_stage):
        s.blocks[0].attn.qkv.weight.data.mul_(1.5)
        with torch.no_grad():
            s.blocks[1].mlp.fc2.weight.mul_(-1)
    _assert_close(_stage_step(stage, x), _stage_step(ref_stage, x), 2e-2)
    assert stage_casts.STAGE_BUFFERS[stage.blocks] is buffer and buffer.views[0].data_ptr() == first_ptr
    assert len(block_calls) == 4


def test_stage_casts_across_inference_mode_and_training(block_calls):
    """Lightning validates under ``torch.inference_mode`` before and between training steps: a buffer made there
    cannot be written outside it, so each mode keeps casts of its own, and every step matches the reference."""
    model, reference = _tiny_pair()
    stage, ref_stage = model.levels[1], reference.levels[1]
    x = torch.randn(2, 4, 4, 32)

    def evaluate(s):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return s(x).float()

    assert _rel(evaluate(stage), evaluate(ref_stage)) < 2e-2
    _assert_close(_stage_step(stage, x), _stage_step(ref_stage, x), 2e-2)
    assert _rel(evaluate(stage), evaluate(ref_stage)) < 2e-2
    _assert_close(_stage_step(stage, x), _stage_step(ref_stage, x), 2e-2)
    assert len(block_calls) == 8


def test_two_forwards_before_one_backward_keep_their_own_casts(block_calls):
    """A graph that can still run its backward holds the stage's buffer: the second forward (with changed weights)
    casts into a new one, and each backward reads the casts of its own forward."""
    model, reference = _tiny_pair()
    x1, x2 = torch.randn(2, 4, 4, 32), torch.randn(2, 4, 4, 32)
    results = []
    for stage in (model.levels[1], reference.levels[1]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            first = stage(x1)
        stage.blocks[0].mlp.fc1.weight.data.mul_(-2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            second = stage(x2)
        (first.float().logsumexp(-1).sum() + second.float().square().mean()).backward()
        y = torch.cat([first, second]).detach().float()
        results.append((y, y, {n: p.grad for n, p in stage.named_parameters()}))
    _assert_close(*results, 2e-2)
    assert len(block_calls) == 4


def _host_descriptor_plans() -> set:
    forward = {plan.host_desc_layouts is not None for plan in fused_decide.plans("forward")}
    backward = {chunks[0][0].meta["HOST_DESC"] for plan in fused_decide.plans("backward")
                for chunks in (plan.dq_launches, plan.dkdv_launches)}
    return forward | backward


def test_training_launches_build_no_host_descriptors(monkeypatch):
    """The tape trains without host-built TMA descriptors (host time an eager step cannot hide); the torch forms'
    NA calls on the same problem use them (Triton's interpreter takes them like a Hopper GPU)."""
    block = _block(dilation=1)
    x = torch.randn(B, H, W, C)
    monkeypatch.setattr(fused_decide, "_PLANS", {})
    _step(block, x, autocast=True)
    assert _host_descriptor_plans() == {False}
    monkeypatch.setattr(tape, "ENABLED", False)
    _step(block, x, autocast=True)
    assert _host_descriptor_plans() == {False, True}


def test_the_route_is_visible_and_each_reason_logged_once(caplog):
    block = _block()
    x = torch.randn(B, H, W, C)
    with caplog.at_level(logging.DEBUG, logger="namodels.models.tape"):
        block(x)
        assert (block.path, block.path_reason) == ("tape", None)
        handle = block.mlp.fc1.register_forward_hook(lambda *args: None)
        block(x)
        block(x)
        assert (block.path, block.path_reason) == ("ops", "hooks on fc1")
        handle.remove()
        block(x)
        assert (block.path, block.path_reason) == ("tape", None)
    logged = [r.getMessage() for r in caplog.records if r.name == "namodels.models.tape"]
    assert logged == ["NATBlock runs the torch forms of its primitives: hooks on fc1"]


def test_the_torch_forms_call_the_modules_and_match_the_reference(block_calls):
    """Hooks on a layer or on the attention / MLP modules fire (the torch forms call them), and the numbers are the
    reference's."""
    block = _block(layer_scale=0.5, drop_path=0.0)
    seen = []
    for name in ("attn", "mlp", "attn.qkv", "mlp.fc2"):
        block.get_submodule(name).register_forward_hook(lambda m, args, out, name=name: seen.append(name))
    x = torch.randn(B, H, W, C)
    got = _step(block, x, autocast=False)
    assert block.path == "ops" and not block_calls
    assert sorted(seen) == ["attn", "attn.qkv", "mlp", "mlp.fc2"]
    _assert_close(got, _step(_reference(block), x, autocast=False), 1e-5)


def test_attention_dropout_takes_the_unfused_route_and_matches_the_reference():
    """Attention dropout while training needs the attention weights: the torch forms' unfused route, whatever the
    backend (the same draws as the reference's under the same seed); outside training the tape runs."""
    block = _block(attn_drop=0.3, layer_scale=0.5)
    x = torch.randn(B, H, W, C)
    torch.manual_seed(5)
    got = _step(block, x, autocast=False)
    assert block.path == "ops" and "attention dropout" in block.path_reason
    torch.manual_seed(5)
    _assert_close(got, _step(_reference(block), x, autocast=False), 1e-5)
    torch.manual_seed(5)
    again = _step(block, x, autocast=False)[0]
    assert torch.equal(again, got[0])
    torch.manual_seed(6)
    assert not torch.equal(_step(block, x, autocast=False)[0], got[0])  # the dropout draws do act
    with torch.no_grad():
        y = block.eval()(x)
        assert block.path == "tape"
        assert _rel(y, _reference(block)(x)) < 1e-5


@pytest.mark.parametrize("name,kwargs", [
    ("nat_mini", dict(layer_scale=0.5, fast_norm=True)),
    ("dinat_mini", dict(layer_scale=0.5, dilations=((2,), (1, 2), (1,), (1,)))),
], ids=["nat-layer-scale-fast-norm", "dinat-layer-scale"])
def test_model_training_step_matches_the_reference(block_calls, name, kwargs):
    """Whole models with layer scale, fast_norm's LayerNorm, dilated and padded stages: every block takes the
    tape."""
    model, reference = _tiny_pair(name, **kwargs)
    x = torch.randn(2, 3, 32, 32)
    results = [_logits_and_grads(m, x) for m in (model, reference)]
    assert len(block_calls) == 5
    (logits, grads), (logits_ref, grads_ref) = results
    assert _rel(logits, logits_ref) < 1e-5
    for n in grads_ref:
        assert _rel(grads[n], grads_ref[n]) < 1e-4, n


class _HalfBranch(torch.nn.Module):
    """A stochastic depth of the user's own: scales each residual branch (here by a fixed half)."""

    def forward(self, x):
        return 0.5 * x


def test_a_drop_path_of_another_type_scales_each_branch_through_its_module():
    block = _block(layer_scale=0.5)
    block.drop_path = _HalfBranch()
    x = torch.randn(B, H, W, C)
    ref = _reference(block)  # naive attention, the same parts
    with torch.no_grad():
        n = ref.norm1(x)
        x1 = x + 0.5 * (ref.gamma1 * ref.attn(n))
        want = x1 + 0.5 * (ref.gamma2 * ref.mlp(ref.norm2(x1)))
        got = block(x)
    assert block.path == "ops" and "drop_path" in block.path_reason
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_covered_window_leaves_the_tape_when_dense_windows_are_on(monkeypatch):
    """With ``ops.fused.DENSE_WINDOW`` on, a block whose window covers its map (7x7 map, 7x7 window) runs its torch
    forms, whose attention call takes the dense route, and says why; a block whose window does not cover stays on
    the tape.  The output equals the tape's."""
    import ops.fused as fused

    block = _block(kernel_size=7, dilation=1)
    x = torch.randn(B, 7, 7, C)
    with torch.no_grad():
        taped = block(x)
    assert block.path == "tape"
    monkeypatch.setattr(fused, "DENSE_WINDOW", True)
    block.__dict__.pop("_tape_settings", None)
    with torch.no_grad():
        dense = block(x)
    assert (block.path, block.path_reason) == (
        "ops", "the window covers the map and ops.fused.DENSE_WINDOW is on (dense attention per dilation group)")
    torch.testing.assert_close(dense, taped, rtol=2e-4, atol=2e-4)
    small = _block(kernel_size=3, dilation=1)
    with torch.no_grad():
        small(x)
    assert small.path == "tape"
