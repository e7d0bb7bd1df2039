"""cProfile of a model's eager forward at batch 1 (host-bound), to find Python costs per NA call.

    python benchmarks/host_profile_model.py nat_tiny --backend fused [--top 30]
"""
import argparse
import cProfile
import pstats

import timm
import torch

import namodels
from namodels.benchmark.models import swap_dense_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="fused")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = timm.create_model(args.model).to(device).eval()
    if args.backend == "sdpa":
        swap_dense_attention(model)
    img = torch.randn(1, 3, 224, 224, device=device)

    def fwd():
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            model(img)

    with namodels.set_backend(model, None if args.backend == "sdpa" else args.backend):
        for _ in range(5):
            fwd()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            fwd()
        prof.disable()
    stats = pstats.Stats(prof)
    print(f"== {args.model} {args.backend}: by own time")
    stats.sort_stats("tottime").print_stats(args.top)
    print(f"== {args.model} {args.backend}: by cumulative time")
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
