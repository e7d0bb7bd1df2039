#!/usr/bin/env python
"""StyleNAT on one GPU (standalone: no Hydra; imports namodels directly).

1. ``train``: a short GAN run with the release's recipe (TTUR, lazy R1 every 16, bCR, D clip 5,
   G EMA) at 64x64 on the built-in scikit-image crops, through ``GANTask`` and a Lightning Trainer;
   checks that every loss stays finite and the discriminator does not win outright, and saves a
   G-EMA sample grid.
2. ``throughput``: generated images per second of the FFHQ-256 generator (48.92M) in eval mode under
   each NA backend (bf16 autocast), timed with CUDA events after warm-up (median of the timed runs).

    python benchmarks/stylenat_bench.py --out results/   # on a GPU machine
    python benchmarks/stylenat_bench.py --tiny           # CPU smoke test of the script itself
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

import ops
from namodels.models.stylenat import StyleNATGenerator

TINY = dict(channels=[32, 32, 16, 16], style_dim=16, n_mlp=2)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------


def train_run(args, device: str) -> dict:
    import lightning as L

    from namodels.data.images import GANDataModule
    from namodels.tasks.gan import GANTask
    from namodels.tasks.generators import save_grid

    size = 32 if args.tiny else args.train_size
    g_cfg = dict(size=size, **(TINY if args.tiny else {}))
    d_cfg = dict(size=size, **({"channels": TINY["channels"]} if args.tiny else {}))
    batch = args.train_batch
    task = GANTask(g_cfg, d_cfg, bcr=True, max_kimg=args.train_steps * batch / 1000, sample_every_n_steps=0)
    dm = GANDataModule(source="skimage", resolution=size, batch_size=batch, num_workers=args.workers,
                       length=max(args.train_steps * batch, batch), seed=0)
    history: list[dict] = []
    started = time.time()

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch_, batch_idx):
            m = trainer.callback_metrics
            history.append({k: float(m[k]) for k in ("loss/d", "loss/g", "loss/r1", "loss/bcr", "d/real", "d/fake")
                            if k in m} | {"t": time.time() - started, "kimg": module.kimg})
            if len(history) % args.log_every == 0:
                h = history[-1]
                log(f"  step {len(history):4d}  kimg {h['kimg']:.3f}  D {h['loss/d']:.3f}  G {h['loss/g']:.3f}  "
                    f"R1 {h.get('loss/r1', float('nan')):.4f}  D(real) {h['d/real']:+.2f}  D(fake) {h['d/fake']:+.2f}"
                    f"  {h['t']:.0f}s")
            if time.time() - started > args.train_seconds:
                trainer.should_stop = True

    trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, precision="32-true",
                        max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Record()], num_sanity_val_steps=0)
    with ops.use_backend(args.train_backend):
        trainer.fit(task, dm)
    elapsed = time.time() - started
    steps = len(history)
    keys = ("loss/d", "loss/g", "loss/r1", "loss/bcr", "d/real", "d/fake")
    finite = all(math.isfinite(h[k]) for h in history for k in keys if k in h)
    params_finite = all(torch.isfinite(p).all() for p in task.parameters())
    window = max(1, min(50, steps // 4))

    def mean(key, part):
        vals = [h[key] for h in part if key in h]
        return round(statistics.fmean(vals), 4) if vals else None

    first, last = history[:window], history[-window:]
    # Steady-state time per step: skip the first steps (Triton compilation, autotuning, cudnn setup).
    tail = history[steps // 3:]
    step_ms = 1000 * (tail[-1]["t"] - tail[0]["t"]) / max(1, len(tail) - 1) if len(tail) > 1 else None
    grid = os.path.join(args.out, "stylenat_train_samples.png")
    save_grid(task.g_ema.sample(16, seed=0, device=task.device).float().cpu(), grid, nrow=4)
    d_last = mean("loss/d", last)
    result = dict(
        size=size, batch=batch, steps=steps, kimg=round(task.kimg, 3), seconds=round(elapsed, 1),
        step_ms=round(step_ms, 1) if step_ms else None, finite_losses=finite, finite_params=bool(params_finite),
        first=dict((k, mean(k, first)) for k in keys), last=dict((k, mean(k, last)) for k in keys),
        samples=grid, g_params=sum(p.numel() for p in task.generator.parameters()),
        d_params=sum(p.numel() for p in task.discriminator.parameters()),
    )
    # Divergence: NaN/inf anywhere, or the discriminator winning outright (D loss -> 0, G loss exploding).
    result["diverged"] = not (finite and params_finite and d_last is not None and d_last > 0.05
                              and mean("loss/g", last) < 20)
    with open(os.path.join(args.out, "stylenat_train_history.json"), "w") as f:
        json.dump(history, f)
    return result


# ---------------------------------------------------------------------------------------------


def throughput_row(args, device: str, name: str, batch: int) -> dict:
    """One backend row, in this process: build the generator, warm up, time, check the output."""
    size = 32 if args.tiny else args.tp_size
    torch.manual_seed(0)
    g = StyleNATGenerator(size, **(TINY if args.tiny else {})).to(device).eval().requires_grad_(False)
    # The check latents do not depend on the row's batch size (same images compared across rows).
    z_check = torch.randn(2, g.style_dim, generator=torch.Generator().manual_seed(1)).to(device)
    from namodels.tasks.generate import images_per_second

    with ops.use_backend(name):
        t0 = time.time()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = g(torch.randn(batch, g.style_dim, device=device))
        if device == "cuda":
            torch.cuda.synchronize()
        first_s = time.time() - t0
        iters = args.tp_iters if name != "naive" else max(2, args.tp_iters // 3)
        timing = images_per_second(g, batch, iters=iters, warmup=1, backend=name)
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            check = g(z_check).float().cpu()
    med = timing["median_s"]
    torch.save(check, os.path.join(args.out, f"check_{name}_{batch}.pt"))
    return dict(backend=name, batch=batch, status="ok", median_s=round(med, 5), images_per_s=round(batch / med, 2),
                first_call_s=round(first_s, 2), iters=iters, finite=bool(torch.isfinite(out).all()),
                size=size, g_params=sum(p.numel() for p in g.parameters()))


def throughput(args, deadline: float) -> list[dict]:
    """Every backend row in its own process (a hung compile or a crashed kernel costs one row, not
    the run), each under the time left; outputs compared with the first row's."""
    import subprocess

    rows, reference = [], None
    for spec in args.backends.split(","):
        name, _, bs = spec.partition(":")
        batch = int(bs) if bs else args.tp_batch
        left = deadline - time.time()
        if left < args.min_seconds_per_backend:
            rows.append(dict(backend=name, batch=batch, status=f"skipped: {left:.0f} s of the time budget left"))
            log(f"  {name:6s} batch {batch:3d}: skipped (time budget)")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--row", f"{name}:{batch}", "--out", args.out,
               "--tp-size", str(args.tp_size), "--tp-iters", str(args.tp_iters)] + (["--tiny"] if args.tiny else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, args.max_seconds_per_backend))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            row = json.loads(lines[-1][4:]) if lines else dict(
                backend=name, batch=batch, status=f"error (rc {proc.returncode}): {proc.stderr.strip()[-300:]}")
        except subprocess.TimeoutExpired:
            row = dict(backend=name, batch=batch, status=f"timed out after {min(left, args.max_seconds_per_backend):.0f} s")
        if row["status"] == "ok":
            check = torch.load(os.path.join(args.out, f"check_{name}_{batch}.pt"))
            reference = check if reference is None else reference
            row["rel_diff_vs_first"] = float(f"{float((check - reference).norm() / reference.norm()):.3g}")
            log(f"  {name:6s} batch {batch:3d}: {row['images_per_s']:8.2f} img/s  (median {1000 * row['median_s']:.1f} "
                f"ms, first call {row['first_call_s']:.1f} s, rel. diff {row['rel_diff_vs_first']:.1e})")
        else:
            log(f"  {name:6s} batch {batch:3d}: {row['status']}")
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="tiny models on any device (smoke test of this script)")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--train-size", type=int, default=64)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--train-seconds", type=float, default=90, help="stop training after this long")
    p.add_argument("--train-backend", default="gemm",
                   help="NA backend for training (2026-11-22: fused's float32 backward failed to compile on H100)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--tp-size", type=int, default=256)
    p.add_argument("--tp-batch", type=int, default=16)
    p.add_argument("--tp-iters", type=int, default=10)
    p.add_argument("--backends", default="gemm,fused,flex,naive,gemm:1",
                   help="comma list of backend[:batch] rows")
    p.add_argument("--budget-seconds", type=float, default=150, help="throughput rows after this are skipped")
    p.add_argument("--min-seconds-per-backend", type=float, default=20)
    p.add_argument("--max-seconds-per-backend", type=float, default=60)
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: one throughput row
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.row:
        name, _, bs = args.row.partition(":")
        print("ROW " + json.dumps(throughput_row(args, device, name, int(bs))), flush=True)
        return None
    t_start = time.time()
    env = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
               triton=_version("triton"), python=sys.version.split()[0])
    log(f"StyleNAT bench on {env}")
    report = {"env": env, "args": vars(args)}
    if not args.skip_train:
        log("train (GANTask, Lightning, float32/TF32, bCR + lazy R1):")
        report["train"] = train_run(args, device)
        log(json.dumps(report["train"], indent=1))
    if not args.skip_throughput:
        log("generator throughput (eval, bf16 autocast):")
        report["throughput"] = throughput(args, t_start + args.budget_seconds)
    report["total_seconds"] = round(time.time() - t_start, 1)
    with open(os.path.join(args.out, "stylenat_bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    if "throughput" in report:
        log("\n| backend | batch | images/s | median ms | first call s | rel. diff |")
        log("|---|---|---|---|---|---|")
        for r in report["throughput"]:
            if r["status"] == "ok":
                log(f"| {r['backend']} | {r['batch']} | {r['images_per_s']} | {1000 * r['median_s']:.1f} | "
                    f"{r['first_call_s']} | {r['rel_diff_vs_first']:.1e} |")
            else:
                log(f"| {r['backend']} | {r['batch']} | {r['status']} | | | |")
    log(f"total {report['total_seconds']} s")
    return report


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:
        return None


if __name__ == "__main__":
    main()
