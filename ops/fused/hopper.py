"""The forward on Hopper (sm_90): a warp-specialised Gluon kernel for large windows.

One program owns a 128-row query box and three roles run side by side in it: a one-warp producer issues the
K and V bulk copies (TMA, N-D boxes) into two rings of shared-memory stages; two consumer warpgroups each own 64
of the box's rows and run the score matmul, the online softmax and the value matmul (wgmma) on every key box, then
hand its K and V stages back (each as soon as its matmul is done).  Stages pass between the roles through
mbarriers.  Inside a consumer the next box's score matmul and this box's value matmul are issued together, and
the next box's softmax runs while the value matmul is still on the tensor cores (FlashAttention-3's order); the two
consumers issue their matmuls in turns, so one's softmax overlaps the other's matmuls, and each writes its output
rows with one bulk copy from shared memory.  Where no key box needs a mask, every tile loops over as many boxes and
the launch is persistent: one program per SM runs query boxes in turn, the producer loading the next box's rows
while the consumers finish the last one (``PERSISTENT_MASKED``; masked 1-D launches too,
``PERSISTENT_MASKED_RANKS``).  The portable kernel (``kernels.na_fwd_kernel``) runs all of it in one warpgroup, and
its softmax waits for its own matmuls.

The window rules stay on the host (``window_tables``, from ``ops.window``): per axis, each position's window
``[start, stop)``; each query tile's key span ``[lo, hi)``, the part ``[in_lo, in_hi)`` inside every row's window
and its first query; and each row's offset inside the tile.  Key boxes inside every row's window skip the mask,
and a launch where the host finds every box of every program inside (the strided problems) has no mask at all.
The query box reaches shared memory as two boxes of 64 rows, one per consumer (``half_box``), read straight from Q.
Programs take their tiles in ``tile_order`` (``launch_order``: the tiles in flight at once read K and V boxes that
fit in L2 together), as the dQ and dK/dV kernels do.

A program whose result holds a NaN or an infinity flags its rows; ``na_fwd_nonfinite_kernel`` (Triton) then
recomputes the flagged programs one window offset at a time (``kernels._attend_by_offset``), which keeps non-finite
values inside the windows that hold them, as the portable kernel does.

It runs where it is built for and faster (docs/fused.md, "The Hopper forward"): 1-D, 2-D and 3-D problems, 16-bit
inputs, head dim 64 or 128 (= value dim), no RPB, positive scale, no dilation, heads packed per token, and windows of
at least ``MIN_WINDOW`` keys (small windows waste most of a 128 x 128 tile).  Everything else, and any GPU but
sm_90, takes the portable kernel; ``NAMODELS_HOPPER=0`` (or ``disabled()``) forces it, for ``hopper_dq`` and
``hopper_dkdv`` too.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import kernels, launch_order, tiles
from .kernels import _attend_by_offset, _program_group
from ..devices import multiprocessors
from ..window import NAParams

try:  # Gluon (Triton's explicit-layout dialect) exists from Triton 3.5 on
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # pragma: no cover - older Triton: the portable kernel runs everything
    gluon = None

ENABLED = os.environ.get("NAMODELS_HOPPER", "1") != "0"
ROWS = 128  # query rows per program: two consumer warpgroups of 64
COLS = 128  # keys per stage
# ``_step_box`` decodes the step indices below this exactly (``_floor_div``); a tile visiting more boxes runs portable
MAX_STEPS = 1 << 20
HEAD_DIMS = (64, 128)
MIN_WINDOW = 1024
RANKS = (1, 2, 3)
STAGES = 2  # K/V stages in shared memory (64 KB each at head dim 128); a third was no faster (docs/fused.md)
CONSUMER_REGS = 232  # registers per consumer thread (setmaxnreg)
PRODUCER_REGS = 40  # the producer also walks the work items and their spans: fewer spill (docs/fused.md)
# Mask-free launches loop over as many boxes in every tile, so one program per SM that runs the work items in turn
# stays balanced, and the next item's query tile loads while the last one's output leaves.  Where loop lengths
# differ (masked launches), programs that each take a fixed share drift apart, the K and V boxes they read at the
# same time stop sharing L2, and one program per tile, which the hardware hands to each SM as it frees up, runs
# instead (docs/fused.md, "The Hopper forward").
PERSISTENT_MASKED = False
# Except on these ranks, without causal axes: a 1-D tile's loop is as long as any other's but at the axis' ends
# (within one key box), and short programs gain most from the next item's query tile loading while the
# last one finishes (``docs/fused.md``, "The Hopper forward").
PERSISTENT_MASKED_RANKS = (1,)
# Tiles run in ``launch_order``'s blocks, so that the programs running at once read K and V boxes that fit in L2
# together (off: row-major, the last axis fastest).
ORDERED = True
# The block shape is chosen for runs of the programs in flight over the L2 partitions (an H100's L2 is two): runs of
# half the SMs ranked the block shapes as their HBM traffic did where runs of all of them did not (``docs/fused.md``,
# "Launch order").
L2_PARTITIONS = 2


@contextlib.contextmanager
def disabled():
    """Plans made inside take the portable kernel (benchmarks and tests compare the two in one process)."""
    global ENABLED
    was, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = was


if gluon is not None:

    # Partition functions see only values: a constexpr passed through ``gl.warp_specialize`` arrives as a tensor
    # (Triton 3.6), so tile sizes, stages and head dim are read off the shared-memory buffers' shapes, the rows'
    # offsets inside the query box come from a table (``ROW_OFFSETS``), and the two switches are runtime flags.

    @gluon.constexpr_function
    def _wgmma_layout(n):
        """wgmma's register layout of one warpgroup's ``[64, n]`` result."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def _register_operand(acc_layout):
        """The layout of a left operand taken from registers by a matmul accumulating in ``acc_layout``."""
        return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    @gluon.jit
    def _tile_coords(tile, N1, N2):
        """A flat query (or key) tile index per axis (the last axis fastest)."""
        return tile // (N1 * N2), (tile // N2) % N1, tile % N2

    @gluon.jit
    def _span(SPANS, axis, tile, NMAX):
        """A tile's row of ``SPANS`` on one axis: ``(lo, hi, in_lo, in_hi, first)``."""
        row = SPANS + (axis * NMAX + tile) * 8
        return gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4)

    @gluon.jit
    def _program(HEADS, ORDER):
        """The program's tile (``ORDER`` at grid axis 0: tiles run in ``launch_order``), its flat index as the fixup
        kernels number programs (``(b * HEADS + head) * tiles + tile``) and its batch element and head (grid axis 1
        is ``b * HEADS + head``)."""
        tile = gl.load(ORDER + gl.program_id(0))
        return (tile, gl.program_id(1) * gl.num_programs(0) + tile, gl.program_id(1) // HEADS,
                gl.program_id(1) % HEADS)

    @gluon.jit
    def _work_item(w, SPANS, ORDER, TILES, N1, N2, NMAX, HEADS, box_desc):
        """Work item ``w`` of a persistent launch (position ``w - bh * TILES`` of batch element and head ``bh``, whose
        tile ``ORDER`` holds): ``(item, b, head, spans)``, ``item`` numbered as ``_program`` numbers programs and
        ``spans`` the tile's ``_tile_spans``."""
        bh = w // TILES
        tile = gl.load(ORDER + w - bh * TILES)
        return bh * TILES + tile, bh // HEADS, bh % HEADS, _tile_spans(SPANS, N1, N2, NMAX, box_desc, tile)

    @gluon.jit
    def _tile_spans(SPANS, N1, N2, NMAX, box_desc, tile):
        """A tile's spans (``_tile_coords``, ``_span``) and the loop over the boxes of ``box_desc`` (``[1, B0, B1,
        B2, D]``) that cover them: ``(first0, first1, first2, lo0, lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2,
        in_hi2, n12, n2, n_boxes)``, where n2 and n12 count the boxes per step of axes 1 and 0 and n_boxes the
        loop's boxes in all (an empty span loops over none)."""
        B0: gl.constexpr = box_desc.block_type.shape[1]
        B1: gl.constexpr = box_desc.block_type.shape[2]
        B2: gl.constexpr = box_desc.block_type.shape[3]
        tile0, tile1, tile2 = _tile_coords(tile, N1, N2)
        lo0, hi0, in_lo0, in_hi0, first0 = _span(SPANS, 0, tile0, NMAX)
        lo1, hi1, in_lo1, in_hi1, first1 = _span(SPANS, 1, tile1, NMAX)
        lo2, hi2, in_lo2, in_hi2, first2 = _span(SPANS, 2, tile2, NMAX)
        n2 = gl.cdiv(gl.maximum(hi2 - lo2, 0), B2)
        n12 = gl.cdiv(gl.maximum(hi1 - lo1, 0), B1) * n2
        n_boxes = gl.cdiv(gl.maximum(hi0 - lo0, 0), B0) * n12
        return first0, first1, first2, lo0, lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2, n_boxes

    @gluon.jit
    def _rings(a_desc, b_desc, STAGES: gl.constexpr, consumers: gl.constexpr):
        """Two rings of ``STAGES`` shared-memory stages (boxes of ``a_desc`` and ``b_desc``) that a producer fills and
        ``consumers`` consumer partitions empty: ``(a_smem, b_smem, a_ready, a_empty, b_ready, b_empty)``."""
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(a_ready.index(i), count=1)
            mbarrier.init(b_ready.index(i), count=1)
            mbarrier.init(a_empty.index(i), count=consumers)  # every consumer hands a stage back
            mbarrier.init(b_empty.index(i), count=consumers)
        return a_smem, b_smem, a_ready, a_empty, b_ready, b_empty

    @gluon.jit
    def _turn_barriers():
        """The two mbarriers the consumers pass their turns with (``_await_turn``)."""
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turns.index(0), count=1)
        mbarrier.init(turns.index(1), count=1)
        return turns

    @gluon.jit
    def _load_halves(desc, smem, bar, b, first0, first1, first2, half0, half1, half2, col):
        """Both consumers' halves of the program's query box (``half_box``) from ``desc`` into ``smem``."""
        tma.async_copy_global_to_shared(desc, [b, first0, first1, first2, col], bar, smem.index(0))
        tma.async_copy_global_to_shared(desc, [b, first0 + half0, first1 + half1, first2 + half2, col], bar,
                                        smem.index(1))

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, col, lo0, lo1, lo2, n12, n2,
                 n_boxes):
        """Producer: the program's key boxes (``_load_boxes`` from the rings' start)."""
        _load_boxes(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, col, lo0, lo1, lo2, n12,
                    n2, n_boxes, 0)

    @gluon.jit
    def _load_boxes(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, col, lo0, lo1, lo2, n12, n2,
                    n_boxes, done):
        """Producer: one tile's key boxes in loop order, each K and V box into the next free stage (K and V stages are
        freed separately: a consumer is done with a K box long before it is done with its V box); ``done``: boxes
        the rings have passed before (earlier work items of a persistent program)."""
        stages: gl.constexpr = k_smem.type.shape[0]
        n12_inv, n2_inv = _box_reciprocals(n12, n2)
        for t in range(n_boxes):
            stage = (done + t) % stages
            # a fresh barrier reads as having completed the phase before its first, so the first lap passes
            lap = (((done + t) // stages) & 1) ^ 1
            k0, k1, k2 = _step_box(t, n12, n2, n12_inv, n2_inv, lo0, lo1, lo2, k_smem.type.shape[2],
                                   k_smem.type.shape[3], k_smem.type.shape[4])
            coord = [b, k0, k1, k2, col]
            mbarrier.wait(k_empty.index(stage), lap)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, coord, k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), lap)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, coord, v_ready.index(stage), v_smem.index(stage))

    @gluon.jit
    def _axis_rows(STARTS, ROW_OFFSETS, axis, first, r, L, LMAX):
        """Per row of a consumer's half: valid, clamped coordinate, window start and stop on one axis."""
        q = first + gl.load(ROW_OFFSETS + axis * 128 + r)
        qc = gl.minimum(q, L - 1)
        base = STARTS + (axis * LMAX + qc) * 2
        return q < L, qc, gl.load(base), gl.load(base + 1)

    @gluon.jit
    def _consumer_rows(STARTS, ROW_OFFSETS, first0, first1, first2, half, L0, L1, L2, LMAX, h_rows: gl.constexpr,
                       rows: gl.constexpr):
        """A consumer's rows of the query box (the ``half``-th 64, in layout ``rows``): ``(r, q_ok, tok, start0,
        stop0, start1, stop1, start2, stop2)``: row index, valid, flat token (clamped) and window per axis."""
        r = half * h_rows + gl.arange(0, h_rows, layout=rows)
        ok0, qc0, start0, stop0 = _axis_rows(STARTS, ROW_OFFSETS, 0, first0, r, L0, LMAX)
        ok1, qc1, start1, stop1 = _axis_rows(STARTS, ROW_OFFSETS, 1, first1, r, L1, LMAX)
        ok2, qc2, start2, stop2 = _axis_rows(STARTS, ROW_OFFSETS, 2, first2, r, L2, LMAX)
        return r, ok0 & ok1 & ok2, (qc0 * L1 + qc1) * L2 + qc2, start0, stop0, start1, stop1, start2, stop2

    @gluon.jit
    def _scores(q, k_smem, stage, h_rows: gl.constexpr, cols: gl.constexpr, block_d: gl.constexpr,
                s_layout: gl.constexpr):
        """Issues ``q @ K[stage]^T`` on the tensor cores (asynchronous: the caller waits)."""
        k_tile = k_smem.index(stage).reshape([cols, block_d])
        return warpgroup_mma(q, k_tile.permute((1, 0)), gl.zeros([h_rows, cols], gl.float32, layout=s_layout),
                             use_acc=False, is_async=True)

    @gluon.jit
    def _mask_axis(s, kj, start, stop):
        """``s`` with -inf where the column's key ``kj`` lies outside the row's window ``[start, stop)`` on one axis."""
        return gl.where((kj[None, :] >= start[:, None]) & (kj[None, :] < stop[:, None]), s, float("-inf"))

    @gluon.jit
    def _mask_box(s, k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, start0, stop0, start1, stop1, start2,
                  stop2, U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr):
        """The scores of the key box at ``(k0, k1, k2)`` with -inf outside each row's window, tested only on the axes
        where the box does not lie inside every row's window (never on a problem's leading dummy axes)."""
        c = gl.arange(0, U0 * U1 * U2, layout=gl.SliceLayout(0, s.type.layout))  # the box's keys, row-major
        if (k0 < in_lo0) | (k0 + U0 > in_hi0):
            s = _mask_axis(s, k0 + c // (U1 * U2), start0, stop0)
        if (k1 < in_lo1) | (k1 + U1 > in_hi1):
            s = _mask_axis(s, k1 + (c // U2) % U1, start1, stop1)
        if (k2 < in_lo2) | (k2 + U2 > in_hi2):
            s = _mask_axis(s, k2 + c % U2, start2, stop2)
        return s

    @gluon.jit
    def _box_reciprocals(n12, n2):
        """``1 / n12`` and ``1 / n2`` for ``_step_box``, computed once per tile."""
        return 1.0 / gl.maximum(n12, 1).to(gl.float32), 1.0 / gl.maximum(n2, 1).to(gl.float32)

    @gluon.jit
    def _floor_div(t, n_inv):
        """``t // n`` for ``0 <= t < MAX_STEPS`` from ``n``'s float reciprocal: ``(t + 1/2) / n`` lies at least
        ``1 / (2 n)`` from an integer, and the float product errs by at most ``(t + 1/2) / n * 2**-21``, so the
        truncation is exact.  An integer division by a runtime value takes many SASS instructions, one of them a
        reciprocal on the exponentials' unit; this takes three (docs/fused.md, "The Hopper dQ")."""
        return ((t.to(gl.float32) + 0.5) * n_inv).to(gl.int32)

    @gluon.jit
    def _step_box(t, n12, n2, n12_inv, n2_inv, lo0, lo1, lo2, U0: gl.constexpr, U1: gl.constexpr,
                  U2: gl.constexpr):
        """The first key of loop step ``t``'s box, decoded from the step index (the producer's order; the forward's
        consumers step it with ``_next_key_box`` instead); ``n12_inv``, ``n2_inv``: ``_box_reciprocals``."""
        i0 = _floor_div(t, n12_inv)
        r = t - i0 * n12
        i1 = _floor_div(r, n2_inv)
        return lo0 + i0 * U0, lo1 + i1 * U1, lo2 + (r - i1 * n2) * U2

    @gluon.jit
    def _box_ends(lo1, lo2, n12, n2, U1: gl.constexpr, U2: gl.constexpr):
        """Where a tile's key boxes wrap on axes 1 and 2 (``_next_key_box``): one past the last box's first key."""
        return lo1 + n12 // gl.maximum(n2, 1) * U1, lo2 + n2 * U2

    @gluon.jit
    def _next_key_box(k0, k1, k2, lo1, lo2, end1, end2, U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr):
        """The first key of the loop's next box after ``(k0, k1, k2)``, in the producer's order (the last axis
        fastest), stepped with carries and no branch (the faster of the two; docs/fused.md, "The Hopper forward"):
        decoding the step's index took two integer divisions by runtime values on the path from the score matmul to
        the softmax of every masked step."""
        k2 += U2
        wrap2 = (k2 == end2).to(gl.int32)
        k2 -= wrap2 * (end2 - lo2)
        k1 += wrap2 * U1
        wrap1 = (k1 == end1).to(gl.int32)
        k1 -= wrap1 * (end1 - lo1)
        return k0 + wrap1 * U0, k1, k2

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale):
        """Online softmax of one box of scores: ``(p, alpha, m, l)``.  With a positive scale the max of the raw
        scores is the max of the scaled ones, so the scale rides exp2's FMA."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing admitted yet
        p = gl.exp2(s * qk_scale - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _await_turn(turns, half, j):
        """The consumers issue their matmuls in turns (FlashAttention-3's warpgroup scheduling), so that one's softmax
        runs while the other's matmuls hold the tensor cores: consumer 0's turn ``j`` follows consumer 1's turn
        ``j - 1``, consumer 1's follows consumer 0's turn ``j`` (a fresh barrier passes a wait on parity 1)."""
        mbarrier.wait(turns.index(half), (j + half + 1) & 1)

    @gluon.jit
    def _pass_turn(turns, half):
        mbarrier.arrive(turns.index(1 - half), count=1)

    @gluon.jit
    def _wait_after_softmax(acc, p, always):
        """``acc`` once the value matmul in flight is done, waited for after the softmax that made ``p``.  ptxas
        moves a ``wgmma`` wait up its basic block to the previous wait (the score matmul's), which would put the
        whole softmax after the value matmul instead of under it; a first wait in a branch of its own ends the
        block after the softmax.  ``always`` is a condition that holds but that the compiler cannot fold (the
        positive scale); where it did not hold, the second wait would still retire the matmul."""
        if always:
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _attend(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_empty, turns, done, turns_done, lo0, lo1, lo2,
                in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2, n_boxes, start0, stop0, start1, stop1, start2,
                stop2, qk_scale, mask, half):
        """One consumer's 64 query rows ``q`` against the ``n_boxes`` key boxes of their tile: ``(acc, m, l)``, the
        unnormalised output and the softmax's running max and sum.  ``done`` / ``turns_done``: the boxes the rings
        and the turns the consumers passed for earlier work items.  Q goes back to the producer (``q_empty``) once the
        last score matmul is done.  FlashAttention-3's order: the next box's scores and this box's values are issued
        together, and the next box's softmax runs while the value matmul is on the tensor cores."""
        stages: gl.constexpr = k_smem.type.shape[0]
        U0: gl.constexpr = k_smem.type.shape[2]
        U1: gl.constexpr = k_smem.type.shape[3]
        U2: gl.constexpr = k_smem.type.shape[4]
        block_d: gl.constexpr = k_smem.type.shape[5]
        h_rows: gl.constexpr = q.type.shape[0]
        cols: gl.constexpr = U0 * U1 * U2
        dtype: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = _wgmma_layout(cols)
        o_layout: gl.constexpr = _wgmma_layout(block_d)
        p_layout: gl.constexpr = _register_operand(o_layout)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

        end1, end2 = _box_ends(lo1, lo2, n12, n2, U1, U2)
        k0 = lo0  # the first key of the box whose scores are next
        k1 = lo1
        k2 = lo2
        m_i = gl.full([h_rows], float("-inf"), gl.float32, layout=s_rows)
        l_i = gl.zeros([h_rows], gl.float32, layout=s_rows)
        acc = gl.zeros([h_rows, block_d], gl.float32, layout=o_layout)
        mbarrier.wait(k_ready.index(done % stages), (done // stages) & 1)
        _await_turn(turns, half, turns_done)
        s = _scores(q, k_smem, done % stages, h_rows, cols, block_d, s_layout)
        _pass_turn(turns, half)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(done % stages), count=1)
        if mask:
            s = _mask_box(s, k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, start0, stop0, start1, stop1,
                          start2, stop2, U0, U1, U2)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p = gl.convert_layout(p.to(dtype), p_layout)
        for t in range(n_boxes - 1):
            box = done + t  # the ring position of the box whose values go in now; its successor's scores
            nxt = box + 1
            k0, k1, k2 = _next_key_box(k0, k1, k2, lo1, lo2, end1, end2, U0, U1, U2)
            mbarrier.wait(k_ready.index(nxt % stages), (nxt // stages) & 1)
            mbarrier.wait(v_ready.index(box % stages), (box // stages) & 1)
            _await_turn(turns, half, turns_done + t + 1)
            s = _scores(q, k_smem, nxt % stages, h_rows, cols, block_d, s_layout)
            acc = warpgroup_mma(p, v_smem.index(box % stages).reshape([cols, block_d]), acc, is_async=True)
            _pass_turn(turns, half)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            mbarrier.arrive(k_empty.index(nxt % stages), count=1)
            if mask:
                s = _mask_box(s, k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, start0, stop0, start1,
                              stop1, start2, stop2, U0, U1, U2)
            p_next, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            acc = _wait_after_softmax(acc, p_next, qk_scale > 0.0)
            mbarrier.arrive(v_empty.index(box % stages), count=1)
            # only now P's registers (the value matmul's operand) and the accumulator may be written
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            p = gl.convert_layout(p_next.to(dtype), p_layout)
        mbarrier.arrive(q_empty, count=1)
        last = done + n_boxes - 1
        mbarrier.wait(v_ready.index(last % stages), (last // stages) & 1)
        _await_turn(turns, half, turns_done + n_boxes)
        acc = warpgroup_mma(p, v_smem.index(last % stages).reshape([cols, block_d]), acc, is_async=True)
        _pass_turn(turns, half)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last % stages), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _store_rows(acc, m_i, l_i, o_half, o_desc, LSE, FLAGS, item, r, q_ok, tok, b, h, first0, first1, first2,
                    half0, half1, half2, slb, slt, store_lse, half):
        """A consumer's rows of work item ``item``: lse, non-finite flags and the normalised output, which leaves
        through ``o_half`` (shared memory the caller has made free) and one bulk copy.  The copy drops the rows past
        an axis' end; per-thread stores from the matmul layout would be 32 strided 4-byte stores, each filling half a
        sector, that hold the SM until they have issued."""
        block_d: gl.constexpr = acc.type.shape[1]
        h_rows: gl.constexpr = acc.type.shape[0]
        s_rows: gl.constexpr = m_i.type.layout
        o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        l_i = gl.where(l_i > 0.0, l_i, 1.0)  # rows past an axis' end (zero queries) are never stored
        out = acc * gl.convert_layout(1.0 / l_i, o_rows)[:, None]
        if store_lse:
            gl.store(LSE + b.to(gl.int64) * slb + tok * slt + h, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=q_ok)
        nonfinite = gl.convert_layout(gl.sum(out * 0.0, 1) != 0.0, s_rows)
        gl.store(FLAGS + item * (2 * h_rows) + r, nonfinite.to(gl.int8))
        o_half.reshape([h_rows, block_d]).store(out.to(o_half.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, first0 + half * half0, first1 + half * half1,
                                                 first2 + half * half2, h * block_d], o_half)

    @gluon.jit
    def _consume_tile(q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty, turns, o_desc,
                      LSE, FLAGS, STARTS, ROW_OFFSETS, b, h, program, first0, first1, first2, half0, half1, half2, lo0,
                      lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2, n_boxes, slb, slt, qk_scale,
                      L0, L1, L2, LMAX, store_lse, mask, half):
        """Consumer of a program that owns one query tile: its 64 rows (``_attend``), then their output, which
        leaves through their half of the query box (free once the last score matmul is done)."""
        block_d: gl.constexpr = k_smem.type.shape[5]
        h_rows: gl.constexpr = q_smem.type.shape[2] * q_smem.type.shape[3] * q_smem.type.shape[4]
        s_rows: gl.constexpr = gl.SliceLayout(1, _wgmma_layout(k_smem.type.shape[2] * k_smem.type.shape[3] *
                                                               k_smem.type.shape[4]))
        r, q_ok, tok, start0, stop0, start1, stop1, start2, stop2 = _consumer_rows(
            STARTS, ROW_OFFSETS, first0, first1, first2, half, L0, L1, L2, LMAX, h_rows, s_rows)
        mbarrier.wait(q_ready, 0)
        acc, m_i, l_i = _attend(q_smem.index(half).reshape([h_rows, block_d]), k_smem, v_smem, k_ready, k_empty,
                                v_ready, v_empty, q_empty, turns, 0, 0, lo0, lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1,
                                in_lo2, in_hi2, n12, n2, n_boxes, start0, stop0, start1, stop1, start2, stop2, qk_scale,
                                mask, half)
        _store_rows(acc, m_i, l_i, q_smem.index(half), o_desc, LSE, FLAGS, program, r, q_ok, tok, b, h, first0, first1,
                    first2, half0, half1, half2, slb, slt, store_lse, half)
        tma.store_wait(0)

    @gluon.jit
    def _consume(q_smem, o_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty, turns, k_desc,
                 o_desc, LSE, FLAGS, STARTS, SPANS, ORDER, ROW_OFFSETS, TILES, NT1, NT2, NTMAX, HQ, work, half0, half1,
                 half2, slb, slt, qk_scale, L0, L1, L2, LMAX, store_lse, mask, half):
        """Consumer of a persistent program: its half of every work item's query tile (``_attend``), then their
        output, whose bulk copy runs on under the next work item (only the next item's output waits for it)."""
        block_d: gl.constexpr = k_smem.type.shape[5]
        h_rows: gl.constexpr = q_smem.type.shape[2] * q_smem.type.shape[3] * q_smem.type.shape[4]
        s_rows: gl.constexpr = gl.SliceLayout(1, _wgmma_layout(k_smem.type.shape[2] * k_smem.type.shape[3] *
                                                               k_smem.type.shape[4]))
        q = q_smem.index(half).reshape([h_rows, block_d])
        done = 0
        turns_done = 0
        item = 0
        for w in range(gl.program_id(0), work, gl.num_programs(0)):
            it, b, h, spans = _work_item(w, SPANS, ORDER, TILES, NT1, NT2, NTMAX, HQ, k_desc)
            (first0, first1, first2, lo0, lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2,
             n_boxes) = spans
            r, q_ok, tok, start0, stop0, start1, stop1, start2, stop2 = _consumer_rows(
                STARTS, ROW_OFFSETS, first0, first1, first2, half, L0, L1, L2, LMAX, h_rows, s_rows)
            mbarrier.wait(q_ready, item & 1)
            acc, m_i, l_i = _attend(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_empty, turns, done,
                                    turns_done, lo0, lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2,
                                    n_boxes, start0, stop0, start1, stop1, start2, stop2, qk_scale, mask, half)
            done += n_boxes
            turns_done += n_boxes + 1
            item += 1
            tma.store_wait(0)  # the previous item's output has left o_smem
            _store_rows(acc, m_i, l_i, o_smem.index(half), o_desc, LSE, FLAGS, it, r, q_ok, tok, b, h, first0, first1,
                        first2, half0, half1, half2, slb, slt, store_lse, half)
        tma.store_wait(0)

    @gluon.jit
    def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                 SPANS, ORDER, TILES, NT1, NT2, NTMAX, HQ, GROUP, work, half0, half1, half2):
        """Producer: every work item's query tile (both halves, once the consumers' last score matmuls on the one
        before are done), then its key boxes (``_load_boxes``)."""
        block_d: gl.constexpr = k_desc.block_type.shape[4]
        done = 0
        item = 0
        for w in range(gl.program_id(0), work, gl.num_programs(0)):
            _, b, h, spans = _work_item(w, SPANS, ORDER, TILES, NT1, NT2, NTMAX, HQ, k_desc)
            first0, first1, first2, lo0, lo1, lo2 = spans[0], spans[1], spans[2], spans[3], spans[4], spans[5]
            n12, n2, n_boxes = spans[12], spans[13], spans[14]
            mbarrier.wait(q_empty, (item & 1) ^ 1)
            mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
            _load_halves(q_desc, q_smem, q_ready, b, first0, first1, first2, half0, half1, half2, h * block_d)
            _load_boxes(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, (h // GROUP) * block_d,
                        lo0, lo1, lo2, n12, n2, n_boxes, done)
            done += n_boxes
            item += 1

    @gluon.jit
    def na_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, FLAGS, STARTS, SPANS, ORDER, ROW_OFFSETS,
                             slb, slt, HQ, GROUP, qk_scale, L0, L1, L2, NT0, NT1, NT2, LMAX, NTMAX,
                             half0, half1, half2, store_lse, mask, work, PERSISTENT_: gl.constexpr,
                             STAGES_: gl.constexpr, CONSUMER_REGS_: gl.constexpr, PRODUCER_REGS_: gl.constexpr):
        # q_desc / k_desc / v_desc / o_desc: Q, K, V and O as [B, L0, L1, L2, heads * D]; Q and O in boxes of half a
        # query tile (the leading axis longer than 1 halved: the first 64 rows in row-major order; ``half*``: the
        # second half's offset per axis), K and V in (1, U0, U1, U2, D) boxes.  STARTS[axis, position] = (start,
        # stop) of the position's window; SPANS[axis, tile] = (lo, hi, in_lo, in_hi, first query, -, -, -) of a query
        # tile; ROW_OFFSETS[axis, row] = the row's offset from the tile's first query.  FLAGS[item, row] = 1 where
        # the row's result holds a NaN / inf.  ``store_lse`` / ``mask``: runtime switches (see the partitions).
        # Work items (query tiles of a batch element and head) run in launch positions (b * HQ + head) * tiles +
        # position, ``work`` of them; ORDER[position] is the tile (``tile_order``: the programs running at once on
        # tiles whose K and V boxes fit in L2 together), and FLAGS are numbered by tile, as the fixup kernel numbers
        # its programs.  PERSISTENT_: program p runs the positions p, p + programs, ... (``HopperForward.main_grid``);
        # otherwise a 2-D grid of positions and b * HQ + head, which the hardware starts in that order.
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = _rings(k_desc, v_desc, STAGES_, 2)
        turns = _turn_barriers()
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=2)  # both consumers hand Q back
        if PERSISTENT_:
            o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
            fence_async_shared()
            consumer = (q_smem, o_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty, turns,
                        k_desc, o_desc, LSE, FLAGS, STARTS, SPANS, ORDER, ROW_OFFSETS, NT0 * NT1 * NT2, NT1, NT2, NTMAX,
                        HQ, work, half0, half1, half2, slb, slt, qk_scale, L0, L1, L2, LMAX, store_lse, mask)
            gl.warp_specialize([
                (_consume, consumer + (gl.to_tensor(0),)),  # the consumer's half of the query box
                (_consume, consumer + (gl.to_tensor(1),)),
                (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                            v_ready, v_empty, SPANS, ORDER, NT0 * NT1 * NT2, NT1, NT2, NTMAX, HQ, GROUP, work, half0,
                            half1, half2)),
            ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])
        else:
            fence_async_shared()
            tile, program, b, h = _program(HQ, ORDER)
            BLOCK_D: gl.constexpr = k_desc.block_type.shape[4]
            (first0, first1, first2, lo0, lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2,
             n_boxes) = _tile_spans(SPANS, NT1, NT2, NTMAX, k_desc, tile)
            mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
            _load_halves(q_desc, q_smem, q_ready, b, first0, first1, first2, half0, half1, half2, h * BLOCK_D)
            consumer = (q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty, turns, o_desc,
                        LSE, FLAGS, STARTS, ROW_OFFSETS, b, h, program, first0, first1, first2, half0, half1, half2,
                        lo0, lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2, n_boxes, slb, slt,
                        qk_scale, L0, L1, L2, LMAX, store_lse, mask)
            gl.warp_specialize([
                (_consume_tile, consumer + (gl.to_tensor(0),)),
                (_consume_tile, consumer + (gl.to_tensor(1),)),
                (_load_kv, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b,
                            (h // GROUP) * BLOCK_D, lo0, lo1, lo2, n12, n2, n_boxes)),
            ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])


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
    """The rows of the programs that ``na_fwd_hopper_kernel`` flagged, again, one window offset at a time; every
    other program reads its flags and ends."""
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
    """A forward problem's launches on the Hopper kernel: the main kernel's and its non-finite fixup's
    (``build_launches``)."""

    q_tile: tuple  # (T0, T1, T2)
    kv_tile: tuple  # (U0, U1, U2)
    grid: tuple  # (query tiles, B * heads): the work items, and the fixup kernel's grid
    masked: bool  # some key tile lies partly outside some row's window (else no tile is masked)
    starts: torch.Tensor  # [3, LMAX, 2] int32: each position's window per axis
    spans: torch.Tensor  # [3, NTMAX, 8] int32: each query tile's key span and first query per axis
    order: torch.Tensor  # [query tiles] int32: the tiles in the order the programs run them (``tile_order``)
    row_offsets: torch.Tensor  # [3, 128] int32: each row's offset from its tile's first query per axis
    scalars: tuple  # the main kernel's, after its tensor arguments
    meta: dict
    fixup_scalars: tuple
    fixup_meta: dict
    q_layout: tuple  # (shape, strides, box) of Q's descriptor, one box per consumer (``half_box``)
    kv_layouts: tuple
    o_layout: tuple  # the output's, boxed as Q (the launcher's fresh contiguous ``[B, N, H, D]`` output)

    @property
    def programs(self) -> int:
        """Work items (query tiles of every batch element and head)."""
        return self.grid[0] * self.grid[1]

    @property
    def persistent(self) -> bool:
        """Whether the main kernel runs one program per SM over all work items (``PERSISTENT_MASKED``,
        ``PERSISTENT_MASKED_RANKS``; decided by ``build_launches`` for the kernel's ``PERSISTENT_``)."""
        return self.meta["PERSISTENT_"]

    def main_grid(self, device: torch.device) -> tuple:
        """The main kernel's programs: one per SM (its shared memory takes an SM) or one per work item."""
        return (min(self.programs, multiprocessors(device)),) if self.persistent else self.grid


def window_tables(params: NAParams, q_tile) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(starts, spans, row_offsets)``, on the host: per axis (leading dummy axes first), every position's window
    ``[start, stop)``; every query tile's key span ``[lo, hi)``, the part ``[in_lo, in_hi)`` inside all its rows'
    windows and its first query (padded to 8 fields); and each of a tile's rows' offsets from that first query."""
    axes = [tiles.Axis(1, 1, 1)] * (3 - params.rank) + tiles.axes_of(params)
    lmax = max(ax.Lg for ax in axes)
    ntmax = max(-(-ax.Lg // t) for ax, t in zip(axes, q_tile))
    starts = torch.zeros(3, lmax, 2, dtype=torch.int32)
    spans = torch.zeros(3, ntmax, 8, dtype=torch.int32)
    for a, (ax, t) in enumerate(zip(axes, q_tile)):
        start, stop = tiles.axis_windows(ax)  # the tile search's windows (ops.window's rules), cached per axis
        starts[a, :ax.Lg] = torch.tensor([start, stop], dtype=torch.int32).T
        for tile in range(-(-ax.Lg // t)):
            first, last = tile * t, min(tile * t + t, ax.Lg) - 1
            spans[a, tile, :5] = torch.tensor([start[first], stop[last], start[last], stop[first], first],
                                              dtype=torch.int32)
    return starts, spans, tile_row_offsets(q_tile, math.prod(q_tile))


def tile_row_offsets(tile, rows: int) -> torch.Tensor:
    """``[3, rows]`` int32: the offset of each of a tile's first ``rows`` rows (row-major) from its first position,
    per axis (the forward's and dQ's ``ROW_OFFSETS``, dK/dV's ``KEY_OFFSETS``)."""
    r = torch.arange(rows)
    _, t1, t2 = tile
    return torch.stack([r // (t1 * t2), (r // t2) % t1, r % t2]).to(torch.int32)


def tile_order(counts: tuple, spans: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The order a launch runs a grid of ``counts`` tiles in (per axis, leading dummy axes 1), as an int32 table on
    ``device``: ``launch_order.block_order`` over the tiles' spans (``spans[axis, tile, :2]``) for runs of one L2
    partition's share of the programs in flight (one per SM), or row-major where ``ORDERED`` is off."""
    at_once = max(1, multiprocessors(device) // L2_PARTITIONS)
    if ORDERED:
        order = launch_order.block_order(counts, spans, at_once)
    else:
        order = launch_order.blocked(counts, counts)
    return order.to(device=device, dtype=torch.int32)


def query_boxes(params: NAParams, device) -> tuple:
    """The launch geometry the forward and dQ kernels share: ``(q_tile, kv_tile, masked, programs, nt, tables,
    order)``, the 128-row query box and 128-key box per axis (``tiles.choose_tiles``, leading dummy axes first),
    whether some key box of some program needs a mask, the programs per batch element and head, the query tiles per
    axis, the window tables (``window_tables``) and the order the tiles run in (``tile_order``)."""
    from . import decide, launch

    q_tile, kv_tile, masked = decide.query_tiles(params)
    window, programs = launch._window_args(params, q_tile)
    nt = tuple(window[12:15])
    tables = window_tables(params, q_tile)  # on the host: the order is searched on their spans, then they move
    device = torch.device(device)
    order = tile_order(nt, tables[1], device)
    return q_tile, kv_tile, masked, programs, nt, tuple(t.to(device) for t in tables), order


def fixup_meta(params: NAParams, q_tile, d: int) -> dict:
    """The constexprs of a non-finite fixup kernel over the query boxes ``q_tile`` (``na_fwd_nonfinite_kernel``,
    ``hopper_dq.na_bwd_dq_nonfinite_kernel``)."""
    from . import decide, launch

    C = launch._axes3(params)[4]
    return dict(CAUSAL0=C[0], CAUSAL1=C[1], CAUSAL2=C[2], ACT0=params.rank >= 3, ACT1=params.rank >= 2,
                T0=q_tile[0], T1=q_tile[1], T2=q_tile[2], BLOCK_D=d, IDX64=False, SUB=decide.gather_rows(d, d),
                num_warps=4, num_stages=1)


def build_launches(q4, k4, v4, params: NAParams, scale: float, need_lse: bool) -> HopperForward:
    """Tiles, tables, grid and arguments of a problem ``decide.hopper_unsupported`` accepted."""
    from . import decide, launch

    b, n, hq, hkv, d = q4.shape[0], params.num_tokens, q4.shape[-2], k4.shape[-2], q4.shape[-1]
    q_tile, kv_tile, masked, programs, nt, (starts, spans, row_offsets), order = query_boxes(params, q4.device)
    L, K, S, _, _ = launch._axes3(params)
    lse_strides = (n * hq, hq) if need_lse else (0, 0)
    out4 = torch.empty((b, n, hq, d), device="meta")
    out_strides = out4.stride()[:3]
    qk_scale = scale * kernels.LOG2E
    box, offset = half_box(q_tile)
    scalars = (*lse_strides, hq, hq // hkv, qk_scale, *L, *nt, starts.shape[1], spans.shape[1],
               *offset, int(need_lse), int(masked), programs * b * hq)
    meta = dict(PERSISTENT_=decide.runs_persistent(params, masked), STAGES_=STAGES, CONSUMER_REGS_=CONSUMER_REGS,
                PRODUCER_REGS_=PRODUCER_REGS, num_warps=4)
    fixup_scalars = (*launch._strides(q4), *launch._strides(k4), *launch._strides(v4), *out_strides, *lse_strides,
                     hq, hq // hkv, d, qk_scale, *L, *K, *S, *nt)
    return HopperForward(q_tile, kv_tile, (programs, b * hq), masked, starts, spans, order, row_offsets, scalars,
                         meta, fixup_scalars, dict(fixup_meta(params, q_tile, d), STORE_LSE=need_lse),
                         decide.host_kv_layouts(params, q4, q4, box)[0],
                         decide.host_kv_layouts(params, k4, v4, kv_tile),
                         decide.host_kv_layouts(params, out4, out4, box)[0])


def half_box(q_tile) -> tuple[tuple, tuple]:
    """``(box, offset)``: the query box of one consumer (the leading axis longer than 1 halved, so it holds the
    first 64 of the tile's rows in row-major order) and the second half's offset from the first."""
    axis = next(a for a, t in enumerate(q_tile) if t > 1)
    box = tuple(t // 2 if a == axis else t for a, t in enumerate(q_tile))
    return box, tuple(box[a] if a == axis else 0 for a in range(3))


def _descriptor(t: torch.Tensor, shape, strides, block) -> "GluonDescriptor":
    element = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return GluonDescriptor(t, list(shape), list(strides), list(block),
                           gl.NVMMASharedLayout.get_default_for(list(block), element))
