"""Compile the fused kernels for Hopper (sm_90) without a GPU and report registers / spills.

    python benchmarks/fused_compile_check.py [kernel ...]

Uses Triton's ahead-of-time path (ASTSource + GPUTarget) and the ptxas bundled with Triton, so a
compile failure or a register spill shows up here before any device time is spent.  The local
Triton may be newer than the device's; a kernel that compiles here can still fail there.  The
kernels are loaded without importing ``ops`` (so no torch), which lets a separate environment with
the device's Triton version run this file too.  ``tma_loads`` counts the bulk copies in the
compiled kernel and ``smem_reshape`` whether the N-D tiles reach the matmul without a register trip.
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ.pop("TRITON_INTERPRET", None)
FUSED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops", "fused")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


def _load_kernels():
    """ops/fused/kernels.py (and the window_jit it imports) as a package of their own."""
    pkg = types.ModuleType("_fused_kernels")
    pkg.__path__ = [FUSED_DIR]
    sys.modules["_fused_kernels"] = pkg
    for name in ("window_jit", "kernels"):
        spec = importlib.util.spec_from_file_location(f"_fused_kernels.{name}", os.path.join(FUSED_DIR, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["_fused_kernels.kernels"]


kernels = _load_kernels()

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

POINTERS = {"Q", "Kp", "V", "RPB", "O", "LSE", "DO", "DELTA", "DQ", "DK", "DV", "DRPB", "K_DESC", "V_DESC", "Q_DESC",
            "DO_DESC", "DSW", "BIAS", "DLSE"}
FLOATS = {"qk_scale", "scale"}
# host-built descriptors (``HOST_DESC``): the tile their box spans (U: key tile, T: query tile) and its row width
DESCRIPTOR_BOXES = {"K_DESC": ("U", "BLOCK_D"), "V_DESC": ("U", "BLOCK_DV"), "Q_DESC": ("T", "BLOCK_D"),
                    "DO_DESC": ("T", "BLOCK_DV")}


def signature(fn, constexprs, dtype):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in DESCRIPTOR_BOXES and constexprs.get("HOST_DESC"):
            tile, width = DESCRIPTOR_BOXES[name]
            box = ",".join(str(constexprs[f"{tile}{axis}"]) for axis in range(3))
            sig[name] = f"tensordesc<{dtype}[1,{box},{constexprs[width]}]>"
        elif name in POINTERS:
            fp32 = name in ("RPB", "LSE", "DELTA", "DRPB", "DSW")
            sig[name] = "*fp32" if fp32 else f"*{dtype}"
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(fn, constexprs, dtype="bf16", num_warps=4, num_stages=2):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in POINTERS}
    src = triton.compiler.ASTSource(fn, signature(fn, constexprs, dtype), constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    regs, spill = ptxas_usage(ptx)
    ttgir = compiled.asm["ttgir"]
    extra = dict(wgmma="wgmma" in ptx, tma_loads=ttgir.count("async_tma_copy_global_to_local"),
                 smem_reshape="memdesc_reshape" in ttgir)
    return regs, spill, extra


def ptxas_usage(ptx: str) -> tuple:
    """(registers per thread, spilled bytes or None) of a kernel's PTX, from ``ptxas -v`` for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(ptx)
    report = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", fh.name, "-o", os.devnull], capture_output=True,
                            text=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    return int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None


def window_constexprs(rank, q_tile, kv_tile, d, dv, rpb=False, causal=(False, False, False)):
    return dict(CAUSAL0=causal[0], CAUSAL1=causal[1], CAUSAL2=causal[2], ACT0=rank >= 3, ACT1=rank >= 2,
                T0=q_tile[0], T1=q_tile[1], T2=q_tile[2], U0=kv_tile[0], U1=kv_tile[1], U2=kv_tile[2],
                BLOCK_D=d, BLOCK_DV=dv, HAS_RPB=rpb, IDX64=False)


