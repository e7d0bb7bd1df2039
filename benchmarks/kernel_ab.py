"""A/B of fused-kernel variants in one process, in alternating rounds (run from the repository root).

    python3 benchmarks/kernel_ab.py PROBLEM [--backward] [--rounds N] [--rep MS] [--profile] [--set MOD.ATTR=VALUE]
        [--force NAME:KERNEL=OUTER,INNER,WARPS,STAGES,TMA,MAXNREG] NAME=PATH ...

Each NAME=PATH is a copy of ops/fused/kernels.py, and NAME=MODULE:PATH one of another kernel module the launcher
calls (``hopper``, ``hopper_dq``, ``hopper_dkdv``: e.g. ``old=hopper:/tmp/hopper.py`` from ``git show``); ``base`` is
the checked-out code.  The launcher is pointed at each variant's module in turn, its plans cleared, and the problem's
call timed as ``ops.bench`` times it (``bench._bench``, at least ``bench.MIN_CALLS`` calls; rounds in rotating order,
``bench.time_alternating``; medians over rounds reported).  Every variant's output (and gradients with
``--backward``) is compared with the base's (max abs difference), and one that differs by more than 1e-2 is flagged.
``--profile`` also prints each variant's CUDA time per kernel (``fused_profile.kernel_times``: back-to-back calls).
``--set MOD.X=V`` sets a constant of ``decide``, ``launch``, ``rpb_grad`` or a kernel module (``hopper.PERSISTENT_MASKED=True``)
for variants named ``NAME@set``, whose path may be ``base``, the checked-out source (``pm@set=hopper:base``);
``--force NAME:fwd=64,64,4,2,1,128`` pins variant NAME's kernel to an ``autotune.Config`` (MAXNREG 0: none)."""
import argparse
import importlib.util
import statistics
import sys

import torch

from ops import bench
from ops.fused import autotune, decide, launch, rpb_grad


MODULES = ("kernels", "hopper", "hopper_dq", "hopper_dkdv")  # the launcher's kernel modules a variant may replace


def load(name, path):
    spec = importlib.util.spec_from_file_location(f"ops.fused._variant_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up while it runs)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("variants", nargs="*")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=float, default=200, help="ms of timed calls a round (at least bench.MIN_CALLS)")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--force", action="append", default=[])
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1 (no timing)")
    ap.add_argument("--profile", action="store_true", help="also print each variant's CUDA time per kernel")
    args = ap.parse_intermixed_args()
    problems = {p.name: p for p in bench.standard_problems()}
    if ":" in args.problem:
        p = bench.parse_custom(args.problem)
    else:
        p = problems[args.problem]
    base = {module: getattr(launch, module) for module in MODULES}
    mods = {"base": (base, {})}
    for item in args.variants:
        name, path = item.split("=", 1)
        module, path = path.split(":", 1) if ":" in path else ("kernels", path)
        if module not in MODULES:
            raise SystemExit(f"{item}: the module must be one of {', '.join(MODULES)}")
        sets = {}
        if name.endswith("@set"):
            for s in args.set:
                key, value = s.split("=", 1)
                sets[key] = eval(value)  # noqa: S307  (experiment script: literal values)
        mods[name] = (base if path == "base" else dict(base, **{module: load(name, path)}), sets)
    forced = {}
    for item in args.force:
        name, spec = item.split(":", 1)
        kernel, values = spec.split("=", 1)
        o, i, w, st, tma, reg = (int(x) for x in values.split(","))
        forced.setdefault(name, {})[kernel] = autotune.Config(o, i, w, st, bool(tma), reg or None)
    gen = torch.Generator(device=args.device).manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    q, k, v, rpb = p.random_inputs(args.device, dtype, gen, requires_grad=args.backward)
    d_out = torch.randn_like(q) if args.backward else None
    modules = {"decide": decide, "launch": launch, "rpb_grad": rpb_grad, **base}

    def activate(name):
        variant, sets = mods[name]
        for module, mod in variant.items():
            setattr(launch, module, mod)
        autotune._forced.clear()
        autotune._forced.update(forced.get(name, {}))
        for key, value in sets.items():
            m, attr = key.split(".")
            setattr(modules[m], attr, value)
        decide._PLANS.clear()

    def deactivate(name):
        autotune._forced.clear()
        for key in mods[name][1]:
            m, attr = key.split(".")
            setattr(modules[m], attr, defaults[key])

    defaults = {s.split("=")[0]: getattr(modules[s.split(".")[0]], s.split("=")[0].split(".")[1]) for s in args.set}
    fns, outs = {}, {}
    for name in mods:
        activate(name)
        _, fn = bench._backend_call(p, "fused", q, k, v, rpb, d_out)
        leaves = [None if t is None else t.detach().requires_grad_(args.backward) for t in (q, k, v, rpb)]
        out = p.attention(*leaves, "fused")
        if args.backward:
            grads = torch.autograd.grad(out, [t for t in leaves if t is not None], d_out)
            outs[name] = (out.detach().float(), *(g.float() for g in grads))
        else:
            outs[name] = (out.float(),)
        fns[name] = fn
        deactivate(name)
    for name in mods:
        diff = max((a - b).abs().max().item() for a, b in zip(outs[name], outs["base"]))
        print(f"{name}: max |out - base| = {diff:.3g}{'  DIFFERS' if diff > 1e-2 else ''}")
    if args.device != "cuda":
        return

    def timed(name):  # the variant's plans rebuilt, then its call timed as ``ops.bench`` times one
        def run():
            activate(name)
            fns[name]()
            try:
                return bench._bench(fns[name], 25, args.rep)
            finally:
                deactivate(name)
        return run

    times, errors = bench.time_alternating({name: timed(name) for name in mods}, args.rounds, lambda run: run())
    if errors:
        raise SystemExit(f"timing failed: {errors}")
    if args.profile:
        from fused_profile import kernel_times

        for name in mods:
            activate(name)
            totals = kernel_times(fns[name])
            deactivate(name)
            print(f"{name}: ms by kernel (all kernels: {sum(totals.values()):.3f})")
            for key, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:6]:
                print(f"  {ms:9.3f}  {key[:90]}")
    print(f"| problem | variant | ms (median of {args.rounds}) | rounds |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {p.name}{' fwd+bwd' if args.backward else ''} | {name} | {statistics.median(t):.4f} | "
              f"{' '.join(f'{x:.4f}' for x in t)} |")


if __name__ == "__main__":
    main()
