"""Per-kernel GPU time of one fused forward+backward (torch.profiler), for the problems named.

    python benchmarks/fused_profile.py nat-s1-rpb 1d-32k [--autotune]

Prints, per problem, the CUDA time of each kernel (fwd, dQ, dK/dV, dRPB, and the PyTorch ops
around them) averaged over a few profiled iterations after warm-up: which part of the backward
to work on next.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from ops.bench import standard_problems


def kernel_times(step, iters: int = 3) -> dict:
    """``{kernel: ms}``: the CUDA time of each kernel per call of ``step``, averaged over ``iters`` profiled calls after
    three warm-up calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    totals = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA or getattr(evt, "self_device_time_total", 0):
            t = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
            if t:
                totals[evt.key] = totals.get(evt.key, 0) + t / iters / 1000
    return totals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problems", nargs="+")
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    if args.autotune:
        from ops.fused import autotune

        autotune.set_autotune(True)
    known = {p.name: p for p in standard_problems()}
    for name in args.problems:
        p = known[name]
        q, k, v, rpb = p.random_inputs("cuda", torch.bfloat16, requires_grad=True)
        d_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

        leaves = [t for t in (q, k, v, rpb) if t is not None and t.requires_grad]

        def step():  # gradients returned, not accumulated into .grad: no add kernels a training step would not run
            torch.autograd.grad(p.attention(q, k, v, rpb, "fused"), leaves, d_out)

        totals = kernel_times(step, args.iters)
        print(f"{name}: per fwd+bwd step, ms by kernel (all kernels: {sum(totals.values()):.3f})")
        for key, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {ms:9.3f}  {key[:90]}")
        del q, k, v, d_out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
