"""NAT blocks as one autograd function in eager mode (``namodels.models.eager_block``).

The reference is the block's own modules with the naive NA backend (the dense-mask oracle's twin, see
test_naive.py); the block path runs the fused kernels (Triton's interpreter on CPU)."""
import copy

import pytest
import timm
import torch
import torch.nn.utils.parametrize
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

import namodels  # noqa: F401  (registers the models)
from namodels.models import eager_block, layers
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
    ref.attn.backend = "naive"  # a backend the block path does not take: the modules run
    return ref


@pytest.fixture
def block_calls(monkeypatch):
    """Counts the calls that took the block path."""
    calls = []
    real = eager_block.run

    def counted(block, x, block_plan):
        calls.append(block_plan)
        return real(block, x, block_plan)

    monkeypatch.setattr(eager_block, "run", counted)
    return calls


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


@pytest.mark.parametrize("autocast,tol", [(False, 1e-5), (True, 2e-2)])
def test_training_step_matches_the_modules(block_calls, autocast, tol):
    block = _block()
    x = torch.randn(B, H, W, C)
    got = _step(block, x, autocast)
    assert len(block_calls) == 1 and block_calls[0].grad
    ref = _step(_reference(block), x, autocast)
    assert len(block_calls) == 1
    _assert_close(got, ref, tol)


def test_stochastic_depth_matches_the_modules_with_the_same_draws(block_calls):
    block = _block(drop_path=0.5)
    x = torch.randn(4, H, W, C)
    torch.manual_seed(3)
    got = _step(block, x, autocast=False)
    assert len(block_calls) == 1
    torch.manual_seed(3)  # the block path draws both residuals' per-sample scales first, in one tensor
    masks = torch.empty(2, 4).bernoulli_(0.5).div_(0.5)
    assert 0 < masks[0].count_nonzero() < 4 or 0 < masks[1].count_nonzero() < 4  # the draw keeps and drops samples

    ref = _reference(block)

    class Reference(torch.nn.Module):
        def forward(self, x):
            x = x + masks[0].view(-1, 1, 1, 1) * ref.attn(ref.norm1(x))
            return x + masks[1].view(-1, 1, 1, 1) * ref.mlp(ref.norm2(x))

    reference = Reference()
    reference.named_parameters = ref.named_parameters
    _assert_close(got, _step(reference, x, autocast=False), 1e-5)


def test_inference_matches_the_modules(block_calls):
    block = _block().eval()
    x = torch.randn(B, H, W, C)
    with torch.no_grad():
        got = block(x)
        assert len(block_calls) == 1 and not block_calls[0].grad
        ref = _reference(block)(x)
    assert _rel(got, ref) < 1e-5


def test_frozen_parameters_get_no_gradient(block_calls):
    block = _block()
    for p in (block.attn.rpb, block.norm1.weight, block.mlp.fc2.bias):
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


@pytest.mark.parametrize("make,x_shape", [
    (lambda: _block(layer_scale=1e-5), (B, H, W, C)),
    (lambda: _block(attn_drop=0.1), (B, H, W, C)),
    (lambda: _block(proj_drop=0.1), (B, H, W, C)),
    (lambda: _block(norm_layer=FastLayerNorm), (B, H, W, C)),
    (lambda: _block(backend="naive"), (B, H, W, C)),
    (lambda: _block(dilation_mode="pad"), (B, 5, 5, C)),  # padded to kernel * dilation
    (lambda: _with_hook(_block()), (B, H, W, C)),
    (lambda: _tanh_gelu(_block()), (B, H, W, C)),
], ids=["layer-scale", "attn-drop", "proj-drop", "fast-norm", "naive-backend", "padding", "hook", "tanh-gelu"])
def test_blocks_it_does_not_compute_run_their_modules(make, x_shape):
    assert eager_block.plan(make(), torch.randn(x_shape)) is None


def test_the_switch_and_dropout_outside_training():
    block = _block(attn_drop=0.1, proj_drop=0.1)
    x = torch.randn(B, H, W, C)
    assert eager_block.plan(block.eval(), x) is not None  # inactive dropout does not matter
    eager_block.ENABLED = False
    try:
        assert eager_block.plan(block, x) is None
    finally:
        eager_block.ENABLED = True


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


def test_the_block_path_issues_fewer_ops_than_the_modules(monkeypatch):
    """What makes it host-light: aten calls per training step of a block with stochastic depth, under autocast (the
    Triton kernels are launches, not aten calls)."""
    block = _block(drop_path=0.2, dilation=1)
    x = torch.randn(1, 5, 5, C)
    _ops_per_step(block, x, monkeypatch)  # (the first call of each path also plans its NA launches)
    ops_block = _ops_per_step(block, x, monkeypatch)
    monkeypatch.setattr(eager_block, "ENABLED", False)
    _ops_per_step(block, x, monkeypatch)
    ops_modules = _ops_per_step(block, x, monkeypatch)
    assert ops_block < 0.75 * ops_modules, (ops_block, ops_modules)


