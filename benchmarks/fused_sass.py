"""Instruction counts of a fused kernel's sm_90 SASS per basic block, for one problem and tile (no GPU needed).

    python benchmarks/fused_sass.py 128,2,32,56x56,7x7 --outer 1x2x8 --inner 1x4x16 --warps 1 --stages 2 \\
        --maxnreg 112 --tma --host-desc
    python benchmarks/fused_sass.py 2,16,64,16x32x32,5x7x7,1,1,1x0x0 --outer 4x2x8 --inner 4x8x2 --tma --host-desc

The problem is ``B,H,D,spatial,K[,stride,dilation,causal]`` as in ``ops.bench --custom`` (without the name).  The
kernel is compiled the way the launcher's call compiles it: integer arguments equal to 1 become constants and
multiples of 16 carry the divisibility hint, so the counts match the code that runs.  For each basic block the script
prints its instruction count, whether it sits inside a loop (between a backward branch and its target) and its most
frequent opcodes; the sum over a loop's blocks is the static cost of one step.  Static counts are an upper bound on a
step's dynamic count where a block is branched around (masks of unmasked tiles).  A last line gives ptxas'
registers and spills, the shared memory, and the programs an H100 SM holds by each limit.
Like ``fused_compile_check.py`` it loads the kernels without importing ``ops`` (no torch), so an environment with
the device's Triton version can run it.
"""
import argparse
import collections
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _compile_check_module():
    spec = importlib.util.spec_from_file_location("fused_compile_check", os.path.join(HERE, "fused_compile_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_problem(text: str):
    """(B, H, D, spatial, K, stride, dilation, causal) of an ``ops.spec`` problem spec, defaults filled in."""
    spec = importlib.util.spec_from_file_location("_ops_spec", os.path.join(os.path.dirname(HERE), "ops", "spec.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        f = module.parse_problem_spec(text)
    except ValueError as err:
        raise SystemExit(f"problem: {err}") from None
    ones = (1,) * len(f["spatial"])
    return (f["batch"], f["heads"], f["dim"], f["spatial"], f["kernel_size"], f["stride"] or ones,
            f["dilation"] or ones, f["causal"] or (False,) * len(f["spatial"]))


def pad3(t, fill):
    return (fill,) * (3 - len(t)) + tuple(t)


def int_arguments(fn, b, h, d, spatial, kernel_size, stride, dilation, outer, inner):
    """The kernel's integer arguments for contiguous [B, N, H, D] tensors (lse / delta: [B, N, H])."""
    L, K, S, D = pad3(spatial, 1), pad3(kernel_size, 1), pad3(stride, 1), pad3(dilation, 1)
    n = math.prod(L)
    values = dict(HQ=h, HKV=h, GROUP=1, HEAD_DIM=d, VALUE_DIM=d)
    for i in range(3):
        groups = -(-L[i] // D[i])
        values.update({f"L{i}": L[i], f"K{i}": K[i], f"S{i}": S[i], f"D{i}": D[i],
                       f"NT{i}": -(-groups // outer[i]), f"NU{i}": -(-groups // outer[i])})
    # the most key boxes a program visits (``tiles.max_boxes``, which needs torch); the kernels use it only to address
    # bias tiles, so the compile sees only whether it is 1 or a multiple of 16, and this bound keeps that for
    # unstrided windows: a tile of ``outer`` positions reaches at most ``outer + K - 1`` of them per axis
    values["BOXES"] = math.prod(-(-(t + k - 1) // u) for t, k, u in zip(outer, K, inner))
    for name in fn.arg_names:
        if re.fullmatch(r"s[a-z]{0,2}[bth]", name):  # strides: batch, token, head
            rows = name.startswith("sl")  # lse / delta have no head dim
            values[name] = {"b": n * h * (1 if rows else d), "t": h * (1 if rows else d), "h": 1 if rows else d}[name[-1]]
    return values


def build(fn, constexprs, ints, warps, stages, maxnreg, cc):
    import triton
    from triton.backends.compiler import GPUTarget

    # fused_compile_check's signature and pointer hints, plus the launcher's integer specialisation
    signature, constants = cc.signature(fn, constexprs, "bf16"), dict(constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in cc.POINTERS}
    for i, name in enumerate(fn.arg_names):
        if signature[name] != "i32":
            continue
        if ints[name] == 1:  # ints equal to 1 become constants
            signature[name] = "constexpr"
            constants[name] = 1
        elif ints[name] % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": warps, "num_stages": stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constants, attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return disassemble(compiled.asm["cubin"]), compiled


def disassemble(cubin: bytes) -> str:
    """The SASS of a compiled kernel, from the nvdisasm bundled with Triton."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


# An H100 SM (sm_90): 64K registers allocated per warp in units of 256, 228 KiB of shared memory of which each
# resident program also takes 1 KiB for the driver, at most 64 warps and 32 programs.
SM_REGISTERS, REGISTER_UNIT, SM_SHARED, SHARED_PER_PROGRAM, SM_WARPS, SM_PROGRAMS = 65536, 256, 233472, 1024, 64, 32


def programs_per_sm(registers: int, shared: int, warps: int) -> dict:
    """Programs one SM holds by each limit (and overall) for a kernel's registers per thread and shared memory."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    limits = {"registers": SM_REGISTERS // (per_warp * warps), "shared memory": SM_SHARED // (shared + SHARED_PER_PROGRAM),
              "warps": SM_WARPS // warps}
    return {**limits, "programs": min(SM_PROGRAMS, *limits.values())}


def resources(compiled, cc) -> tuple[int, int, int]:
    """(registers per thread, spilled bytes, shared memory bytes) of a compiled kernel, from ptxas' report."""
    registers, spills = cc.ptxas_usage(compiled.asm["ptx"])
    return registers, spills or 0, compiled.metadata.shared


def blocks(sass: str):
    """[(label, [(address, opcode, branch target, instruction)])] in program order; the instruction without its
    predicate."""
    out, current = [], ("entry", [])
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            out.append(current)
            current = (label.group(1), [])
            continue
        ins = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if ins:
            text = re.sub(r"^@!?U?P\w+\s+", "", ins.group(2))
            target = re.search(r"`\((\.L_x_\d+)\)", text)
            current[1].append((int(ins.group(1), 16), text.split()[0].split(".")[0], target and target.group(1), text))
    out.append(current)
    return [b for b in out if b[1]]


def last_exit(found) -> int:
    """The address of the last EXIT of ``blocks``' output: ptxas places the retry loops of barrier waits after it."""
    return max(address for _, ins in found for address, op, *_ in ins if op == "EXIT")


def loop_ranges(found) -> list:
    """(first, last address) of each backward branch's range in ``blocks``' output, the kernel's loops; the
    out-of-line retry loops of barrier waits after the last EXIT are not among them."""
    start = {label: ins[0][0] for label, ins in found}
    end = last_exit(found)
    return [(start[target], address) for _, ins in found for address, _, target, _ in ins
            if target in start and start[target] <= address <= end]


def report(sass: str) -> None:
    found = blocks(sass)
    end = last_exit(found)
    loops = loop_ranges(found)
    total = 0
    print(f"{'block':>10} {'instr':>6} {'loop':>5}  opcodes")
    for label, ins in found:
        ops = [op for _, op, *_ in ins if op != "NOP"]
        total += len(ops)
        inside = any(lo <= ins[0][0] <= hi for lo, hi in loops)
        if ins[0][0] > end:
            label += "*"  # out of line, after the last EXIT
        top = " ".join(f"{k}:{v}" for k, v in collections.Counter(ops).most_common(10))
        print(f"{label:>10} {len(ops):>6} {'yes' if inside else '':>5}  {top}")
    print(f"{'total':>10} {total:>6}   (* = out-of-line blocks after the last EXIT: barrier-wait retries)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problem", help="B,H,D,spatial,K[,stride,dilation,causal] (per-axis values joined by 'x')")
    ap.add_argument("--kernel", choices=["fwd", "dq", "dkdv"], default="fwd")
    ap.add_argument("--outer", required=True, help="outer tile, e.g. 1x2x8 (queries for fwd / dq, keys for dkdv)")
    ap.add_argument("--inner", required=True, help="inner tile, e.g. 1x4x16")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--tma", action="store_true", help="TMA loads of the looped-over tiles")
    ap.add_argument("--host-desc", action="store_true", help="descriptors built on the host (K/V; Q/dO in dK/dV)")
    ap.add_argument("--rpb", action="store_true")
    ap.add_argument("--lse", action="store_true", help="fwd: store lse (training; ops.bench's forward does not)")
    ap.add_argument("--dump", metavar="FILE", help="also write the whole SASS listing to FILE")
    ap.add_argument("--mask-in-dot", action="store_true", help="masks as the score matmul's initial value")
    ap.add_argument("--gather-rpb", action="store_true", help="with --rpb: gather the bias per element (no bias tiles)")
    args = ap.parse_args()

    b, h, d, spatial, kernel_size, stride, dilation, causal = parse_problem(args.problem)
    outer = tuple(int(x) for x in args.outer.split("x"))
    inner = tuple(int(x) for x in args.inner.split("x"))
    outer, inner = pad3(outer, 1), pad3(inner, 1)
    cc = _compile_check_module()
    fn = {"fwd": cc.kernels.na_fwd_kernel, "dq": cc.kernels.na_bwd_dq_kernel, "dkdv": cc.kernels.na_bwd_dkdv_kernel}[
        args.kernel]
    q_tile, kv_tile = (inner, outer) if args.kernel == "dkdv" else (outer, inner)
    block = max(16, 1 << (d - 1).bit_length())
    constexprs = cc.window_constexprs(len(spatial), q_tile, kv_tile, block, block, args.rpb, pad3(causal, False))
    constexprs["TMA"] = args.tma
    # with RPB the scores start from precomputed bias tiles (which hold the mask), unless --gather-rpb
    tiles = args.rpb and not args.gather_rpb
    constexprs["BIAS_TILES"] = tiles
    if args.kernel == "fwd":
        constexprs.update(FOLD_SCALE=tiles or not args.rpb, HOST_DESC=args.tma and args.host_desc, STORE_LSE=args.lse,
                          MASK_IN_DOT=tiles or (args.mask_in_dot and not args.rpb))
    elif args.kernel == "dq":  # with RPB, dQ adds dS up for its gradient (ops/fused/rpb_grad.py): in the bias tiles'
        # layout with them, else in window layout
        constexprs.update(HOST_DESC=args.tma and args.host_desc, STORE_DS=args.rpb and not tiles, DS_ATOMIC=args.rpb,
                          DS_BOXES=tiles, MASK_IN_DOT=tiles or args.mask_in_dot, HAS_DLSE=False)
    elif args.kernel == "dkdv":
        groups = [-(-L // dl) for L, dl in zip(spatial, dilation)]
        constexprs.update(BISECT=max(g.bit_length() for g in groups), QUERY_ROWS=math.prod(q_tile) >= 64,
                          HOST_DESC=args.tma and args.host_desc, MASK_IN_DOT=tiles or args.mask_in_dot)
    constexprs = cc.launcher_defaults(fn, constexprs)
    ints = int_arguments(fn, b, h, d, spatial, kernel_size, stride, dilation, outer, inner)
    sass, compiled = build(fn, constexprs, ints, args.warps, args.stages, args.maxnreg, cc)
    report(sass)
    if args.dump:
        with open(args.dump, "w") as fh:
            fh.write(sass)
    registers, spills, shared = resources(compiled, cc)
    fit = programs_per_sm(registers, shared, args.warps)
    print(f"registers {registers} (spills {spills} B), shared memory {shared} B: {fit['programs']} programs per SM "
          f"(by registers {fit['registers']}, shared memory {fit['shared memory']}, warps {fit['warps']}; H100)")


if __name__ == "__main__":
    sys.exit(main())
