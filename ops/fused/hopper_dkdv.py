"""dK/dV on Hopper (sm_90): a warp-specialised Gluon kernel for large windows, the backward's partner of ``hopper``.

One program owns a box of keys of one kv head and walks the query boxes whose windows reach it (its inverse
neighbourhood, every query head of the kv head's group in turn).  A one-warp producer copies each query box's Q and
dO tiles (TMA) into two rings of shared-memory stages; two consumer warpgroups, each with its 64 of the box's 128 keys
held in shared memory (K and V rows) for the whole loop, run per query box

    S^T = K Q^T,  dP^T = V dO^T   (wgmma, both issued before either is waited for)
    P^T = exp2(S^T * scale * log2(e) - lse),  dS^T = P^T (dP^T - delta)
    dV += P^T dO,  dK += dS^T Q   (P^T and dS^T straight from registers)

then hand the Q and dO stages back.  Keys are the matmuls' rows, so P^T and dS^T are already the left operands
of the two accumulating matmuls: no transpose through shared memory, which the portable kernel
(``kernels.na_bwd_dkdv_kernel``, queries as rows) pays on every step.

The window rules come from host tables (``inverse_tables``, from the windows of ``ops.window``), as for the
forward: per axis, the queries whose windows hold each key position, and per key tile the queries reaching it
``[lo, hi)`` and those whose windows hold all of it ``[in_lo, in_hi)``.  A consumer reads its keys' query ranges
once, so a masked box costs compares only (through the score matmul's initial value), and a query box inside
``[in_lo, in_hi)`` on every axis skips them.  A program whose dK or dV holds a NaN or an infinity flags its rows, and
``na_bwd_dkdv_nonfinite_kernel`` recomputes those programs one window offset at a time (``kernels._dkdv_by_offset``),
so non-finite inputs stay inside the windows that hold them, as on the portable kernel.

A box's lse and delta come from global memory (L2, mostly): a masked launch loads them before the box's mask and
matmuls, a launch without mask code a box ahead, during the previous box's dK and dV matmuls, so that no step waits
out the trip (``docs/fused.md``, "What holds dK/dV back").

It runs where ``decide.hopper_unsupported`` accepts the problem (no RPB, no dilation, 16-bit, head dim 64 or 128, large
windows) for the ranks in ``RANKS``; everything else takes the portable kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import hopper, kernels, tiles
from .kernels import _dkdv_by_offset, _program_group
from ..window import NAParams

gluon, gl = hopper.gluon, (hopper.gl if hopper.gluon is not None else None)
if gluon is not None:
    from .hopper import (_program, _register_operand, _rings, _tile_spans, _wgmma_layout, fence_async_shared,
                         mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

# Keys per program, a consumer warpgroup per 64.  64-key programs (one consumer, two programs per SM) reach fewer
# queries outside their keys' windows, but were slower on dK/dV than 128-key ones on the masked problems
# (docs/fused.md, "The Hopper dK/dV").
KEYS = 128
QUERIES = 64  # queries per box (the score tiles' columns)
RANKS = (2, 3)  # 1-D problems ran slower than on the portable kernel (docs/fused.md, "The Hopper dK/dV")
STAGES = 2  # Q / dO stages in shared memory
CONSUMER_REGS = 240  # dK and dV accumulate in registers: 128 of a consumer thread's registers at head dim 128
PRODUCER_REGS = 24


if gluon is not None:

    @gluon.jit
    def _load_queries(q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, do_ready, do_empty, b, hk, group, ql0,
                      ql1, ql2, n12, n2, n_tiles):
        """Producer: every query box of the loop (each query head of the group in turn), Q and dO into the next
        free stages."""
        stages: gl.constexpr = q_smem.type.shape[0]
        block_d: gl.constexpr = q_smem.type.shape[5]
        for t in range(group * n_tiles):
            h = hk * group + t // n_tiles
            tt = t % n_tiles
            i0 = tt // n12
            i1 = (tt - i0 * n12) // n2
            i2 = tt - i0 * n12 - i1 * n2
            coord = [b, ql0 + i0 * q_smem.type.shape[2], ql1 + i1 * q_smem.type.shape[3],
                     ql2 + i2 * q_smem.type.shape[4], h * block_d]
            stage = t % stages
            lap = ((t // stages) & 1) ^ 1  # a fresh barrier passes the wait for the phase before its first
            mbarrier.wait(q_empty.index(stage), lap)
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, coord, q_ready.index(stage), q_smem.index(stage))
            mbarrier.wait(do_empty.index(stage), lap)
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, coord, do_ready.index(stage), do_smem.index(stage))

    @gluon.jit
    def _reaching_queries(QUERY_RANGES, KEY_OFFSETS, axis, first, r, LMAX):
        """Per key row of a consumer's half, on one axis: the queries whose windows hold it, ``[lo, hi)``."""
        k = first + gl.load(KEY_OFFSETS + axis * 128 + r)
        base = QUERY_RANGES + (axis * LMAX + k) * 2
        return gl.load(base), gl.load(base + 1)

    @gluon.jit
    def _lse_and_delta(lse_b, delta_b, q0, q1, q2, h, c_tok, L1, L2, n_tokens, slt, wanted):
        """A query box's lse and delta, one column per thread (zero past the last token, or where not ``wanted``)."""
        tok = (q0 * L1 + q1) * L2 + q2 + c_tok
        ok = (tok < n_tokens) & wanted
        return gl.load(lse_b + tok * slt + h, mask=ok, other=0.0), gl.load(delta_b + tok * slt + h, mask=ok, other=0.0)

    @gluon.jit
    def _next_box(q0, q1, q2, h, ql0, ql1, ql2, end0, end1, end2, T0: gl.constexpr, T1: gl.constexpr,
                  T2: gl.constexpr):
        """The loop's next query box after ``(q0, q1, q2)`` of head ``h``, in the producer's order (axis 2 fastest,
        then 1, then 0, then the group's next query head), without divisions."""
        q2 += T2
        if q2 == end2:
            q2 = ql2
            q1 += T1
            if q1 == end1:
                q1 = ql1
                q0 += T0
                if q0 == end0:
                    q0 = ql0
                    h += 1
        return q0, q1, q2, h

    @gluon.jit
    def _consume_keys(k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, DK, DV, LSE,
                      DELTA, FLAGS, QUERY_RANGES, KEY_OFFSETS, b, hk, group, program, first0, first1, first2, ql0,
                      ql1, ql2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2, n_tiles, skb, skt, skh, svb,
                      svt, svh, slb, slt, qk_scale, scale, L0, L1, L2, LMAX, half):
        """Consumer: dK and dV of 64 keys over every query box the producer stages, then their flags and stores."""
        stages: gl.constexpr = q_smem.type.shape[0]
        T0: gl.constexpr = q_smem.type.shape[2]
        T1: gl.constexpr = q_smem.type.shape[3]
        T2: gl.constexpr = q_smem.type.shape[4]
        block_d: gl.constexpr = q_smem.type.shape[5]
        cols: gl.constexpr = T0 * T1 * T2
        rows: gl.constexpr = k_smem.type.shape[2] * k_smem.type.shape[3] * k_smem.type.shape[4]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = _wgmma_layout(cols)
        o_layout: gl.constexpr = _wgmma_layout(block_d)
        a_layout: gl.constexpr = _register_operand(o_layout)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        # a launch where every query box lies inside every key's window (``every_box_inside``) gets an int8 stand-in
        # for the query ranges, and its loop no mask code, which would hold registers the loop spills for
        masked: gl.constexpr = QUERY_RANGES.dtype.element_ty == gl.int32

        # the key rows' places in the 128-key box (clamped past an axis' end: those rows are never stored), and the
        # queries reaching each: loop invariants, so the mask costs compares only
        r = half * rows + gl.arange(0, rows, layout=s_rows)  # (rows: 64, one wgmma tile)
        if masked:
            lo0, hi0 = _reaching_queries(QUERY_RANGES, KEY_OFFSETS, 0, first0, r, LMAX)
            lo1, hi1 = _reaching_queries(QUERY_RANGES, KEY_OFFSETS, 1, first1, r, LMAX)
            lo2, hi2 = _reaching_queries(QUERY_RANGES, KEY_OFFSETS, 2, first2, r, LMAX)
        # lse and delta are loaded one column per thread, then spread over the score tile's column layout: loaded
        # in that layout, every thread would hold 16 of the 64 pointers (and spill)
        c = gl.arange(0, cols, layout=gl.BlockedLayout([1], [32], [4], [0]))
        c_tok = ((c // (T1 * T2)) * L1 + (c // T2) % T1) * L2 + c % T2  # the columns' tokens from their box's first
        n_tokens = L0 * L1 * L2
        lse_b = LSE + b.to(gl.int64) * slb
        delta_b = DELTA + b.to(gl.int64) * slb

        k_rows = k_smem.index(half).reshape([rows, block_d])
        v_rows = v_smem.index(half).reshape([rows, block_d])
        dk = gl.zeros([rows, block_d], gl.float32, layout=o_layout)
        dv = gl.zeros([rows, block_d], gl.float32, layout=o_layout)
        # the query box's first query per axis and its head, stepped in the producer's order (``_next_box``)
        end2 = ql2 + n2 * T2
        end1 = ql1 + (n12 // gl.maximum(n2, 1)) * T1
        end0 = ql0 + (n_tiles // gl.maximum(n12, 1)) * T0
        q0 = ql0
        q1 = ql1
        q2 = ql2
        h = hk * group
        total = group * n_tiles
        if not masked:  # no mask code: registers to spare for the next box's lse and delta, loaded a box ahead
            lse_next, delta_next = _lse_and_delta(lse_b, delta_b, q0, q1, q2, h, c_tok, L1, L2, n_tokens, slt,
                                                  total > 0)
        mbarrier.wait(kv_bar, 0)
        for t in range(total):
            stage = t % stages
            phase = (t // stages) & 1
            # A column past an axis' end holds another query's token (or one past the last): its Q and dO are zero
            # (the copy's fill) and the mask drops it, since a box sticking out is never inside every key's window.
            # Offsets fit in 32 bits (``decide.hopper_unsupported``).
            if masked:  # loaded first, so their latency hides behind the mask and the matmuls' issue
                lse_now, delta_now = _lse_and_delta(lse_b, delta_b, q0, q1, q2, h, c_tok, L1, L2, n_tokens, slt,
                                                    t < total)
            else:
                lse_now = lse_next
                delta_now = delta_next
            q_cols = q_smem.index(stage).reshape([cols, block_d])
            do_cols = do_smem.index(stage).reshape([cols, block_d])
            # a box not inside every key's window is masked through the score matmul's initial value (0 or -inf),
            # built before the matmuls hold their registers
            s_init = gl.zeros([rows, cols], gl.float32, layout=s_layout)
            if masked:
                full = ((q0 >= in_lo0) & (q0 + T0 <= in_hi0) & (q1 >= in_lo1) & (q1 + T1 <= in_hi1)
                        & (q2 >= in_lo2) & (q2 + T2 <= in_hi2))
                if not full:
                    cm = gl.arange(0, cols, layout=s_cols)
                    qc0 = q0 + cm // (T1 * T2)
                    qc1 = q1 + (cm // T2) % T1
                    qc2 = q2 + cm % T2
                    keep = ((qc0[None, :] >= lo0[:, None]) & (qc0[None, :] < hi0[:, None])
                            & (qc1[None, :] >= lo1[:, None]) & (qc1[None, :] < hi1[:, None])
                            & (qc2[None, :] >= lo2[:, None]) & (qc2[None, :] < hi2[:, None]))
                    s_init = gl.where(keep, 0.0, float("-inf"))
            mbarrier.wait(q_ready.index(stage), phase)
            st = warpgroup_mma(k_rows, q_cols.permute((1, 0)), s_init, is_async=True)
            mbarrier.wait(do_ready.index(stage), phase)
            dpt = warpgroup_mma(v_rows, do_cols.permute((1, 0)), gl.zeros([rows, cols], gl.float32, layout=s_layout),
                                use_acc=False, is_async=True)
            lse2 = gl.convert_layout(lse_now * 1.4426950408889634, s_cols)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
            pt = gl.exp2(st * qk_scale - lse2[None, :])  # -inf scores: a positive scale keeps them -inf
            delta = gl.convert_layout(delta_now, s_cols)
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
            dst = pt * (dpt - delta[None, :])
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_cols, dv, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), q_cols, dk, is_async=True)
            if not masked:  # the next box's lse and delta load while the two matmuls run
                q0, q1, q2, h = _next_box(q0, q1, q2, h, ql0, ql1, ql2, end0, end1, end2, T0, T1, T2)
                lse_next, delta_next = _lse_and_delta(lse_b, delta_b, q0, q1, q2, h, c_tok, L1, L2, n_tokens, slt,
                                                      t + 1 < total)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(stage), count=1)
            mbarrier.arrive(do_empty.index(stage), count=1)
            if masked:  # stepped once the two matmuls' registers are free: the mask code leaves none to spare
                q0, q1, q2, h = _next_box(q0, q1, q2, h, ql0, ql1, ql2, end0, end1, end2, T0, T1, T2)

        dk = dk * scale
        ro = half * rows + gl.arange(0, rows, layout=o_rows)
        kc0 = first0 + gl.load(KEY_OFFSETS + ro)
        kc1 = first1 + gl.load(KEY_OFFSETS + 128 + ro)
        kc2 = first2 + gl.load(KEY_OFFSETS + 256 + ro)
        k_ok = (kc0 < L0) & (kc1 < L1) & (kc2 < L2)
        # keys past an axis' end (zero-filled, never stored) may overflow on their own rows: not flagged
        # a NaN or an infinity in a row reaches its sum (a false alarm, a sum overflowing, costs only the fixup)
        nonfinite = ((gl.sum(dk, 1) + gl.sum(dv, 1)) * 0.0 != 0.0) & k_ok
        gl.store(FLAGS + program * (rows * k_smem.type.shape[0]) + ro, nonfinite.to(gl.int8))
        tok = (kc0 * L1 + kc1) * L2 + kc2
        d = gl.arange(0, block_d, layout=gl.SliceLayout(0, o_layout))
        gl.store(DK + b.to(gl.int64) * skb + hk * skh + tok[:, None] * skt + d[None, :], dk.to(dtype),
                 mask=k_ok[:, None])
        gl.store(DV + b.to(gl.int64) * svb + hk * svh + tok[:, None] * svt + d[None, :], dv.to(dtype),
                 mask=k_ok[:, None])

    @gluon.jit
    def na_bwd_dkdv_hopper_kernel(k_desc, v_desc, q_desc, do_desc, DK, DV, LSE, DELTA, FLAGS, QUERY_RANGES, SPANS,
                                  ORDER, KEY_OFFSETS, skb, skt, skh, svb, svt, svh, slb, slt, HKV, GROUP, qk_scale,
                                  scale, L0, L1, L2, NU0, NU1, NU2, LMAX, NUMAX, half0, half1, half2,
                                  STAGES_: gl.constexpr, CONSUMER_REGS_: gl.constexpr, PRODUCER_REGS_: gl.constexpr):
        # k_desc / v_desc: K and V as [B, L0, L1, L2, heads * D] in boxes of 64 keys, one per consumer warpgroup
        # (halves of the key tile, ``hopper.half_box``; ``half*``: the second half's offset per axis); q_desc /
        # do_desc: Q and dO in query boxes.  QUERY_RANGES[axis, position] = [lo, hi) of the queries whose windows
        # hold the key (int32; an int8 stand-in where no box needs a mask); SPANS[axis, key tile] = (lo, hi, in_lo,
        # in_hi, first key, -, -, -): the queries reaching the tile, those whose windows hold all of it, its first
        # key; KEY_OFFSETS[axis, row] = the row's offset from the tile's first key.  FLAGS[program, row] = 1 where the
        # key's dK or dV holds a NaN / inf.
        tile, program, b, hk = _program(HKV, ORDER)
        BLOCK_D: gl.constexpr = q_desc.block_type.shape[4]
        (first0, first1, first2, ql0, ql1, ql2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2,
         n_tiles) = _tile_spans(SPANS, NU1, NU2, NUMAX, q_desc, tile)

        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        q_smem, do_smem, q_ready, q_empty, do_ready, do_empty = _rings(q_desc, do_desc, STAGES_, 2)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        fence_async_shared()

        col = hk * BLOCK_D
        mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        tma.async_copy_global_to_shared(k_desc, [b, first0, first1, first2, col], kv_bar, k_smem.index(0))
        tma.async_copy_global_to_shared(v_desc, [b, first0, first1, first2, col], kv_bar, v_smem.index(0))
        tma.async_copy_global_to_shared(k_desc, [b, first0 + half0, first1 + half1, first2 + half2, col], kv_bar,
                                        k_smem.index(1))
        tma.async_copy_global_to_shared(v_desc, [b, first0 + half0, first1 + half1, first2 + half2, col], kv_bar,
                                        v_smem.index(1))

        args = (k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, DK, DV, LSE, DELTA,
                FLAGS, QUERY_RANGES, KEY_OFFSETS, b, hk, GROUP, program, first0, first1, first2, ql0, ql1, ql2, in_lo0,
                in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2, n_tiles, skb, skt, skh, svb, svt, svh, slb, slt,
                qk_scale, scale, L0, L1, L2, LMAX)
        loads = (q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, do_ready, do_empty, b, hk, GROUP, ql0, ql1, ql2,
                 n12, n2, n_tiles)
        gl.warp_specialize([(_consume_keys, args + (gl.to_tensor(0),)),  # the consumer's half of the key box
                            (_consume_keys, args + (gl.to_tensor(1),)), (_load_queries, loads)],
                           [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])


@triton.jit
def na_bwd_dkdv_nonfinite_kernel(
    Q, Kp, V, DO, LSE, DELTA, DK, DV, FLAGS,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, slb, slt, skgb, skgt, skgh, svgb, svgt, svgh,
    HKV, GROUP, HEAD_DIM, qk_scale, scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, NU0, NU1, NU2,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
    BLOCK_D: tl.constexpr, IDX64: tl.constexpr, SUB: tl.constexpr,
):
    """dK / dV of the key tiles ``na_bwd_dkdv_hopper_kernel`` flagged, again, one window offset at a time; every
    other program reads its flags and ends."""
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    if tl.max(tl.load(FLAGS + program * (U0 * U1 * U2) + tl.arange(0, U0 * U1 * U2)), 0) != 0:
        g0, tile0, g1, tile1, g2, tile2, b, hk, Lg0, Lg1, Lg2 = _program_group(NU0, NU1, NU2, 1, 1, 1, L0, L1, L2,
                                                                              HKV, ACT0, ACT1)
        b64 = b.to(tl.int64)
        _dkdv_by_offset(Q, Kp, V, Q, DO, LSE, DELTA, DK, DV, b, hk, GROUP, sqb, sqt, sqh, skt, sdb, sdt, sdh, svt,
                        slb, slt, skgt, svgt, b64 * skb + hk * skh, b64 * svb + hk * svh, b64 * skgb + hk * skgh,
                        b64 * svgb + hk * svgh, tile0 * U0, tile1 * U1, tile2 * U2, g0, g1, g2, Lg0, Lg1, Lg2, L1,
                        L2, K0, K1, K2, S0, S1, S2, 1, 1, 1, HEAD_DIM, HEAD_DIM, qk_scale, scale, CAUSAL0, CAUSAL1,
                        CAUSAL2, U0, U1, U2, SUB, BLOCK_D, BLOCK_D, False, IDX64)


@dataclass(frozen=True)
class HopperDkDv:
    """A backward problem's dK/dV launches on the Hopper kernel: the main kernel's and its non-finite fixup's
    (``build_launches``)."""

    grid: tuple
    query_ranges: torch.Tensor  # [3, LMAX, 2] int32: the queries whose windows hold each key position, per axis
    #                              (an int8 stand-in where no query box needs a mask)
    spans: torch.Tensor  # [3, NUMAX, 8] int32: each key tile's reaching queries, its inner queries, its first key
    order: torch.Tensor  # [key tiles] int32: the key tiles in the order the programs run them (``hopper.tile_order``)
    key_offsets: torch.Tensor  # [3, 128] int32: each row's offset from its key tile's first key per axis
    scalars: tuple  # the main kernel's, after its tensor arguments
    meta: dict
    fixup_scalars: tuple
    fixup_meta: dict
    kv_layouts: tuple  # (shape, strides, box) of K's and V's descriptors, one box per consumer
    q_layouts: tuple  # of Q's and dO's, one box per query tile

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1]


def _tiles(params: NAParams) -> tuple[tuple, tuple]:
    """``(kv_tile, q_tile)`` per axis, leading dummy axes first."""
    pad = (1,) * (3 - params.rank)
    kv_tile, q_tile = tiles.choose_tiles(tiles.axes_of(params), KEYS, QUERIES, inverse=True)
    return pad + tuple(kv_tile), pad + tuple(q_tile)


def every_box_inside(spans: torch.Tensor, q_tile) -> bool:
    """Whether every query box the kernel visits (per axis: from a key tile's first reaching query ``lo`` in steps of
    the box, up to its last reaching one) lies inside the queries whose windows hold all of the tile, by the kernel's
    own test (``_consume_keys``'s ``full``); ``spans``: ``inverse_tables``' second table."""
    for axis, t in enumerate(q_tile):
        lo, hi, in_lo, in_hi = spans[axis, :, 0], spans[axis, :, 1], spans[axis, :, 2], spans[axis, :, 3]
        boxes = torch.clamp(hi - lo, min=0).add(t - 1).div(t, rounding_mode="floor")
        visited = boxes > 0
        if not bool(((lo >= in_lo) & (lo + boxes * t <= in_hi) | ~visited).all()):
            return False
    return True


def inverse_tables(params: NAParams, kv_tile) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query_ranges, spans, key_offsets)``, per axis (leading dummy axes first): for every key position the queries
    whose windows hold it, ``[lo, hi)`` (empty past the axis' end, up to the last tile's end); for every key tile the
    queries reaching it ``[lo, hi)``, those whose windows hold all of it ``[in_lo, in_hi)`` (empty where none does)
    and its first key (padded to 8 fields); and each of a tile's rows' offsets from that first key.  A window's
    start and stop never decrease along an axis, so all these query sets are ranges."""
    axes = [tiles.Axis(1, 1, 1)] * (3 - params.rank) + tiles.axes_of(params)
    n_tiles = [-(-ax.Lg // u) for ax, u in zip(axes, kv_tile)]
    ranges = torch.zeros(3, max(n * u for n, u in zip(n_tiles, kv_tile)), 2, dtype=torch.int32)
    spans = torch.zeros(3, max(n_tiles), 8, dtype=torch.int32)
    for a, (ax, u) in enumerate(zip(axes, kv_tile)):
        start, stop = tiles.axis_windows(ax)
        lo, hi = zip(*(tiles.reaching_queries(start, stop, k, k) for k in range(ax.Lg)))
        ranges[a, :ax.Lg] = torch.tensor([lo, hi], dtype=torch.int32).T
        for tile in range(n_tiles[a]):
            first, last = tile * u, min(tile * u + u, ax.Lg) - 1
            spans[a, tile, :5] = torch.tensor([lo[first], hi[last], lo[last], max(hi[first], lo[last]), first],
                                              dtype=torch.int32)
    return ranges, spans, hopper.tile_row_offsets(kv_tile, KEYS)


def build_launches(q4, k4, v4, do4, params: NAParams, scale: float, grads) -> HopperDkDv:
    """Tiles, tables, grid and arguments of a problem ``decide.hopper_dkdv_unsupported`` accepted; ``grads``: the
    (dK, dV) buffers (``[B, N, Hkv, D]`` views) the launches write, whose strides are part of their arguments."""
    from . import decide, launch

    b, hq, hkv, d = q4.shape[0], q4.shape[-2], k4.shape[-2], q4.shape[-1]
    kv_tile, q_tile = _tiles(params)
    window, programs = launch._window_args(params, kv_tile)
    L, K, S, _, C = launch._axes3(params)
    nu = tuple(window[12:15])
    ranges, spans, key_offsets = inverse_tables(params, kv_tile)
    lmax = ranges.shape[1]
    if every_box_inside(spans, q_tile):  # the kernel reads the mask switch off the table's type (``_consume_keys``)
        ranges = torch.zeros(1, dtype=torch.int8)
    order = hopper.tile_order(nu, spans, q4.device)
    ranges, spans, key_offsets = (t.to(q4.device) for t in (ranges, spans, key_offsets))
    box, offset = hopper.half_box(kv_tile)
    lse_strides = (params.num_tokens * hq, hq)
    dk, dv = grads
    scalars = (*launch._strides(dk), *launch._strides(dv), *lse_strides, hkv, hq // hkv, scale * kernels.LOG2E,
               scale, *L, *nu, lmax, spans.shape[1], *offset)
    meta = dict(STAGES_=STAGES, CONSUMER_REGS_=CONSUMER_REGS, PRODUCER_REGS_=PRODUCER_REGS, num_warps=4)
    fixup_scalars = (*launch._strides(q4), *launch._strides(k4), *launch._strides(v4), *launch._strides(do4),
                     *lse_strides, *launch._strides(dk), *launch._strides(dv), hkv, hq // hkv, d,
                     scale * kernels.LOG2E, scale, *L, *K, *S, *nu)
    fixup_meta = dict(CAUSAL0=C[0], CAUSAL1=C[1], CAUSAL2=C[2], ACT0=params.rank >= 3, ACT1=params.rank >= 2,
                      U0=kv_tile[0], U1=kv_tile[1], U2=kv_tile[2], BLOCK_D=d, IDX64=False,
                      SUB=decide.gather_rows(d, d), num_warps=4, num_stages=1)
    return HopperDkDv((programs, b * hkv), ranges, spans, order, key_offsets, scalars, meta,
                      fixup_scalars, fixup_meta, decide.host_kv_layouts(params, k4, v4, box),
                      decide.host_kv_layouts(params, q4, do4, q_tile))
