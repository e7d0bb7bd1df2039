"""Writes a copy of ops/fused/kernels.py with a variant of the 3-D mask (session 11 experiment; not kept unless
timed faster).  Usage: python3 mask_variant.py SRC DST {all3|any}

all3: where all three axes of a 3-D key box are partial (3d-causal: nearly every box), one select on the combined
      keep instead of three selects; boxes partial on fewer axes keep the per-axis selects.
any:  one combined select whenever any axis is partial (what 1-D / 2-D do)."""
import sys

src, dst, mode = sys.argv[1:]
s = open(src).read()
old = """    if ACT0:
        if part2:
            x = tl.where(_axis_keep(kj2, start2, stop2, TRANSPOSED), x, fill)
        if part1:
            x = tl.where(_axis_keep(kj1, start1, stop1, TRANSPOSED), x, fill)
        if (k0 < in_lo0) | (k0 + U0 > in_hi0):
            x = tl.where(_axis_keep(kj0, start0, stop0, TRANSPOSED), x, fill)
"""
assert old in s
if mode == "all3":
    new = """    if ACT0:
        part0 = (k0 < in_lo0) | (k0 + U0 > in_hi0)
        if part2 & part1 & part0:
            keep = _axis_keep(kj2, start2, stop2, TRANSPOSED) & _axis_keep(kj1, start1, stop1, TRANSPOSED)
            x = tl.where(keep & _axis_keep(kj0, start0, stop0, TRANSPOSED), x, fill)
        else:
            if part2:
                x = tl.where(_axis_keep(kj2, start2, stop2, TRANSPOSED), x, fill)
            if part1:
                x = tl.where(_axis_keep(kj1, start1, stop1, TRANSPOSED), x, fill)
            if part0:
                x = tl.where(_axis_keep(kj0, start0, stop0, TRANSPOSED), x, fill)
"""
else:
    new = """    if ACT0:
        if part2 | part1 | ((k0 < in_lo0) | (k0 + U0 > in_hi0)):
            keep = _axis_keep(kj2, start2, stop2, TRANSPOSED) & _axis_keep(kj1, start1, stop1, TRANSPOSED)
            x = tl.where(keep & _axis_keep(kj0, start0, stop0, TRANSPOSED), x, fill)
"""
open(dst, "w").write(s.replace(old, new))
