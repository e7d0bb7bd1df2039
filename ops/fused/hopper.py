"""The forward on Hopper (sm_90): one warp-specialised kernel for large windows.

Triton's Hopper warp specialisation (``tl.range(..., warp_specialize=True)``) splits the kernel's key loop into a
producer warpgroup that issues the K/V bulk copies into a ring of shared-memory stages, and two consumer
warpgroups that each own 64 of the tile's 128 query rows and run the two matmuls and the online softmax; the stages
are handed over through mbarriers, so the copies, the matmuls and one consumer's softmax overlap the other's work.
The portable kernel (``kernels.na_fwd_kernel``) runs all of that in one warpgroup, where the softmax waits for its
own matmuls.

What the compiler's partitioner accepts shapes the kernel:

* K/V tiles are N-D boxes read through host-built descriptors (``launch.host_kv_layouts``) and reshaped to
  ``[128, D]`` in shared memory; the query tile cannot be reshaped (the partitioner splits it by rows), so the host
  first copies Q in tile order (``tile_major``: ``[B, H, tiles, 128, D]``, one 2-D descriptor box per program).
  That copy reads and writes Q once, about 2% of a 2-D or 3-D problem with a large window.
* The loop body has no branches: a partial key tile is masked by one select on every tile (``MASK``), or not at
  all where the host found every tile of every program inside all its queries' windows (``partial_tiles``), as in
  the strided problems.
* A program whose result holds a NaN or an infinity cannot recompute its rows inside the loop's kernel (a second
  loop keeps the partitioner away), so it raises a flag; ``na_fwd_nonfinite_kernel`` then recomputes the flagged
  programs' rows one window offset at a time (``kernels._attend_by_offset``), which keeps non-finite values inside
  the windows that hold them, as the portable kernel does.

It runs where it is built for: 16-bit inputs, head dim 64 or 128 (= value dim), no RPB, positive scale, no
dilation, heads packed per token, and windows of at least ``MIN_WINDOW`` keys (small windows waste most of a
128 x 128 tile). Everything else, and any GPU but sm_90, takes the portable kernel; ``NAMODELS_HOPPER=0`` (or
``ENABLED = False``) forces it.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import kernels, tiles
from .kernels import LN2_C, _attend_by_offset, _axis_keep, _program_group, _query_tile
from ..window import NAParams

ENABLED = os.environ.get("NAMODELS_HOPPER", "1") != "0"
ROWS = 128  # query rows per program (two consumer warpgroups of 64)
COLS = 128  # keys per loop step
HEAD_DIMS = (64, 128)
MIN_WINDOW = 1024
STAGES = 2  # K/V shared-memory stages: two 128 x 128 16-bit tiles each (64 KB)


@contextlib.contextmanager
def disabled():
    """Plans made inside take the portable kernel (benchmarks and tests compare the two in one process)."""
    global ENABLED
    was, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = was


@triton.jit
def na_fwd_ws_kernel(
    Q, Kp, V, O, LSE, FLAGS, Q_DESC, K_DESC, V_DESC,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slt,
    HQ, GROUP, qk_scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, NT0, NT1, NT2,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
    BLOCK_D: tl.constexpr, IDX64: tl.constexpr, STORE_LSE: tl.constexpr, MASK: tl.constexpr,
):
    # Q_DESC: Q in tile order (``tile_major``), one [T0 * T1 * T2, BLOCK_D] box per program; K_DESC / V_DESC: K and V
    # as [B, L0, L1, L2, heads * BLOCK_D] in (1, U0, U1, U2, BLOCK_D) boxes.  FLAGS[program, row]: 1 where the row's
    # result holds a NaN / inf (the program's rows are then recomputed by ``na_fwd_nonfinite_kernel``).
    g0, tile0, g1, tile1, g2, tile2, b, h, Lg0, Lg1, Lg2 = _program_group(NT0, NT1, NT2, 1, 1, 1, L0, L1, L2, HQ,
                                                                         ACT0, ACT1)
    hk = h // GROUP
    (q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2,
     lo0, hi0, in_lo0, in_hi0, lo1, hi1, in_lo1, in_hi1, lo2, hi2, in_lo2, in_hi2) = _query_tile(
        tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, 1, 1, 1,
        CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2, IDX64)
    ROWS_: tl.constexpr = T0 * T1 * T2
    COLS_: tl.constexpr = U0 * U1 * U2
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    q = Q_DESC.load([program * ROWS_, 0])
    c = tl.arange(0, COLS_)
    c0 = c // (U1 * U2)
    c1 = (c // U2) % U1
    c2 = c % U2
    m_i = tl.full([ROWS_], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS_], tl.float32)
    acc = tl.zeros([ROWS_, BLOCK_D], tl.float32)
    n1 = tl.cdiv(hi1 - lo1, U1)
    n2 = tl.cdiv(hi2 - lo2, U2)
    n12 = n1 * n2
    col = hk * BLOCK_D
    for t in tl.range(0, tl.cdiv(hi0 - lo0, U0) * n12, warp_specialize=True):
        # two divisions per step are nothing next to a 128 x 128 x 128 step's matmuls
        i0 = t // n12
        i1 = (t - i0 * n12) // n2
        k0 = lo0 + i0 * U0
        k1 = lo1 + i1 * U1
        k2 = lo2 + (t - i0 * n12 - i1 * n2) * U2
        k = K_DESC.load([b, k0, k1, k2, col]).reshape([COLS_, BLOCK_D])
        s = tl.dot(q, tl.trans(k))
        if MASK:  # a select on every tile; tiles inside every query's window keep all their scores
            full = ((k2 >= in_lo2) & (k2 + U2 <= in_hi2) & (k1 >= in_lo1) & (k1 + U1 <= in_hi1)
                    & (k0 >= in_lo0) & (k0 + U0 <= in_hi0))
            keep = _axis_keep(k2 + c2, start2, stop2, False)
            if ACT1:
                keep = keep & _axis_keep(k1 + c1, start1, stop1, False)
            if ACT0:
                keep = keep & _axis_keep(k0 + c0, start0, stop0, False)
            s = tl.where(keep | full, s, float("-inf"))
        # the scale folded into exp2's FMA (positive scale: the max of the raw scores is the max of the scaled ones)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing admitted yet
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = V_DESC.load([b, k0, k1, k2, col]).reshape([COLS_, BLOCK_D])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    # rows past the end of an axis (zeros from the tile-order copy) are computed but never stored
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (1.0 / l_i)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(O + b.to(tl.int64) * sob + h * soh + q_tok[:, None] * sot + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=q_ok[:, None])
    if STORE_LSE:
        lse = (m_i + tl.math.log2(l_i)) * LN2_C
        tl.store(LSE + b.to(tl.int64) * slb + q_tok * slt + h, lse, mask=q_ok)
    # per row: a reduction over the rows would cross the two consumer warpgroups' halves, which the partitioner
    # cannot split
    tl.store(FLAGS + program * ROWS_ + tl.arange(0, ROWS_), (tl.sum(out * 0.0, 1) != 0.0).to(tl.int8))


@triton.jit
def na_fwd_nonfinite_kernel(
    Q, Kp, V, O, LSE, FLAGS,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slt,
    HQ, GROUP, HEAD_DIM, qk_scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, NT0, NT1, NT2,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    BLOCK_D: tl.constexpr, IDX64: tl.constexpr, STORE_LSE: tl.constexpr, SUB: tl.constexpr,
):
    """The rows of the programs that ``na_fwd_ws_kernel`` flagged, again, one window offset at a time; every other
    program reads its flag and ends."""
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    if tl.max(tl.load(FLAGS + program * (T0 * T1 * T2) + tl.arange(0, T0 * T1 * T2)), 0) != 0:
        g0, tile0, g1, tile1, g2, tile2, b, h, Lg0, Lg1, Lg2 = _program_group(NT0, NT1, NT2, 1, 1, 1, L0, L1, L2,
                                                                             HQ, ACT0, ACT1)
        hk = h // GROUP
        b64 = b.to(tl.int64)
        _attend_by_offset(Q, Kp, V, Q, O, LSE, b64 * sqb + h * sqh, b64 * skb + hk * skh, b64 * svb + hk * svh,
                          b64 * sob + h * soh, b64 * slb, sqt, skt, svt, sot, slt, h, tile0, tile1, tile2, g0, g1, g2,
                          Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, 1, 1, 1, HEAD_DIM, HEAD_DIM, qk_scale,
                          CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2, SUB, BLOCK_D, BLOCK_D, False, IDX64, STORE_LSE)


@dataclass(frozen=True)
class HopperForward:
    """A forward problem's launches on the Hopper kernel (``plan``)."""

    q_tile: tuple  # (T0, T1, T2)
    kv_tile: tuple  # (U0, U1, U2)
    tiles_per_axis: tuple  # (NT0, NT1, NT2)
    spatial: tuple  # (L0, L1, L2)
    grid: tuple
    scalars: tuple
    meta: dict
    fixup_meta: dict
    kv_layouts: tuple

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1]


def sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def unsupported(q4, k4, v4, rpb, params: NAParams, scale: float) -> str | None:
    """Why the Hopper kernel cannot run this problem (None where it can); ``q4`` / ``k4`` / ``v4``: ``[B, N, H, D]``."""
    from . import launch  # (launch imports this module)

    if not ENABLED:
        return "disabled (NAMODELS_HOPPER=0)"
    if kernels.interpreted() or not sm90(q4.device):
        return "needs an sm_90 GPU"
    if q4.dtype not in (torch.float16, torch.bfloat16) or not (q4.dtype == k4.dtype == v4.dtype):
        return "needs 16-bit inputs"
    if q4.shape[-1] not in HEAD_DIMS or v4.shape[-1] != q4.shape[-1]:
        return f"needs head dim in {HEAD_DIMS} equal to the value dim"
    if rpb is not None:
        return "no RPB"
    if not scale > 0:
        return "needs a positive scale"
    if any(d != 1 for d in params.dilation):
        return "no dilation"
    if params.window_size < MIN_WINDOW:
        return f"windows under {MIN_WINDOW} keys run faster on the portable kernel's smaller tiles"
    if params.num_tokens < ROWS:
        return "fewer tokens than one query tile"
    if not launch.host_descriptors_ok(params, k4, v4, q4.shape[0], q4.shape[-2]):
        return "K/V layout does not allow host-built descriptors"
    if launch.needs_int64(q4, k4, v4):
        return "offsets past 2**31 elements"
    return None


