"""Compile the Hopper kernels (Gluon: the forward in ``ops/fused/hopper.py``, dQ in ``ops/fused/hopper_dq.py``, dK/dV
in ``ops/fused/hopper_dkdv.py``) for sm_90 without a GPU and report their resources.

    python benchmarks/hopper_compile_check.py [--order] [--kernel fwd|dq|dkdv ...]

Like ``fused_compile_check.py``: Triton's ahead-of-time path and the ptxas bundled with Triton, so a Gluon error,
a register spill or a missing ``wgmma`` / ``setmaxnreg`` shows before any device time is spent.  ``--order`` also
prints the consumers' main loops in the order ptxas scheduled them (``loop_orders``): where each ``wgmma`` wait falls
among the softmax's exponentials decides whether the softmax overlaps a matmul.  Gluon changes from one Triton
release to the next: check with the device's Triton version (a separate environment, e.g.
``pip install --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``).
"""
import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import fused_sass  # noqa: E402
from fused_compile_check import ptxas_usage  # noqa: E402
from ops.fused import hopper, hopper_dkdv, hopper_dq  # noqa: E402

# (kernel, query tile, key tile, head dim[, masked]): the tiles ``tiles.choose_tiles`` gives 1-D (forward only), 2-D
# and 3-D problems; the forward and dK/dV with and without their mask code (the strided problems' launches have none)
CASES = [("fwd", (1, 1, 128), (1, 1, 128), 128), ("fwd", (1, 8, 16), (1, 8, 16), 128),
         ("fwd", (2, 8, 8), (2, 8, 8), 128), ("fwd", (1, 8, 16), (2, 8, 8), 64),
         ("fwd", (1, 1, 128), (1, 1, 128), 128, False), ("fwd", (1, 8, 16), (1, 8, 16), 128, False),
         ("fwd", (2, 8, 8), (2, 8, 8), 128, False),
         ("dq", (1, 1, 128), (1, 1, 128), 128), ("dq", (1, 8, 16), (1, 8, 16), 128),
         ("dq", (2, 8, 8), (2, 8, 8), 128), ("dq", (1, 8, 16), (2, 8, 8), 64),
         ("dkdv", (1, 4, 16), (1, 8, 16), 128, False), ("dkdv", (1, 8, 8), (2, 8, 8), 128, False),
         ("dkdv", (1, 4, 16), (1, 8, 16), 64, False), ("dkdv", (1, 8, 8), (1, 8, 16), 128, True),
         ("dkdv", (4, 4, 4), (2, 8, 8), 128, True), ("dkdv", (4, 4, 4), (2, 8, 8), 64, True)]
POINTERS = {"O": "*bf16", "DQ": "*bf16", "DLSE": "*fp32", "QUERY_RANGES": "*i32", "DK": "*bf16", "DV": "*bf16",
            "LSE": "*fp32", "DELTA": "*fp32", "FLAGS": "*i8",
            "STARTS": "*i32", "SPANS": "*i32", "ORDER": "*i32", "ROW_OFFSETS": "*i32",
            "KEY_OFFSETS": "*i32"}
FLOATS = ("qk_scale", "scale")


def _descriptor_type(box, dim):
    from triton.experimental.gluon import language as gl

    block = [1, *box, dim]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"


