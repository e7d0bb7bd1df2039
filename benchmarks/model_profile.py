"""Where a model's inference time goes, per CUDA kernel (torch.profiler), for one NA backend.

    python benchmarks/model_profile.py nat_tiny --backend fused [--batch 128] [--autotune] [--train]

Prints the step time (CUDA events, median) and the kernels that take most of it, grouped so that
the NA kernels' share is visible next to the linear layers, norms and copies.  It shows why a
model is slower than its dense-attention twin.
"""
import argparse

import timm
import torch
from torch.profiler import ProfilerActivity, profile

import namodels  # registers the models
from namodels.benchmark.models import swap_dense_attention
from namodels.benchmark.timing import TimingSettings, median_ms, time_steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="fused", help="NA backend, or 'sdpa' for the dense twin")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--train", action="store_true", help="profile forward+backward instead of inference")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    if args.autotune:
        from ops.fused import autotune

        autotune.set_autotune(True)
    model = timm.create_model(args.model, pretrained=False).cuda()
    model.train(args.train)
    backend = None if args.backend == "sdpa" else args.backend
    if args.backend == "sdpa":
        swap_dense_attention(model)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if args.train:
                model(x).float().mean().backward()
            else:
                with torch.no_grad():
                    model(x)

    with namodels.set_backend(model, backend):
        settings = TimingSettings(warmup=3, iters=args.iters, min_iters=args.iters, cap_s=float("inf"),
                                  warmup_cap_s=float("inf"))
        times = time_steps(step, torch.device("cuda"), settings)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                step()
            torch.cuda.synchronize()
    print(f"{args.model} backend={args.backend} batch={args.batch} train={args.train}: "
          f"median step {median_ms(times):.2f} ms")
    totals, counts = {}, {}
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        if t:
            totals[evt.key] = totals.get(evt.key, 0) + t / args.iters / 1000
            counts[evt.key] = counts.get(evt.key, 0) + evt.count // args.iters
    total = sum(totals.values())
    na = sum(ms for key, ms in totals.items() if "na_" in key or "flex" in key.lower())
    print(f"  kernels total {total:.2f} ms per step, NA kernels {na:.2f} ms ({100 * na / max(total, 1e-9):.0f}%)")
    for key, ms in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {ms:8.3f} ms  x{counts[key]:<4d} {key[:100]}")


if __name__ == "__main__":
    main()
