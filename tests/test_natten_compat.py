"""``ops.natten_compat``: code written for NATTEN 0.14-0.17 (and the >= 0.20 functions) on our operators.

Every function against the dense-mask oracle (forward and gradients, float64 on the CPU), the modules against
NATTEN 0.17's forward written out with the legacy functions and against ``ops``' modules through their state dicts,
and the install mechanism (module and metadata lookups, refusing to shadow a real NATTEN).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest
import torch

import ops
from ops import natten_compat
from tests.oracle import oracle_attention


@pytest.fixture
def natten():
    natten_compat.install()
    import natten as module

    yield module
    natten_compat.uninstall()


def heads_first(t, rank):
    return t.movedim(rank + 1, 1)


def heads_last(t, rank):
    return t.movedim(1, rank + 1)


def problem(spatial, heads=2, dim=4, seed=0, extra=0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, *spatial, heads, dim)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ek = torch.randn((2, extra, heads, dim), generator=g, dtype=torch.float64, requires_grad=True) if extra else None
    ev = torch.randn((2, extra, heads, dim), generator=g, dtype=torch.float64, requires_grad=True) if extra else None
    return q, k, v, ek, ev


def grads(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), [t for t in tensors if t is not None])


def assert_matches_oracle(ours, ref, tensors):
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(grads(ours, tensors), grads(ref, tensors)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


CASES = [  # rank, spatial, kernel, dilation, causal, rpb
    (1, (11,), (5,), (2,), (False,), True),
    (2, (9, 8), (3, 5), (2, 1), (False, False), True),
    (2, (7, 6), (3, 3), (1, 2), (True, False), False),
    (3, (5, 6, 4), (3, 3, 3), (1, 2, 1), (False, False, False), True),
]


@pytest.mark.parametrize("rank, spatial, kernel, dilation, causal, use_rpb", CASES)
def test_unfused_functions_match_the_oracle(natten, rank, spatial, kernel, dilation, causal, use_rpb):
    """na{1,2,3}d_qk -> softmax -> na{1,2,3}d_av, heads-first, the query pre-scaled as NATTEN's modules do."""
    q, k, v, _, _ = problem(spatial)
    rpb = torch.randn(2, *(2 * x - 1 for x in kernel), dtype=torch.float64, requires_grad=True) if use_rpb else None
    qk = getattr(natten.functional, f"na{rank}d_qk")
    av = getattr(natten.functional, f"na{rank}d_av")
    scale = 4 ** -0.5
    attn = qk(heads_first(q, rank) * scale, heads_first(k, rank), kernel, dilation, is_causal=causal, rpb=rpb)
    assert attn.shape == (2, 2, *spatial, torch.Size(kernel).numel())
    out = heads_last(av(attn.softmax(-1), heads_first(v, rank), kernel, dilation, is_causal=causal), rank)
    ref, _ = oracle_attention(q, k, v, spatial, kernel, (1,) * rank, dilation, causal, rpb=rpb)
    assert_matches_oracle(out, ref, [q, k, v, rpb])


def test_additional_keys_and_values_match_the_oracle(natten):
    q, k, v, ek, ev = problem((8, 7), extra=3)
    attn = natten.functional.na2d_qk(heads_first(q, 2) * 0.5, heads_first(k, 2), 3, 2,
                                     additional_keys=ek.transpose(1, 2))
    assert attn.shape[-1] == 9 + 3
    out = natten.functional.na2d_av(attn.softmax(-1), heads_first(v, 2), 3, 2, additional_values=ev.transpose(1, 2))
    ref, _ = oracle_attention(q, k, v, (8, 7), (3, 3), (1, 1), (2, 2), (False, False), extra_k=ek, extra_v=ev)
    assert_matches_oracle(heads_last(out, 2), ref, [q, k, v, ek, ev])


