"""torch.compile over the project's models with the fused backend: one graph, no recompiles (NAT / DiNAT,
DiNAT_s, the causal video model).

The checks run in a fresh interpreter, so that the model is compiled before any eager NA call, as a
user's training script does (in this process other tests have already run every backend eagerly).
Dynamo traces the fused op through its fake implementation; the kernels run in Triton's interpreter.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Builds a small model, counts dynamo's graphs and breaks before any eager call, then runs ``steps`` compiled
# training steps (forward + backward, aot_eager) with recompiles turned into errors.
SCRIPT = textwrap.dedent("""
    import json, sys, torch, timm
    import namodels  # noqa: F401
    name, kwargs, shape, steps = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    model = timm.create_model(name, backend="fused", **kwargs).train()
    x = torch.randn(*shape)
    explained = torch._dynamo.explain(model)(x)
    reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch._dynamo.config.error_on_recompile = True
    for step in range(steps):
        compiled(x).float().square().mean().backward()
    grads = steps > 0 and all(p.grad is not None and torch.isfinite(p.grad).all()
                              for p in model.parameters() if p.requires_grad)
    print(json.dumps(dict(graphs=explained.graph_count, breaks=explained.graph_break_count, reasons=reasons,
                          grads=bool(grads))))
""")

TINY = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4))


def _compile_report(name: str, kwargs: dict, shape, steps: int = 2) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, name, json.dumps(kwargs), json.dumps(shape), str(steps)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# NAT is DiNAT with every dilation 1 (one model class): dinat_mini's blocks run both
@pytest.mark.parametrize("name,kwargs,shape", [
    ("dinat_mini", dict(TINY, dilations=((1,), (1,), (1, 2), (1,))), [2, 3, 32, 32]),
    ("dinat_s_tiny", dict(TINY, dilations=((1,), (1,), (1, 2), (1,))), [1, 3, 64, 64]),
    ("video_nat_nano", dict(img_size=32, depth=2), [1, 4, 1, 32, 32]),  # both dilations (they alternate)
])
def test_fused_models_compile_to_one_graph_without_recompiles(name, kwargs, shape):
    report = _compile_report(name, kwargs, shape)
    assert report["breaks"] == 0, report["reasons"]
    assert report["graphs"] == 1
    assert report["grads"]


def test_nat_traces_to_one_graph_before_any_eager_call():
    """The default selection's share of the test above (whose runs are ``slow``): NAT / DiNAT blocks traced by dynamo
    in a fresh process, one graph and no break, without the compiled training steps."""
    report = _compile_report("dinat_mini", dict(TINY, dilations=((1,), (1,), (1, 2), (1,))), [1, 3, 32, 32], steps=0)
    assert report["breaks"] == 0, report["reasons"]
    assert report["graphs"] == 1


@pytest.mark.parametrize("packed_drops_lse", [True, False])
def test_compiled_backward_makes_no_gradient_for_an_unused_lse(packed_drops_lse, monkeypatch):
    """The fused op's lse output is differentiable, but a caller that drops it (every model block) must not get a
    zero-filled lse gradient in the compiled backward graph (a kernel and a read per call); a caller that uses it
    gets its gradient.  One graph calls the packed and the unpacked op, one of them dropping lse and the other
    using it; gradients are checked against the dense-mask oracle."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import torch
    from torch._dynamo.backends.common import aot_autograd

    import ops
    from tests.oracle import oracle_attention

    backward_ops = []

    def bw_compiler(gm, example_inputs):
        backward_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, 6, 6, 3, 2, 8, generator=gen, requires_grad=True)
    rpb = torch.randn(2, 5, 5, generator=gen, requires_grad=True)

    def fused(qkv, rpb, packed, return_lse):
        if packed:
            return ops.neighborhood_attention_qkvpacked(2, qkv, 3, rpb=rpb, return_lse=return_lse, backend="fused")
        return ops.neighborhood_attention(2, *qkv.unbind(-3), 3, rpb=rpb, return_lse=return_lse, backend="fused")

    def oracle(qkv, rpb, packed, return_lse):
        out, lse = oracle_attention(*qkv.unbind(-3), (6, 6), (3, 3), (1, 1), (1, 1), (False, False), rpb=rpb)
        return (out, lse) if return_lse else out

    def loss(qkv, rpb, attend):
        dropped = attend(qkv, rpb, packed_drops_lse, False)
        out, lse = attend(qkv * 0.5, rpb, not packed_drops_lse, True)
        return dropped.square().sum() + out.square().sum() + lse.sum()

    compiled = torch.compile(lambda qkv, rpb: loss(qkv, rpb, fused), fullgraph=True,
                             backend=aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=bw_compiler))
    got = torch.autograd.grad(compiled(qkv, rpb), (qkv, rpb))
    want = torch.autograd.grad(loss(qkv, rpb, oracle), (qkv, rpb))
    assert {op for op in backward_ops if "fused_na" in op} == {"namodels.fused_na_packed_backward.default",
                                                               "namodels.fused_na_backward.default"}
    zero_fills = [op for op in backward_ops if "zeros" in op or "full" in op]
    assert zero_fills == [], zero_fills
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_compile_is_not_tracing_where_dynamo_folds_is_exporting(monkeypatch):
    """Some torch releases fold ``torch.compiler.is_exporting()`` to True in every dynamo trace, plain
    ``torch.compile`` included.  ``ops.backends.tracing()`` must still answer False there (else automatic selection
    skips the fused kernels and compiled models take the traced routes), and True under ``torch.export``."""
    import torch

    from ops.backends import tracing

    def folded() -> bool:  # the folding releases' answer: True whenever dynamo traces
        return torch.compiler.is_dynamo_compiling() or torch.compiler._is_exporting_flag

    monkeypatch.setattr(torch.compiler, "is_exporting", folded)

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + (1.0 if tracing() else 0.0)

    x = torch.zeros(1)
    torch._dynamo.reset()
    assert torch.compile(Probe(), backend="eager", fullgraph=True)(x).item() == 0.0
    assert torch.export.export(Probe(), (x,), strict=False).module()(x).item() == 1.0
    assert torch.export.export(Probe(), (x,), strict=True).module()(x).item() == 1.0
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------
# CPU backends: every model one graph before any eager call (naive and gemm as registered ops, flex traced inline)
# ---------------------------------------------------------------------------------------------------------------
CPU_SCRIPT = textwrap.dedent("""
    import contextlib, json, sys, torch, timm
    import namodels  # noqa: F401
    cases, steps = json.loads(sys.argv[1]), int(sys.argv[2])
    reports = []
    for name, kwargs, shape, backend in cases:
        torch._dynamo.reset()
        torch.manual_seed(0)
        options = {} if backend == "default" else {"backend": backend}
        # CPU flex has no backward: inference only; no stochastic depth, so that compiled and eager gradients compare
        model = timm.create_model(name, drop_path_rate=0.0, **options, **kwargs).train(backend != "flex")
        x = torch.randn(*shape)
        grad = torch.no_grad() if backend == "flex" else contextlib.nullcontext()
        with grad:
            explained = torch._dynamo.explain(model)(x)
        report = dict(case=f"{name}/{backend}", graphs=explained.graph_count, breaks=explained.graph_break_count,
                      reasons=[str(r.reason).splitlines()[0] for r in explained.break_reasons])
        if steps and backend != "flex":
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
            torch._dynamo.config.error_on_recompile = True
            for _ in range(steps):
                model.zero_grad()
                compiled(x).float().square().mean().backward()
            compiled_grads = [p.grad.clone() for p in model.parameters()]
            torch._dynamo.config.error_on_recompile = False
            model.zero_grad()
            model(x).float().square().mean().backward()
            report["grads_match_eager"] = all(torch.allclose(a, p.grad, rtol=1e-4, atol=1e-5)
                                              for a, p in zip(compiled_grads, model.parameters()))
        reports.append(report)
    print(json.dumps(reports))
""")

