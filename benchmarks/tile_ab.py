"""A/B of tile shapes for the fused kernels of one problem, kernel by kernel, in alternating rounds.

    python benchmarks/tile_ab.py 3d-hunyuan --rounds 3 \
        --variant "dkdv:2x8x4/8x4x4/8/3/tma" --variant "fwd:2x8x4/2x8x4/4/3/tma"

For each kernel (fwd, dq, dkdv) the script times, on the same inputs:

* ``current``: the launch the backend picks now (tuning cache at ``$NAMODELS_FUSED_CACHE``, else
  the defaults table),
* ``model``: the same tile sizes, warps and stages with the shapes ``tiles.choose_tiles`` gives,
* every ``--variant`` of that kernel: ``kernel:outer/inner/num_warps/num_stages[/tma|ptr[/rN]]``, tiles
  as ``AxBxC`` (outer = query tile for fwd / dq, key tile for dkdv), ``rN`` a cap of N registers per thread.

Times are the tuner's own (median of CUDA-graph replays, ``autotune._kernel_ms``), one line per
round and a median over the rounds at the end; rounds that alternate, each starting one variant later, keep
clock drift and the place in a round out of the A/B.
``--keep-best`` writes each kernel's fastest launch into the tuning cache for this problem.
``--bwd-host-desc`` times every TMA variant of dQ and dK/dV twice: with descriptors built by each program
(``decide.BACKWARD_HOST_DESCRIPTORS`` off, as ``name``) and on the host (on, the default, as ``name+host``), from
two captures of the problem.
"""
import argparse
import dataclasses
import math
import statistics

import torch

from ops.bench import round_order, standard_problems
from ops.fused import autotune, decide


def parse_variant(text: str):
    kernel, rest = text.split(":", 1)
    fields = rest.split("/")
    outer, inner = (tuple(int(x) for x in f.split("x")) for f in fields[:2])
    pad = lambda t: (1,) * (3 - len(t)) + t  # noqa: E731
    tma = len(fields) > 4 and fields[4] == "tma"
    maxnreg = int(fields[5][1:]) if len(fields) > 5 else None
    launch = autotune.ResolvedConfig(pad(outer), pad(inner), int(fields[2]), int(fields[3]), tma, maxnreg)
    return kernel, launch


def capture_runs(p):
    """One fused forward+backward of problem ``p``; returns {kernel: (run, picked launch)}."""
    runs = {}
    original = decide.tile_config

    def recording_pick(kernel, q, k, v, params, has_rpb, run=None, *args, **kwargs):
        launch, source = original(kernel, q, k, v, params, has_rpb, run, *args, **kwargs)
        if run is not None:
            runs[kernel] = (run, launch, autotune.problem_key(kernel, q, k, v, params, has_rpb))
        return launch, source

    q, k, v, rpb = p.random_inputs("cuda", torch.bfloat16, requires_grad=True)
    decide.tile_config = recording_pick
    try:
        out = p.attention(q, k, v, rpb, "fused")
        out.backward(torch.randn_like(out))
    finally:
        decide.tile_config = original
    torch.cuda.synchronize()
    return runs, p.params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", default="fwd,dq,dkdv")
    ap.add_argument("--keep-best", action="store_true", help="store each kernel's fastest launch in the cache")
    ap.add_argument("--bwd-host-desc", action="store_true",
                    help="time the TMA variants of dQ and dK/dV with per-program (name) and host-built (name+host) "
                         "descriptors")
    args = ap.parse_args()
    problem = {p.name: p for p in standard_problems()}[args.problem]
    switch = decide.BACKWARD_HOST_DESCRIPTORS
    host_runs = {}
    if args.bwd_host_desc:  # the launcher decides per problem: capture it with the switch on, the base with it off
        decide.BACKWARD_HOST_DESCRIPTORS = True
        host_runs = {kernel: runs_[0] for kernel, runs_ in capture_runs(problem)[0].items() if kernel in ("dq", "dkdv")}
        decide.BACKWARD_HOST_DESCRIPTORS = False
        decide._PLANS.clear()
    runs, params = capture_runs(problem)
    decide.BACKWARD_HOST_DESCRIPTORS = switch
    extra = [parse_variant(v) for v in args.variant]
    table = {}
    for kernel in args.kernels.split(","):
        run, current, key = runs[kernel]
        cfg = autotune.Config(math.prod(current.outer_tile), math.prod(current.inner_tile), current.num_warps,
                              current.num_stages, current.tma)
        variants = {"current": current, "model": decide.resolve(cfg, params, kernel)}
        for i, (k, launch) in enumerate(extra):
            if k == kernel:
                variants[f"v{i}"] = launch
        runners = {name: run for name in variants}
        if kernel in host_runs:
            for name, launch in list(variants.items()):
                if launch.tma:
                    variants[f"{name}+host"], runners[f"{name}+host"] = launch, host_runs[kernel]
        for name, launch in variants.items():
            print(f"{kernel} {name}: {launch}", flush=True)
        table[kernel] = (runners, variants, {name: [] for name in variants}, key)
    for r in range(args.rounds):
        for kernel, (runners, variants, times, _) in table.items():
            # each round starts one variant later: consecutive measurements can alternate fast and slow
            # (docs/fused.md, "Measuring"), which a fixed order would pin on the same variants
            for name in round_order(list(variants), r):
                launch = variants[name]
                times[name].append(autotune._kernel_ms(lambda: runners[name](launch)))
            print(f"round {r} {kernel}: " + "  ".join(f"{n} {t[-1]:.3f}" for n, t in times.items()), flush=True)
    print(f"{args.problem}: median ms over {args.rounds} rounds")
    for kernel, (_, variants, times, key) in table.items():
        for name, launch in variants.items():
            extras = (" tma" if launch.tma else "") + (f" r{launch.maxnreg}" if launch.maxnreg else "")
            print(f"| {kernel} | {name} | {launch.outer_tile} x {launch.inner_tile} w{launch.num_warps} "
                  f"s{launch.num_stages}{extras} | {statistics.median(times[name]):.3f} |")
        if args.keep_best:
            best = min(variants, key=lambda name: statistics.median(times[name]))
            autotune._store(key, {**dataclasses.asdict(variants[best]), "ms": statistics.median(times[best])})
            print(f"{kernel}: kept {best} in {autotune.cache_path()}")


if __name__ == "__main__":
    main()