def test_nested_tensors_run_per_image_and_match_the_oracle(natten):
    """NATTEN 0.17's nested inputs to the unfused functions: images of different sizes (each a heads-first batch of
    its own), additional keys nested alike, results nested; every image equals the oracle.  Mixed nested and plain
    arguments, and nested tensors that require grad, are refused naming the argument, as NATTEN refuses them."""
    sizes, tensors = [(6, 5), (7, 8)], []
    for i, spatial in enumerate(sizes):
        q, k, v, ek, ev = problem(spatial, seed=10 + i, extra=2)
        tensors.append([t.detach() for t in (q, k, v, ek, ev)])
    nested = [torch.nested.nested_tensor([heads_first(t[j], 2) if j < 3 else t[j].transpose(1, 2) for t in tensors])
              for j in range(5)]
    q, k, v, ek, ev = nested
    rpb = torch.randn(2, 5, 5, dtype=torch.float64)
    attn = natten.functional.na2d_qk(q * 0.5, k, 3, 1, additional_keys=ek, rpb=rpb)
    weights = torch.nested.nested_tensor([a.softmax(-1) for a in attn.unbind()])
    out = natten.functional.na2d_av(weights, v, 3, 1, additional_values=ev)
    assert out.is_nested and out.size(0) == 2
    for spatial, (q1, k1, v1, ek1, ev1), o in zip(sizes, tensors, out.unbind()):
        ref, _ = oracle_attention(q1, k1, v1, spatial, (3, 3), (1, 1), (1, 1), (False, False), rpb=rpb, scale=0.5,
                                  extra_k=ek1, extra_v=ev1)
        torch.testing.assert_close(heads_last(o, 2), ref, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="^key: query, key must all be nested"):
        natten.functional.na2d_qk(q, heads_first(tensors[0][1], 2), 3, 1)
    with pytest.raises(ValueError, match="^query: autograd is not supported for nested tensors"):
        natten.functional.na2d_qk(q.clone().requires_grad_(True), k, 3, 1)


