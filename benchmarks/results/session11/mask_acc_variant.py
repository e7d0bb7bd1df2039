"""Writes a copy of ops/fused/kernels.py whose 3-D forward (FOLD_SCALE: positive scale, no RPB) masks a partial key box
by starting the score matmul from a bias tile (0 inside each query's window, -inf outside) instead of selecting
-inf afterwards (session 11).  Each axis' bias takes few distinct values per thread, so after common-subexpression
elimination the tile costs about two adds per element, against one select per element and partial axis.
Usage: python3 mask_acc_variant.py SRC DST"""
import sys

src, dst = sys.argv[1:]
s = open(src).read()
helper = '''@triton.jit
def _window_bias_3d(start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2):
    """[rows, keys] float32: 0 where the key lies in the row's window on all three axes, else -inf."""
    b0 = tl.where((kj0[None, :] >= start0[:, None]) & (kj0[None, :] < stop0[:, None]), 0.0, float("-inf"))
    b1 = tl.where((kj1[None, :] >= start1[:, None]) & (kj1[None, :] < stop1[:, None]), 0.0, float("-inf"))
    b2 = tl.where((kj2[None, :] >= start2[:, None]) & (kj2[None, :] < stop2[:, None]), 0.0, float("-inf"))
    return b0 + b1 + b2


@triton.jit
def _group_descriptor('''
assert s.count("@triton.jit\ndef _group_descriptor(") == 1
s = s.replace("@triton.jit\ndef _group_descriptor(", helper, 1)
old = '''        s = tl.dot(q, tl.trans(k))
        if FOLD_SCALE:  # scale > 0, no bias: max of the raw logits, the scale folded into exp2's FMA
            s_scale = qk_scale
        else:'''
new = '''        if FOLD_SCALE & ACT0:
            part = (k0 < in_lo0) | (k0 + U0 > in_hi0) | (k1 < in_lo1) | (k1 + U1 > in_hi1) | (k2 < in_lo2) | \\
                (k2 + U2 > in_hi2)
            if part:
                s = tl.dot(q, tl.trans(k), _window_bias_3d(start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2))
            else:
                s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k))
        if FOLD_SCALE:  # scale > 0, no bias: max of the raw logits, the scale folded into exp2's FMA
            s_scale = qk_scale
        else:'''
assert s.count(old) == 1
s = s.replace(old, new)
old = '''        s = _mask_outside(s, float("-inf"), k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2,
                          start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, U0, U1, U2, ACT0, ACT1, False)'''
new = '''        if not (FOLD_SCALE & ACT0):
            s = _mask_outside(s, float("-inf"), k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2,
                              start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, U0, U1, U2, ACT0, ACT1, False)'''
assert s.count(old) == 1
open(dst, "w").write(s.replace(old, new))
