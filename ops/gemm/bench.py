"""Timing of backend ``gemm`` against ``naive`` on the same inputs (speedup of the unfused GEMMs over the gather baseline).

    python -m ops.gemm.bench cpu                      # NAT-Mini stage 1, batch 8, float32 forward
    python -m ops.gemm.bench cuda [--json out.json]   # nat-s1, dinat-s1, 2d-flux; bf16 / fp32; fwd, fwd+bwd

CUDA times are medians of ``triton.testing.do_bench`` (CUDA events, after warm-up).  ``naive`` on
2d-flux takes tens of seconds per call: it is timed once per case by :func:`ops.timing.time_steps`
(the first call of a pure-PyTorch backend compiles nothing) and skipped when ``--naive-budget`` seconds
have been spent on it.  CPU times are medians of single calls timed by :func:`ops.timing.time_steps`,
the two backends alternating call by call, so that a drift of the machine's speed reaches both alike.
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch

import ops
from ops.timing import TimingSettings, median_ms, time_steps

# name: (B, H, D, spatial, K, dilation)
PROBLEMS = {
    "nat-s1": (128, 2, 32, (56, 56), (7, 7), 1),
    "dinat-s1": (128, 2, 32, (56, 56), (7, 7), 8),
    "2d-flux": (1, 24, 128, (256, 256), (80, 80), 1),
}
CPU_PROBLEM = (8, 2, 32, (56, 56), (7, 7), 1)  # NAT-Mini stage 1 with batch 8
_ONE_CALL = TimingSettings(warmup=0, iters=1)  # one timed call, no warm-up


def _time_one_call(fn, device) -> float:
    """Milliseconds of one call of ``fn`` on ``device`` (the shared step timer, no warm-up)."""
    return time_steps(fn, device, _ONE_CALL)[0]


def _inputs(problem, dtype, device, grad, seed=0):
    B, H, D, spatial, K, d = problem
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, *spatial, H, D, dtype=dtype, device=device, generator=gen) for _ in range(3))
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _call(problem, backend, q, k, v):
    _, _, _, _, K, d = problem
    return ops.na2d(q, k, v, K, dilation=d, backend=backend)


def bench_cpu(repeats: int = 5):
    problem = CPU_PROBLEM
    q, k, v = _inputs(problem, torch.float32, "cpu", grad=False)
    times = {"gemm": [], "naive": []}
    with torch.no_grad():
        ref = _call(problem, "naive", q, k, v)
        err = (_call(problem, "gemm", q, k, v) - ref).abs().max().item()
        for _ in range(repeats):
            for backend in times:
                times[backend].append(_time_one_call(functools.partial(_call, problem, backend, q, k, v), "cpu"))
    gemm, naive = (median_ms(times[b]) for b in ("gemm", "naive"))
    print(f"CPU {torch.get_num_threads()} threads, torch {torch.__version__}, B=8 56x56 H=2 D=32 K=7 float32 forward")
    print(f"max |gemm - naive| = {err:.2e}")
    print("| backend | forward ms (median of %d) |" % repeats)
    print("|---|---|")
    print(f"| naive | {naive:.1f} |\n| gemm | {gemm:.1f} |")
    print(f"speedup gemm over naive: {naive / gemm:.2f}x")
    return {"gemm_ms": gemm, "naive_ms": naive, "speedup": naive / gemm, "max_abs_diff": err}


def _time_cuda(fn, single: bool):
    from triton.testing import do_bench

    if single:
        return _time_one_call(fn, "cuda")
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_cuda(problem, dtype):
    """gemm against naive (float32 math) on the problem itself: output and input gradients."""
    q, k, v = _inputs(problem, dtype, "cuda", grad=True, seed=1)
    g = torch.randn_like(q)
    res = {}
    for backend in ("gemm", "naive"):
        out = _call(problem, backend, q, k, v)
        res[backend] = [out.detach()] + list(torch.autograd.grad(out, (q, k, v), g))
    return max(_rel(a, b) for a, b in zip(res["gemm"], res["naive"]))


def _measure(problem, backend, dtype, mode, single):
    grad = mode == "fwd+bwd"
    q, k, v = _inputs(problem, dtype, "cuda", grad)
    g = torch.randn_like(q) if grad else None

    def fn():
        if grad:
            for t in (q, k, v):
                t.grad = None
            _call(problem, backend, q, k, v).backward(g)
        else:
            with torch.no_grad():
                _call(problem, backend, q, k, v)

    ms = _time_cuda(fn, single=single)
    del q, k, v, g
    torch.cuda.empty_cache()
    return ms


def bench_cuda(naive_budget: float, problems, dtypes):
    """gemm on every case first; naive on 2d-flux (tens of seconds a call) last, within the budget."""
    rows, deferred = [], []
    for name in problems:
        problem = PROBLEMS[name]
        for dtype in dtypes:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            print(f"{name} {dtype}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free", flush=True)
            if name != "2d-flux":  # (naive takes minutes there: checked on smaller problems by the tests)
                err = check_cuda(problem, dtype)
                print(f"{name} {dtype}: max relative error gemm vs naive (out, dq, dk, dv) = {err:.2e}", flush=True)
                torch.cuda.empty_cache()
            for mode in ("fwd", "fwd+bwd"):
                row = {"problem": name, "dtype": str(dtype).replace("torch.", ""), "mode": mode, "naive": None}
                row["gemm"] = _measure(problem, "gemm", dtype, mode, single=False)
                if name == "2d-flux":
                    deferred.append((row, problem, dtype, mode))
                else:
                    row["naive"] = _measure(problem, "naive", dtype, mode, single=False)
                rows.append(row)
                print(f"{name} {row['dtype']} {mode}: gemm {row['gemm']:.3f} ms, naive {row['naive']} ms", flush=True)
    spent = 0.0
    for row, problem, dtype, mode in deferred:
        if spent > naive_budget:
            break
        wall = time.perf_counter()
        row["naive"] = _measure(problem, "naive", dtype, mode, single=True)
        spent += time.perf_counter() - wall
        print(f"{row['problem']} {row['dtype']} {mode}: naive {row['naive']:.1f} ms (one call)", flush=True)
    for row in rows:
        row["speedup"] = row["naive"] / row["gemm"] if row["naive"] else None
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    print("| problem | dtype | pass | gemm ms | naive ms | naive / gemm |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda x, p=3: "not run" if x is None else f"{x:.{p}f}"  # noqa: E731
        print(f"| {r['problem']} | {r['dtype']} | {r['mode']} | {fmt(r['gemm'])} | {fmt(r['naive'])} | "
              f"{fmt(r['speedup'], 1)}x |")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", choices=["cpu", "cuda"])
    parser.add_argument("--json")
    parser.add_argument("--naive-budget", type=float, default=150.0,
                        help="seconds of naive 2d-flux timing after which the rest is skipped")
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args()
    if args.device == "cpu":
        result = bench_cpu()
    else:
        result = bench_cuda(args.naive_budget, args.problems, [getattr(torch, d) for d in args.dtypes])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