def test_forward_mode_and_second_derivatives_through_the_functions(natten):
    """jvp through transformers' calls (natten2dqkrpb -> softmax -> natten2dav) equals the oracle's, and so does a
    gradient of a gradient."""
    q, k, v, _, _ = problem((7, 6))
    rpb = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)

    def ours(q, k, v, rpb):
        attn = natten.functional.natten2dqkrpb(heads_first(q, 2) * 0.5, heads_first(k, 2), rpb, 3, 1)
        return heads_last(natten.functional.natten2dav(attn.softmax(-1), heads_first(v, 2), 3, 1), 2)

    def oracle(q, k, v, rpb):
        return oracle_attention(q, k, v, (7, 6), (3, 3), (1, 1), (1, 1), (False, False), rpb=rpb, scale=0.5)[0]

    inputs = (q, k, v, rpb)
    tangents = tuple(torch.randn_like(t) for t in inputs)
    torch.testing.assert_close(torch.func.jvp(ours, inputs, tangents)[1], torch.func.jvp(oracle, inputs, tangents)[1],
                               rtol=1e-9, atol=1e-9)

    def second(f):
        (dq,) = torch.autograd.grad(f(*inputs).square().sum(), q, create_graph=True)
        return torch.autograd.grad(dq.sum(), inputs)

    for a, b in zip(second(ours), second(oracle)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("rank, spatial, kernel, dilation", [(1, (10,), 5, 2), (2, (9, 8), 3, 2), (3, (5, 5, 6), 3, 1)])
def test_names_before_0_17_match_the_oracle(natten, rank, spatial, kernel, dilation):
    """natten{1,2,3}dqkrpb / natten{1,2,3}dav with their argument orders (3-D: depth arguments first)."""
    q, k, v, _, _ = problem(spatial, seed=rank)
    rpb = torch.randn(2, *(2 * kernel - 1,) * rank, dtype=torch.float64, requires_grad=True)
    f = natten.functional
    qf, kf, vf = (heads_first(t, rank) for t in (q, k, v))
    if rank == 3:
        attn = f.natten3dqkrpb(qf * 0.5, kf, rpb, kernel, kernel, dilation, dilation)
        out = f.natten3dav(attn.softmax(-1), vf, kernel, kernel, dilation, dilation)
        assert torch.equal(f.natten3dqk(qf, kf, kernel, kernel, dilation, dilation), f.na3d_qk(qf, kf, kernel, dilation))
    else:
        attn = getattr(f, f"natten{rank}dqkrpb")(qf * 0.5, kf, rpb, kernel, dilation)
        out = getattr(f, f"natten{rank}dav")(attn.softmax(-1), vf, kernel, dilation)
        no_bias = getattr(f, f"natten{rank}dqk")(qf, kf, kernel, dilation)
        assert torch.equal(no_bias, getattr(f, f"na{rank}d_qk")(qf, kf, kernel, dilation))
    ref, _ = oracle_attention(q, k, v, spatial, (kernel,) * rank, (1,) * rank, (dilation,) * rank, (False,) * rank,
                              rpb=rpb, scale=0.5)
    assert_matches_oracle(heads_last(out, rank), ref, [q, k, v, rpb])


def test_fused_0_17_and_current_functions_match_the_oracle(natten):
    q, k, v, ek, ev = problem((9, 9), extra=2)
    rpb = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    # 0.17's fused na2d: heads-last, (kernel_size, dilation, is_causal, rpb, scale, additional keys / values)
    out = natten.functional.na2d(q, k, v, 3, 2, False, rpb, 0.3)
    ref, _ = oracle_attention(q, k, v, (9, 9), (3, 3), (1, 1), (2, 2), (False, False), rpb=rpb, scale=0.3)
    assert_matches_oracle(out, ref, [q, k, v, rpb])
    out = natten.functional.na2d(q, k, v, 3, 2, additional_keys=ek, additional_values=ev)
    ref, _ = oracle_attention(q, k, v, (9, 9), (3, 3), (1, 1), (2, 2), (False, False), extra_k=ek, extra_v=ev)
    assert_matches_oracle(out, ref, [q, k, v, ek, ev])
    # >= 0.20's natten.na2d: (kernel_size, stride, dilation, is_causal, scale, ...), return_lse
    out, lse = natten.na2d(q, k, v, (3, 5), (2, 1), 1, (False, True), 0.7, return_lse=True)
    ref, ref_lse = oracle_attention(q, k, v, (9, 9), (3, 5), (2, 1), (1, 1), (False, True), scale=0.7)
    assert_matches_oracle(out, ref, [q, k, v])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


def test_modules_run_natten_0_17s_forward_and_share_state_dicts_with_ops(natten):
    torch.manual_seed(0)
    legacy = natten.NeighborhoodAttention2D(16, 2, 3, dilation=2, rel_pos_bias=True, qk_scale=0.2).double()
    x = torch.randn(2, 8, 9, 16, dtype=torch.float64)
    # NATTEN 0.17's unfused forward, written out with the legacy functions
    qkv = legacy.qkv(x).reshape(2, 8, 9, 3, 2, 8).permute(3, 0, 4, 1, 2, 5)
    attn = natten.functional.na2d_qk(qkv[0] * 0.2, qkv[1], (3, 3), (2, 2), rpb=legacy.rpb).softmax(-1)
    y = natten.functional.na2d_av(attn, qkv[2], (3, 3), (2, 2)).permute(0, 2, 3, 1, 4).reshape(2, 8, 9, 16)
    torch.testing.assert_close(legacy(x), legacy.proj(y), rtol=1e-10, atol=1e-10)
    assert legacy.rpb.shape == (2, 5, 5) and sorted(legacy.state_dict()) == ["proj.bias", "proj.weight", "qkv.bias",
                                                                               "qkv.weight", "rpb"]
    plain = ops.NeighborhoodAttention2D(16, 2, 3, dilation=2, rel_pos_bias=True, scale=0.2).double()
    plain.load_state_dict(legacy.state_dict())
    torch.testing.assert_close(plain(x), legacy(x), rtol=1e-10, atol=1e-10)
    back = natten.NeighborhoodAttention2D(16, 2, 3, dilation=2, rel_pos_bias=True, qk_scale=0.2).double()
    back.load_state_dict(plain.state_dict())
    torch.testing.assert_close(back(x), legacy(x), rtol=1e-10, atol=1e-10)
    # NATTEN <= 0.15's switch: bias=True meant a relative positional bias
    assert natten.NeighborhoodAttention1D(8, 2, 5, bias=True).rpb.shape == (2, 9)
    assert natten.NeighborhoodAttention3D(8, 2, 3).rpb is None
    with pytest.raises(ValueError, match="use_experimental_ops"):
        natten.NeighborhoodAttention2D(8, 2, 3, use_experimental_ops=True)


def test_switches_are_accepted_and_queries_answer(natten):
    assert not natten.is_fused_na_enabled()
    natten.use_fused_na(True)
    assert natten.is_fused_na_enabled() and natten.context.is_fna_enabled()
    natten.use_fused_na(False)
    natten.use_autotuner(forward_pass=True)
    assert natten.is_autotuner_enabled()
    natten.disable_autotuner()
    assert natten.has_cuda() == torch.cuda.is_available() and isinstance(natten.has_fused_na(), bool)
    with pytest.raises(ValueError, match="pref"):
        natten.set_memory_usage_preference("fast")


def test_install_reports_a_version_and_uninstall_removes_it():
    assert importlib.util.find_spec("natten") is None
    natten_compat.install()
    try:
        assert importlib.util.find_spec("natten") is not None
        assert importlib.metadata.version("natten") == natten_compat.VERSION
        from natten.functional import natten2dav, natten2dqkrpb  # what transformers imports

        assert natten2dqkrpb.__module__ == natten2dav.__module__ == "ops.natten_compat.functional"
    finally:
        natten_compat.uninstall()
    assert "natten" not in sys.modules and importlib.util.find_spec("natten") is None
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("natten")


def test_install_refuses_to_shadow_a_real_natten(tmp_path, monkeypatch):
    (tmp_path / "natten").mkdir()
    (tmp_path / "natten" / "__init__.py").write_text("__version__ = '0.21.0'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="NATTEN is installed"):
        natten_compat.install()
    assert not natten_compat.installed()
    with pytest.warns(RuntimeWarning, match="shadows it"):
        natten_compat.install(replace=True)
    try:
        import natten

        assert natten.__version__ == natten_compat.VERSION
    finally:
        natten_compat.uninstall()


# ---------------------------------------------------------------------------------------------------------------
# a real client: Hugging Face transformers 4.46.3's NAT and DiNAT, unmodified
# ---------------------------------------------------------------------------------------------------------------
# transformers 4.46.3 checks these at import: a private folder holds it with versions it accepts
CLIENT = ["transformers==4.46.3", "huggingface-hub==0.26.5", "tokenizers==0.20.3"]
# what those three import that the test environment may lack (huggingface-hub >= 1.0, which timm brings, dropped
# requests): installed into the same folder, with their own dependencies, only where missing
CLIENT_NEEDS = ["filelock", "fsspec", "numpy", "packaging", "pyyaml", "regex", "requests", "safetensors", "tqdm",
                "typing-extensions"]

CLIENT_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from ops import natten_compat
natten_compat.install()  # before transformers reads natten's availability
import timm, transformers, namodels, ops
from transformers import DinatConfig, DinatForImageClassification, NatConfig, NatForImageClassification
from namodels.models.nat import checkpoint_filter_fn
assert transformers.__version__ == "4.46.3", transformers.__version__
device = torch.device(sys.argv[2])
torch.manual_seed(0)
for config, hf_class, ours in ((NatConfig, NatForImageClassification, "nat_mini"),
                               (DinatConfig, DinatForImageClassification, "dinat_mini")):
    hf = hf_class(config(num_labels=10)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("rpb"):  # transformers starts them at zero: give the bias something to do
                p.normal_(0, 0.5)
    model = timm.create_model(ours, num_classes=10).eval()
    model.load_state_dict(checkpoint_filter_fn(hf.state_dict(), model))
    hf, model = hf.to(device), model.to(device)
    x = torch.randn(2, 3, 224, 224, device=device)
    with torch.no_grad():
        reference = hf(x).logits
        for backend in sys.argv[3:]:
            with ops.use_backend(backend):
                logits = model(x)
            print(ours, backend, ((logits - reference).norm() / reference.norm()).item())
"""


@pytest.fixture(scope="module")
def transformers_4_46(tmp_path_factory):
    import subprocess

    from importlib import metadata

    def missing(name):
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return True
        return False

    folder = tmp_path_factory.mktemp("transformers_4_46_3")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(folder)]
    installs = [pip + ["--no-deps", *CLIENT]]
    needs = [name for name in CLIENT_NEEDS if missing(name)]
    if needs:
        installs.append(pip + needs)
    for command in installs:
        run = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            pytest.skip(f"{CLIENT[0]} could not be installed from the package registry: {run.stderr.strip()[-300:]}")
    return str(folder)


def _run_client(folder: str, device: str, backends: list[str]) -> dict:
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", CLIENT_RUN, folder, device, *backends], capture_output=True,
                         text=True, timeout=900, cwd=root, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = {}
    for line in run.stdout.splitlines():
        model, backend, error = line.split()
        errors[model, backend] = float(error)
    assert set(errors) == {(m, b) for m in ("nat_mini", "dinat_mini") for b in backends}, run.stdout
    return errors


def test_transformers_nat_and_dinat_run_unmodified_on_the_layer(transformers_4_46):
    """transformers' NatForImageClassification and DinatForImageClassification call natten2dqkrpb / natten2dav;
    their logits equal our timm models' with the same weights (transformers' layout through the models'
    checkpoint filter), with the naive and gemm backends on the CPU."""
    errors = _run_client(transformers_4_46, "cpu", ["naive", "gemm"])
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.gpu
def test_transformers_nat_and_dinat_match_the_fused_backend_on_the_gpu(transformers_4_46):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    errors = _run_client(transformers_4_46, "cuda", ["fused"])
    assert max(errors.values()) < 1e-5, errors


def test_modules_and_functions_compile(natten):
    """Under torch.compile the layer's modules are traced like ops' own (one graph with the backend pinned, as
    ``tests/test_compile.py`` compiles the models), with gradients."""
    torch._dynamo.reset()
    module = natten.NeighborhoodAttention2D(8, 2, 3, dilation=2, rel_pos_bias=True)
    module.backend = "fused"  # ops' modules take a backend; the interpreter runs it on the CPU
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x = torch.randn(1, 6, 6, 8, requires_grad=True)
    out = compiled(x)
    torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and module.rpb.grad is not None


def test_0_15_bias_functions_match_0_17s(natten):
    f = natten.functional
    q, k, _, _, _ = problem((6, 7), seed=3)
    qf, kf = heads_first(q, 2), heads_first(k, 2)
    rpb = torch.randn(2, 5, 5, dtype=torch.float64)
    assert torch.equal(f.na2d_qk_with_bias(qf, kf, rpb, 3, 2), f.na2d_qk(qf, kf, 3, 2, rpb=rpb))
    q3, k3, _, _, _ = problem((4, 5, 5), seed=4)
    rpb3 = torch.randn(2, 5, 3, 3, dtype=torch.float64)
    assert torch.equal(f.na3d_qk_with_bias(heads_first(q3, 3), heads_first(k3, 3), rpb3, 3, 2, 1, 2),
                       f.na3d_qk(heads_first(q3, 3), heads_first(k3, 3), (3, 2, 2), (1, 2, 2), rpb=rpb3))
