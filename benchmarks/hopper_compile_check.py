"""Compile the Hopper kernels (Gluon: the forward in ``ops/fused/hopper.py``, dQ in ``ops/fused/hopper_dq.py``, dK/dV
in ``ops/fused/hopper_dkdv.py``) for sm_90 without a GPU and report their resources.

    python benchmarks/hopper_compile_check.py

Like ``fused_compile_check.py``: Triton's ahead-of-time path and the ptxas bundled with Triton, so a Gluon error,
a register spill or a missing ``wgmma`` / ``setmaxnreg`` shows before any device time is spent.  Gluon changes from
one Triton release to the next: check with the device's Triton version (a separate environment, e.g.
``pip install --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``).
"""
import math
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fused_compile_check import ptxas_usage  # noqa: E402
from ops.fused import hopper, hopper_dkdv, hopper_dq  # noqa: E402

# (kernel, query tile, key tile, head dim): the tiles ``tiles.choose_tiles`` gives 1-D (forward only), 2-D and 3-D
# problems (dK/dV: 128-key tiles where no box is masked, 64-key tiles elsewhere)
CASES = [("fwd", (1, 1, 128), (1, 1, 128), 128), ("fwd", (1, 8, 16), (1, 8, 16), 128),
         ("fwd", (2, 8, 8), (2, 8, 8), 128), ("fwd", (1, 8, 16), (2, 8, 8), 64),
         ("dq", (1, 1, 128), (1, 1, 128), 128), ("dq", (1, 8, 16), (1, 8, 16), 128),
         ("dq", (2, 8, 8), (2, 8, 8), 128), ("dq", (1, 8, 16), (2, 8, 8), 64),
         ("dkdv", (1, 4, 16), (1, 8, 16), 128), ("dkdv", (1, 8, 8), (2, 8, 8), 128), ("dkdv", (1, 4, 16), (1, 8, 16), 64),
         ("dkdv", (1, 8, 8), (1, 8, 8), 128), ("dkdv", (4, 4, 4), (2, 8, 4), 128), ("dkdv", (4, 4, 4), (2, 8, 4), 64)]
POINTERS = {"O": "*bf16", "DQ": "*bf16", "DLSE": "*fp32", "QUERY_RANGES": "*i32", "DK": "*bf16", "DV": "*bf16",
            "LSE": "*fp32", "DELTA": "*fp32", "FLAGS": "*i8",
            "STARTS": "*i32", "SPANS": "*i32", "ROW_OFFSETS": "*i32", "KEY_OFFSETS": "*i32"}
FLOATS = ("qk_scale", "scale")


def _descriptor_type(box, dim):
    from triton.experimental.gluon import language as gl

    block = [1, *box, dim]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"


def compile_case(kernel, q_tile, kv_tile, dim):
    from triton.experimental.gluon._runtime import GluonASTSource

    if kernel in ("fwd", "dq"):  # each consumer reads its half of the query box
        module, fn = (hopper, hopper.na_fwd_hopper_kernel) if kernel == "fwd" else (hopper_dq,
                                                                                    hopper_dq.na_bwd_dq_hopper_kernel)
        half = hopper.half_box(q_tile)[0]
        boxes = {"q_desc": half, "do_desc": half, "k_desc": kv_tile, "v_desc": kv_tile}
    else:  # each consumer holds 64 keys: its half of a 128-key tile, or all of a 64-key one
        module, fn = hopper_dkdv, hopper_dkdv.na_bwd_dkdv_hopper_kernel
        keys = hopper.half_box(kv_tile)[0] if math.prod(kv_tile) == 128 else kv_tile
        boxes = {"k_desc": keys, "v_desc": keys, "q_desc": q_tile, "do_desc": q_tile}
    constexprs = dict(STAGES_=module.STAGES, CONSUMER_REGS_=module.CONSUMER_REGS, PRODUCER_REGS_=module.PRODUCER_REGS)
    options = {"num_warps": 4}
    if kernel == "dkdv":
        constexprs["CONSUMERS_"] = math.prod(kv_tile) // 64
        if constexprs["CONSUMERS_"] == 1:
            options["maxnreg"] = 128
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in boxes:
            signature[name] = _descriptor_type(boxes[name], dim)
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    ptx = compiled.asm["ptx"]
    return ptxas_usage(ptx), "wgmma" in ptx, ptx.count("setmaxnreg")


def main():
    if hopper.gluon is None:
        sys.exit("this Triton has no Gluon")
    for kernel, q_tile, kv_tile, dim in CASES:
        try:
            (regs, spill), wgmma, setmaxnreg = compile_case(kernel, q_tile, kv_tile, dim)
            print(f"{kernel} q {q_tile} kv {kv_tile} D {dim}: ok  regs={regs} spill_bytes={spill} wgmma={wgmma} "
                  f"setmaxnreg={setmaxnreg}", flush=True)
        except Exception as err:  # report every case
            print(f"{kernel} q {q_tile} kv {kv_tile} D {dim}: FAIL {type(err).__name__}: {str(err).strip()[-300:]}", flush=True)


if __name__ == "__main__":
    main()