def plan(q4, k4, v4, params: NAParams, scale: float, need_lse: bool) -> HopperForward:
    """Tiles, grid and arguments of a problem ``unsupported`` accepted."""
    from . import launch

    b, hq, hkv, d = q4.shape[0], q4.shape[-2], k4.shape[-2], q4.shape[-1]
    pad = 3 - params.rank
    axes = tiles.axes_of(params)
    q_tile, kv_tile = tiles.choose_tiles(axes, ROWS, COLS)
    q_tile, kv_tile = (1,) * pad + tuple(q_tile), (1,) * pad + tuple(kv_tile)
    masked = tiles.partial_axes(axes, q_tile[pad:], kv_tile[pad:]) > 0
    window, programs = launch._window_args(params, q_tile)
    L, K, S, _, C = launch._axes3(params)
    nt = tuple(window[12:15])
    lse_strides = (params.num_tokens * hq, hq) if need_lse else (0, 0)
    strides = (*launch._strides(q4), *launch._strides(k4), *launch._strides(v4),
               params.num_tokens * hq * d, hq * d, d, *lse_strides)
    scalars = (*strides, hq, hq // hkv, scale * kernels.LOG2E, *L, *K, *S, *nt)
    common = dict(CAUSAL0=C[0], CAUSAL1=C[1], CAUSAL2=C[2], ACT0=params.rank >= 3, ACT1=params.rank >= 2,
                  T0=q_tile[0], T1=q_tile[1], T2=q_tile[2], BLOCK_D=d, IDX64=False, STORE_LSE=need_lse)
    meta = dict(common, U0=kv_tile[0], U1=kv_tile[1], U2=kv_tile[2], MASK=masked, num_warps=4, num_stages=STAGES)
    fixup = dict(common, SUB=launch.gather_rows(d, d), num_warps=4, num_stages=1)
    return HopperForward(q_tile, kv_tile, nt, L, (programs, b * hq), scalars, meta, fixup,
                         launch.host_kv_layouts(params, k4, v4, kv_tile))


def tile_major(q4: torch.Tensor, fw: HopperForward) -> torch.Tensor:
    """``[B, N, H, D]`` -> ``[B * H * tiles * ROWS, D]``: each program's query tile as consecutive rows, rows past
    the end of an axis zero (a program's result is computed from them, never stored)."""
    b, _, h, d = q4.shape
    (t0, t1, t2), (n0, n1, n2), (l0, l1, l2) = fw.q_tile, fw.tiles_per_axis, fw.spatial
    out = torch.empty((b, h, n0, n1, n2, t0, t1, t2, d), dtype=q4.dtype, device=q4.device)
    q5 = q4.reshape(b, l0, l1, l2, h, d)
    if (n0 * t0, n1 * t1, n2 * t2) != (l0, l1, l2):  # a partial tile on some axis: zero rows past its end
        padded = q5.new_zeros((b, n0 * t0, n1 * t1, n2 * t2, h, d))
        padded[:, :l0, :l1, :l2] = q5
        q5 = padded
    # out seen as [B, n0, t0, n1, t1, n2, t2, H, D]: the tokens' order
    out.permute(0, 2, 5, 3, 6, 4, 7, 1, 8).copy_(q5.reshape(b, n0, t0, n1, t1, n2, t2, h, d))
    return out.view(-1, d)


def run(fw: HopperForward, q4, k4, v4, out4, lse) -> None:
    """``out4`` (``[B, N, H, D]``) and ``lse`` (``[B, N, H]`` float32, or None) for the problem of ``fw``."""
    d = q4.shape[-1]
    q_rows = tile_major(q4, fw)
    rows = math.prod(fw.q_tile)
    q_desc = TensorDescriptor(q_rows, list(q_rows.shape), [d, 1], [rows, d])
    k_desc = TensorDescriptor(k4, *fw.kv_layouts[0])
    v_desc = TensorDescriptor(v4, *fw.kv_layouts[1])
    flags = torch.empty(fw.programs * rows, dtype=torch.int8, device=q4.device)
    lse_arg = out4 if lse is None else lse
    na_fwd_ws_kernel[fw.grid](q4, k4, v4, out4, lse_arg, flags, q_desc, k_desc, v_desc, *fw.scalars, **fw.meta)
    strides, rest = fw.scalars[:14], fw.scalars[14:]  # the 14 strides, then heads, group, scale, window
    na_fwd_nonfinite_kernel[fw.grid](q4, k4, v4, out4, lse_arg, flags, *strides, *rest[:2], d, *rest[2:],
                                     **fw.fixup_meta)
