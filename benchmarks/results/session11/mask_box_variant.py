"""Writes a copy of ops/fused/kernels.py whose 3-D forward masks a partial key box in one select, with the per-axis
window tests made on the box's axes ([rows, U0], [rows, U1], [rows, U2]) and broadcast over the box reshaped to
[rows, U0, U1, U2] (session 11: the column structure the flat [rows, keys] compares hide from the compiler).
Usage: python3 mask_box_variant.py SRC DST"""
import sys

src, dst = sys.argv[1:]
s = open(src).read()
helper = '''@triton.jit
def _mask_box_3d(x, fill, k0, k1, k2, start0, stop0, start1, stop1, start2, stop2,
                 U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr):
    """``x`` [rows, U0 * U1 * U2] with ``fill`` outside each row's window, tested per axis on the box's own axes."""
    rows: tl.constexpr = x.shape[0]
    a0 = k0 + tl.arange(0, U0)
    a1 = k1 + tl.arange(0, U1)
    a2 = k2 + tl.arange(0, U2)
    keep0 = (a0[None, :] >= start0[:, None]) & (a0[None, :] < stop0[:, None])
    keep1 = (a1[None, :] >= start1[:, None]) & (a1[None, :] < stop1[:, None])
    keep2 = (a2[None, :] >= start2[:, None]) & (a2[None, :] < stop2[:, None])
    keep = keep0[:, :, None, None] & keep1[:, None, :, None] & keep2[:, None, None, :]
    x4 = tl.where(keep, tl.reshape(x, [rows, U0, U1, U2]), fill)
    return tl.reshape(x4, [rows, U0 * U1 * U2])


@triton.jit
def _group_descriptor('''
assert s.count("@triton.jit\ndef _group_descriptor(") == 1
s = s.replace("@triton.jit\ndef _group_descriptor(", helper, 1)
old = '''        s = _mask_outside(s, float("-inf"), k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2,
                          start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, U0, U1, U2, ACT0, ACT1, False)'''
new = '''        if ACT0:
            if (k0 < in_lo0) | (k0 + U0 > in_hi0) | (k1 < in_lo1) | (k1 + U1 > in_hi1) | (k2 < in_lo2) | \\
                    (k2 + U2 > in_hi2):
                s = _mask_box_3d(s, float("-inf"), k0, k1, k2, start0, stop0, start1, stop1, start2, stop2, U0, U1, U2)
        else:
            s = _mask_outside(s, float("-inf"), k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2,
                              start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, U0, U1, U2, ACT0, ACT1, False)'''
assert s.count(old) == 1
open(dst, "w").write(s.replace(old, new))