DINAT = ("dinat_mini", dict(TINY, dilations=((1,), (1,), (1, 2), (1,))), [1, 3, 32, 32])
NAT = ("nat_mini", TINY, [1, 3, 32, 32])
DINAT_S = ("dinat_s_tiny", dict(TINY, dilations=((1,), (1,), (1, 2), (1,))), [1, 3, 64, 64])
VIDEO = ("video_nat_nano", dict(img_size=32, depth=2), [1, 4, 1, 32, 32])
CPU_BACKENDS = ("default", "naive", "gemm", "flex")


def _cpu_reports(cases, steps: int) -> list:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # the CPU backends as a user without a GPU has them
    proc = subprocess.run([sys.executable, "-c", CPU_SCRIPT, json.dumps(cases), str(steps)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_one_graph(reports):
    for report in reports:
        assert (report["graphs"], report["breaks"]) == (1, 0), report
        assert report.get("grads_match_eager", True), report


def test_cpu_backends_compile_dinat_to_one_graph():
    """DiNAT (NAT's blocks included) with each CPU backend, traced before any eager call: one graph; with naive and
    gemm, compiled training steps (aot_eager) give the eager gradients."""
    _assert_one_graph(_cpu_reports([[*DINAT, b] for b in CPU_BACKENDS], steps=1))


@pytest.mark.slow
def test_cpu_backends_compile_every_model_to_one_graph():
    _assert_one_graph(_cpu_reports([[*m, b] for m in (NAT, DINAT, DINAT_S, VIDEO) for b in CPU_BACKENDS], steps=1))
