"""Shared check of a backend against the dense-mask oracle (forward, lse and all gradients)."""
from __future__ import annotations

import torch

import ops
from tests.oracle import oracle_attention

# Max abs error allowed against the float64 oracle, per input dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def check_backend(problem, backend: str, dtype=torch.float64, device="cpu", grad=True, generator=None,
                  extra_tokens: int = 0, tol: float | None = None):
    """Runs ops on the problem with fresh random inputs and compares with the oracle."""
    tol = TOLERANCE[dtype] if tol is None else tol
    rank = len(problem.spatial)
    q, k, v, rpb = problem.tensors(dtype=dtype, device=device, generator=generator, requires_grad=grad)
    extra_k = extra_v = None
    if extra_tokens:
        extra_k = torch.randn(problem.batch, extra_tokens, problem.heads_kv, problem.dim, dtype=dtype, device=device,
                              generator=generator).requires_grad_(grad)
        extra_v = torch.randn(problem.batch, extra_tokens, problem.heads_kv, problem.dim_v, dtype=dtype,
                              device=device, generator=generator).requires_grad_(grad)
    out, lse = ops.neighborhood_attention(rank, q, k, v, **problem.kwargs(), rpb=rpb, return_lse=True,
                                          backend=backend, additional_keys=extra_k, additional_values=extra_v)
    inputs = [t for t in (q, k, v, rpb, extra_k, extra_v) if t is not None]
    ref_inputs = [t.detach().cpu().double().requires_grad_(grad) for t in inputs]
    rq, rk, rv = ref_inputs[:3]
    rest = ref_inputs[3:]
    r_rpb = rest.pop(0) if rpb is not None else None
    r_ek, r_ev = (rest[0], rest[1]) if extra_k is not None else (None, None)
    ref_out, ref_lse = oracle_attention(rq, rk, rv, problem.spatial, problem.kernel_size, problem.stride,
                                        problem.dilation, problem.causal, r_rpb, extra_k=r_ek, extra_v=r_ev)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert lse.shape == ref_lse.shape
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err_out = (out.detach().cpu().double() - ref_out.detach()).abs().max().item()
    err_lse = (lse.detach().cpu().double() - ref_lse.detach()).abs().max().item()
    assert err_out <= tol, f"out error {err_out} > {tol} for {problem}"
    assert err_lse <= tol, f"lse error {err_lse} > {tol} for {problem}"
    if not grad:
        return
    g_out = torch.randn(out.shape, dtype=dtype, device=device, generator=generator)
    g_lse = torch.randn(lse.shape, dtype=torch.float32, device=device, generator=generator)
    grads = torch.autograd.grad((out * g_out).sum() + (lse * g_lse.to(lse.dtype)).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_out * g_out.cpu().double()).sum() + (ref_lse * g_lse.cpu().double()).sum(),
                                    ref_inputs)
    names = ["query", "key", "value", "rpb", "additional_keys", "additional_values"]
    names = [n for n, t in zip(names, (q, k, v, rpb, extra_k, extra_v)) if t is not None]
    for name, g, rg in zip(names, grads, ref_grads):
        assert torch.isfinite(g).all(), f"d{name} has non-finite values"
        # Gradients sum over many terms: scale the tolerance by the reference magnitude.
        err = (g.cpu().double() - rg).abs().max().item()
        bound = tol * max(1.0, rg.abs().max().item())
        assert err <= bound, f"d{name} error {err} > {bound} for {problem}"