def compile_case(kernel, q_tile, kv_tile, dim, masked=True):
    from triton.experimental.gluon._runtime import GluonASTSource

    if kernel in ("fwd", "dq"):  # each consumer reads its half of the query box
        module, fn = (hopper, hopper.na_fwd_hopper_kernel) if kernel == "fwd" else (hopper_dq,
                                                                                    hopper_dq.na_bwd_dq_hopper_kernel)
        half = hopper.half_box(q_tile)[0]
        boxes = {"q_desc": half, "o_desc": half, "do_desc": half, "k_desc": kv_tile, "v_desc": kv_tile}
    else:  # each consumer holds its half of the 128-key tile
        module, fn = hopper_dkdv, hopper_dkdv.na_bwd_dkdv_hopper_kernel
        keys = hopper.half_box(kv_tile)[0]
        boxes = {"k_desc": keys, "v_desc": keys, "q_desc": q_tile, "do_desc": q_tile}
    constexprs = dict(STAGES_=module.STAGES, CONSUMER_REGS_=module.CONSUMER_REGS, PRODUCER_REGS_=module.PRODUCER_REGS)
    if kernel == "fwd":  # one program per SM where no tile needs a mask (``hopper.HopperForward.persistent``)
        constexprs["PERSISTENT_"] = not masked
    options = {"num_warps": 4}
    # dK/dV's mask switch (``hopper_dkdv.build_launches``)
    pointers = dict(POINTERS, QUERY_RANGES="*i32" if masked else "*i8")
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in boxes:
            signature[name] = _descriptor_type(boxes[name], dim)
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    ptx = compiled.asm["ptx"]
    return ptxas_usage(ptx), "wgmma" in ptx, ptx.count("setmaxnreg"), compiled.asm["cubin"]


# SASS instructions that order a consumer's loop step, by the name ``loop_orders`` prints for them
# (an integer division by a runtime value shows as a ``MUFU.RCP``, on the exponentials' unit)
EVENTS = (("HGMMA", "mma"), ("WARPGROUP.DEPBAR", "wait"), ("MUFU.EX2", "exp"), ("MUFU.RCP", "rcp"), ("F2FP", "cvt"),
          ("BAR.SYNC", "bar"), ("SYNCS.ARRIVE", "arrive"), ("SYNCS.PHASECHK", "mbarrier-wait"))


def loop_orders(sass: str) -> list:
    """The innermost loops (``fused_sass.loop_ranges``) that hold two committed ``wgmma`` groups, i.e. the consumers'
    steady-state steps, each as a list of ``(event, count)`` runs in program order; a wait is named with the number
    of groups it leaves in flight (``wait<=1``)."""
    found = fused_sass.blocks(sass)
    instructions = [(address, text) for _, ins in found for address, _, _, text in ins]
    ranges = [(lo, hi) for lo, hi in fused_sass.loop_ranges(found)
              if sum(lo <= a <= hi and text.startswith("HGMMA") and "gsb0" in text for a, text in instructions) >= 2]
    innermost = [r for r in ranges if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in ranges)]
    orders = []
    for lo, hi in innermost:
        runs = []
        for address, text in instructions:
            name = next((n for prefix, n in EVENTS if text.startswith(prefix)), None) if lo <= address <= hi else None
            if name == "wait":
                name = f"wait<={int(text.split(',')[-1], 16)}"
            if name and runs and runs[-1][0] == name:
                runs[-1][1] += 1
            elif name:
                runs.append([name, 1])
        orders.append([tuple(r) for r in runs])
    return orders


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--order", action="store_true", help="print each consumer loop's scheduled order")
    ap.add_argument("--kernel", action="append", choices=("fwd", "dq", "dkdv"), help="only these kernels' cases")
    args = ap.parse_args()
    if hopper.gluon is None:
        sys.exit("this Triton has no Gluon")
    for kernel, q_tile, kv_tile, dim, *masked in CASES:
        if args.kernel and kernel not in args.kernel:
            continue
        label = f"{kernel} q {q_tile} kv {kv_tile} D {dim}" + (" masked" if not masked or masked[0] else " unmasked")
        try:
            (regs, spill), wgmma, setmaxnreg, cubin = compile_case(kernel, q_tile, kv_tile, dim, *masked)
            print(f"{label}: ok  regs={regs} spill_bytes={spill} wgmma={wgmma} "
                  f"setmaxnreg={setmaxnreg}", flush=True)
        except Exception as err:  # report every case
            print(f"{label}: FAIL {type(err).__name__}: {str(err).strip()[-300:]}", flush=True)
            continue
        if args.order:
            for order in loop_orders(fused_sass.disassemble(cubin)):
                print("    loop: " + " ".join(f"{name}x{count}" if count > 1 else name for name, count in order))


if __name__ == "__main__":
    main()