def test_a_block_is_one_autograd_node():
    block = _block(drop_path=0.2)
    x = torch.randn(B, H, W, C, requires_grad=True)
    y = block(x)
    inputs = [fn for fn, _ in y.grad_fn.next_functions if fn is not None]
    assert all(type(fn).__name__ == "AccumulateGrad" for fn in inputs)
    assert {id(fn.variable) for fn in inputs} == {id(x)} | {id(p) for p in block.parameters()}


TINY = dict(embed_dim=16, depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4), kernel_size=3, drop_path_rate=0.0,
            num_classes=5)  # stages of 8x8, 4x4 (block path), 2x2 and 1x1 (padded to the window: modules)


def _tiny_pair():
    torch.manual_seed(0)
    model = timm.create_model("nat_mini", backend="fused", **TINY).train()
    reference = copy.deepcopy(model)
    for m in reference.modules():
        if isinstance(m, layers.NeighborhoodAttention2D):
            m.backend = "naive"
    return model, reference


def test_model_training_step_with_gradient_checkpointing_matches_the_modules(block_calls):
    """A whole model (stochastic depth off, so both runs see the same function) with checkpointed stages: the
    recomputed forward takes the block path too."""
    model, reference = _tiny_pair()
    model.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 32, 32)
    results = []
    for m in (model, reference):
        logits = m(x)
        logits.logsumexp(-1).sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert len(block_calls) == 6  # three blocks, each run again by the checkpointed backward
    (logits, grads), (logits_ref, grads_ref) = results
    assert _rel(logits, logits_ref) < 1e-5
    for name in grads_ref:
        assert _rel(grads[name], grads_ref[name]) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["nat_tiny", "dinat_tiny"])
def test_gpu_model_training_step_matches_the_modules(block_calls, name):
    """NAT-/DiNAT-Tiny, batch 8 at 224, bf16 autocast: the block path against the modules on the same fused
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
        eager_block.ENABLED = enabled
        try:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            logits.float().logsumexp(-1).sum().backward()
        finally:
            eager_block.ENABLED = True
        results.append((logits.float(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(block_calls) == sum(len(level.blocks) for level in model.levels)
    (logits, grads), (logits_ref, grads_ref) = results
    assert _rel(logits, logits_ref) < 1e-2
    for n in grads_ref:
        assert _rel(grads[n], grads_ref[n]) < 3e-2, n


def test_a_layer_parametrised_after_the_first_call_turns_the_path_off():
    """Parametrisation swaps a module's class in place: the kept structure check must see it."""
    block = _block()
    x = torch.randn(B, H, W, C)
    assert eager_block.plan(block, x) is not None

    class Doubled(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    torch.nn.utils.parametrize.register_parametrization(block.attn.qkv, "weight", Doubled())
    assert eager_block.plan(block, x) is None


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
    would hand its blocks bfloat16 maps, which the path leaves to the modules)."""
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
    buffer = eager_block._STAGE_CASTS[stage.blocks]
    assert len(buffer.sources) == 16  # both blocks' eight GEMM weights
    first_ptr = buffer.views[0].data_ptr()
    for s in (stage, ref_stage):
        s.blocks[0].attn.qkv.weight.data.mul_(1.5)
        with torch.no_grad():
            s.blocks[1].mlp.fc2.weight.mul_(-1)
    _assert_close(_stage_step(stage, x), _stage_step(ref_stage, x), 2e-2)
    assert eager_block._STAGE_CASTS[stage.blocks] is buffer and buffer.views[0].data_ptr() == first_ptr
    assert len(block_calls) == 4


def test_stage_casts_across_inference_mode_and_training(block_calls):
    """Lightning validates under ``torch.inference_mode`` before and between training steps: a buffer made there
    cannot be written outside it, so each mode keeps casts of its own, and every step matches the modules."""
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
    """The block path trains without host-built TMA descriptors (host time an eager step cannot hide); the modules'
    NA calls on the same problem use them (Triton's interpreter takes them like a Hopper GPU)."""
    block = _block(dilation=1)
    x = torch.randn(B, H, W, C)
    monkeypatch.setattr(fused_decide, "_PLANS", {})
    _step(block, x, autocast=True)
    assert _host_descriptor_plans() == {False}
    monkeypatch.setattr(eager_block, "ENABLED", False)
    _step(block, x, autocast=True)
    assert _host_descriptor_plans() == {False, True}
