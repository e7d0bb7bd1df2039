#!/usr/bin/env python
"""Causal video NAT on one GPU, per NA backend (standalone: no Hydra; imports namodels directly).

For each backend, in its own process (a backend that fails or hangs only loses its row):

* ``train``: optimizer steps per second of ``video_nat_tiny`` on 16x64x64 RGB clips (batch
  ``--batch``, float32 with TF32 matmuls or ``--amp`` bf16 autocast, AdamW, next-frame MSE with
  teacher forcing); reported as clips/s and frames/s, median over timed steps after warm-up
  (CUDA-synchronised wall clock per step);
* ``full``: inference of whole 16-frame clips, float32 (frames/s);
* ``stream``: latency per frame of ``model.step`` (batch ``--stream-batch``), median over frames
  16..16+N of a stream (CUDA events), and the largest difference between the streamed predictions
  and the full-clip forward on the same frames (fp32, as a correctness check on the GPU).

    python benchmarks/video_bench.py --out results/ --backends fused,naive
    python benchmarks/video_bench.py --tiny --backends naive      # CPU smoke test of the script
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(msg, flush=True)


def build(args, device):
    import timm

    import namodels  # noqa: F401  registers video_nat_*

    kwargs = dict(img_size=args.size, in_chans=3, backend=args.backend)
    if args.tiny:
        kwargs.update(embed_dim=32, depth=2, num_heads=2)
    torch.manual_seed(0)
    return timm.create_model(args.model, **kwargs).to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_train(args, model, device) -> dict:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(1)
    clips = torch.rand(args.batch, args.frames, 3, args.size, args.size, generator=g).to(device)
    times, compile_s = [], None
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp and device.type == "cuda"):
            pred = model.predict_next_frames(clips)
        loss = (pred[:, :-1].float() - clips[:, 1:]).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        dt = time.perf_counter() - t0
        if i == 0:
            compile_s = dt
        if i >= args.warmup:
            times.append(dt)
    step = statistics.median(times)
    return dict(first_step_s=round(compile_s, 2), step_ms=round(step * 1e3, 2),
                clips_per_s=round(args.batch / step, 2), frames_per_s=round(args.batch * args.frames / step, 1),
                loss=float(loss))


@torch.no_grad()
def bench_full(args, model, device) -> dict:
    model.eval()
    clips = torch.rand(args.stream_batch, args.frames, 3, args.size, args.size, device=device)
    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        model.predict_next_frames(clips)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return dict(clip_ms=round(t * 1e3, 3), frames_per_s=round(args.stream_batch * args.frames / t, 1))


@torch.no_grad()
def bench_stream(args, model, device) -> dict:
    model.eval()
    n = args.frames + args.stream_frames
    clip = torch.rand(args.stream_batch, n, 3, args.size, args.size, device=device)
    state = model.init_stream()
    lat, preds = [], []
    for t in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        out = model.step(clip[:, t], state)
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        preds.append(out["next_frame"])
        if t >= args.frames:  # steady state: the ring buffers are full
            lat.append(ms)
    cache_bytes = state.nbytes()
    # Correctness on this device: fp32 streaming vs the full-clip forward on the first frames.
    full = model.predict_next_frames(clip[:, : args.frames])
    diff = (torch.stack(preds[: args.frames], 1) - full).abs().max().item()
    return dict(latency_ms=round(statistics.median(lat), 3), latency_p90_ms=round(sorted(lat)[int(0.9 * len(lat))], 3),
                frames_per_s=round(args.stream_batch * 1e3 / statistics.median(lat), 1), cache_MiB=round(cache_bytes / 2**20, 3),
                max_abs_diff_vs_full=diff)


def run_one(args) -> dict:
    import ops

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build(args, device)
    result = dict(backend=args.backend, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  params_M=round(sum(p.numel() for p in model.parameters()) / 1e6, 3))
    with ops.use_backend(args.backend):
        for part in args.parts.split(","):
            t0 = time.time()
            result[part] = dict(train=bench_train, full=bench_full, stream=bench_stream)[part](args, model, device)
            log(f"  [{args.backend}] {part}: {result[part]}  ({time.time() - t0:.1f}s)")
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="video_nat_tiny")
    p.add_argument("--backends", default="fused,naive")
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # one backend, in a child process
    p.add_argument("--parts", default="train,full,stream")
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--stream-batch", type=int, default=1)
    p.add_argument("--stream-frames", type=int, default=32, help="timed frames after the first --frames")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--amp", action="store_true", help="bf16 autocast in training")
    p.add_argument("--timeout", type=float, default=120, help="seconds per backend process")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="small model on CPU (smoke test)")
    args = p.parse_args()
    if args.tiny:
        args.size, args.frames, args.batch, args.stream_frames, args.steps, args.warmup = 32, 4, 2, 4, 2, 1

    if args.backend is not None:  # child
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child_args, skip = [], False  # this command line without --backends
    for a in sys.argv[1:]:
        if skip or a.startswith("--backends="):
            skip = False
            continue
        if a == "--backends":
            skip = True
            continue
        child_args.append(a)
    try:
        import triton

        versions = dict(torch=torch.__version__, triton=triton.__version__)
    except ImportError:
        versions = dict(torch=torch.__version__)
    log(f"versions: {versions}; device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    results = []
    for backend in args.backends.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--backend", backend] + child_args
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            out = proc.stdout + proc.stderr
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(lines[-1][7:]) if lines else dict(backend=backend, error=out[-1500:])
        except subprocess.TimeoutExpired as err:
            out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
            row = dict(backend=backend, error=f"timed out after {args.timeout:.0f}s", partial=out[-1500:])
        row["seconds"] = round(time.time() - t0, 1)
        log(out if "error" in row else "\n".join(ln for ln in out.splitlines() if ln.startswith("  [")))
        results.append(row)
    summary = dict(versions=versions, args={k: v for k, v in vars(args).items() if k != "backend"}, results=results)
    log(json.dumps(summary, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "video_bench.json"), "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