def launcher_defaults(fn, constexprs):
    """``constexprs`` plus the launcher's bf16 values of those the cases do not vary (where the kernel has them):
    Triton's default dot precision, and the rows per step of the window-offset loops (``decide.gather_rows``)."""
    extra = {}
    if "PREC" in fn.arg_names:
        extra["PREC"] = "tf32"
    if "GATHER_ROWS" in fn.arg_names:
        extra["GATHER_ROWS"] = max(2, 128 // max(constexprs["BLOCK_D"], constexprs["BLOCK_DV"]))
    return dict(constexprs, **extra)


CASES = {
    "fwd-1d-d128": (kernels.na_fwd_kernel, window_constexprs(1, (1, 1, 128), (1, 1, 64), 128, 128), 8, 3),
    "fwd-2d-d32-rpb": (kernels.na_fwd_kernel, window_constexprs(2, (1, 8, 16), (1, 8, 8), 32, 32, True), 4, 3),
    "fwd-3d-d64-causal": (kernels.na_fwd_kernel,
                          window_constexprs(3, (2, 8, 8), (2, 4, 8), 64, 64, causal=(True, False, False)), 4, 3),
    "fwd-1d-d128-tma": (kernels.na_fwd_kernel, window_constexprs(1, (1, 1, 128), (1, 1, 64), 128, 128), 8, 3, True),
    "fwd-2d-d128-tma": (kernels.na_fwd_kernel, window_constexprs(2, (1, 8, 8), (1, 8, 8), 128, 128), 4, 3, True),
    "fwd-3d-d128-tma": (kernels.na_fwd_kernel, window_constexprs(3, (2, 8, 8), (1, 2, 32), 128, 128), 8, 3, True),
    "fwd-2d-d32-rpb-tma": (kernels.na_fwd_kernel, window_constexprs(2, (1, 8, 16), (1, 8, 8), 32, 32, True), 4, 3,
                           True),
    "fwd-3d-d64-causal-tma-host": (kernels.na_fwd_kernel, window_constexprs(3, (4, 2, 8), (4, 8, 2), 64, 64,
                                                                       causal=(True, False, False)), 4, 3, True),
    "fwd-2d-d32-tma-host": (kernels.na_fwd_kernel, window_constexprs(2, (1, 2, 8), (1, 4, 16), 32, 32), 1, 2, True),
    "dq-1d-d128": (kernels.na_bwd_dq_kernel, window_constexprs(1, (1, 1, 64), (1, 1, 64), 128, 128), 4, 2),
    "dq-2d-d32-rpb": (kernels.na_bwd_dq_kernel, window_constexprs(2, (1, 8, 8), (1, 8, 8), 32, 32, True), 4, 2),
    "dkdv-1d-d128": (kernels.na_bwd_dkdv_kernel, window_constexprs(1, (1, 1, 64), (1, 1, 32), 128, 128), 8, 2),
    "dkdv-2d-d32-rpb": (kernels.na_bwd_dkdv_kernel, window_constexprs(2, (1, 8, 8), (1, 8, 8), 32, 32, True), 8,
                        2),
    "dkdv-3d-d64-causal": (kernels.na_bwd_dkdv_kernel,
                           window_constexprs(3, (2, 4, 8), (2, 4, 8), 64, 64, causal=(True, False, False)), 4, 2),
    "dq-2d-d128-tma": (kernels.na_bwd_dq_kernel, window_constexprs(2, (1, 8, 8), (1, 8, 8), 128, 128), 4, 2, True),
    "dq-2d-d32-rpb-tma-host": (kernels.na_bwd_dq_kernel, window_constexprs(2, (1, 2, 8), (1, 4, 8), 32, 32, True), 1,
                               2, True),
    "dkdv-2d-d128-tma": (kernels.na_bwd_dkdv_kernel, window_constexprs(2, (1, 8, 8), (1, 8, 8), 128, 128), 4, 2,
                         True),
    "dkdv-3d-d128-tma": (kernels.na_bwd_dkdv_kernel, window_constexprs(3, (1, 2, 32), (2, 8, 8), 128, 128), 8, 2,
                         True),
    "dkdv-2d-d32-rpb-tma-host": (kernels.na_bwd_dkdv_kernel, window_constexprs(2, (1, 2, 8), (1, 4, 8), 32, 32, True),
                                 1, 2, True),
    "dkdv-2d-d128-tma-host": (kernels.na_bwd_dkdv_kernel, window_constexprs(2, (1, 8, 8), (1, 8, 8), 128, 128), 4, 2,
                              True),
    "dkdv-3d-d128-tma-w4": (kernels.na_bwd_dkdv_kernel, window_constexprs(3, (1, 2, 32), (2, 4, 8), 128, 128), 4, 2,
                            True),
    "drpb-2d-d32": (kernels.na_bwd_drpb_kernel,
                    dict(CAUSAL0=False, CAUSAL1=False, CAUSAL2=False, T0=1, T1=8, T2=8, BLOCK_D=32, BLOCK_DV=32,
                         ATOMIC=False, IDX64=False), 4, 1),
}


def main(names):
    for name, (fn, constexprs, warps, stages, *tma) in CASES.items():
        if names and not any(n in name for n in names):
            continue
        if fn is kernels.na_bwd_dkdv_kernel:
            rows = constexprs["T0"] * constexprs["T1"] * constexprs["T2"]
            constexprs = dict(constexprs, BISECT=12, QUERY_ROWS=rows >= 64)
        if fn in (kernels.na_fwd_kernel, kernels.na_bwd_dq_kernel, kernels.na_bwd_dkdv_kernel):
            # RPB comes as precomputed bias tiles (the launcher's choice at a positive scale)
            constexprs = dict(constexprs, BIAS_TILES=constexprs["HAS_RPB"])
        if fn is kernels.na_fwd_kernel:
            constexprs = dict(constexprs, FOLD_SCALE=True, STORE_LSE=True)
        if fn is kernels.na_bwd_dq_kernel:  # with RPB dS goes to its gradient, in the bias tiles' layout
            constexprs = dict(constexprs, STORE_DS=False, DS_ATOMIC=constexprs["HAS_RPB"],
                              DS_BOXES=constexprs["HAS_RPB"], HAS_DLSE=False)
        if fn in (kernels.na_fwd_kernel, kernels.na_bwd_dq_kernel, kernels.na_bwd_dkdv_kernel):
            # the mask as the score dot's initial value in the 3-D cases and with bias tiles (which hold it)
            constexprs = dict(constexprs, MASK_IN_DOT=constexprs["ACT0"] or constexprs["BIAS_TILES"])
        if fn in (kernels.na_fwd_kernel, kernels.na_bwd_dq_kernel, kernels.na_bwd_dkdv_kernel):
            constexprs = dict(constexprs, HOST_DESC=name.endswith("-host"))
        if fn is not kernels.na_bwd_drpb_kernel:
            constexprs = dict(constexprs, TMA=bool(tma and tma[0]))
        constexprs = launcher_defaults(fn, constexprs)
        try:
            regs, spill, extra = compile_one(fn, constexprs, num_warps=warps, num_stages=stages)
            extra = " ".join(f"{k}={v}" for k, v in extra.items())
            print(f"{name:24s} ok   regs={regs} spill_bytes={spill} {extra}", flush=True)
        except Exception as err:
            msg = str(err).strip().splitlines()
            print(f"{name:24s} FAIL {type(err).__name__}: {msg[-1] if msg else ''}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
