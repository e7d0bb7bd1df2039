"""dQ on Hopper (sm_90): a warp-specialised Gluon kernel for large windows, built like the forward (``hopper``).

One program owns the forward's 128-row query box.  A one-warp producer copies the K and V boxes of the box's key span
(TMA) into two rings of shared-memory stages (``hopper._load_kv``); two consumer warpgroups each hold 64 rows of Q and
dO in shared memory and run, per key box,

    S = Q K^T,  dP = dO V^T         (wgmma, issued together in the consumer's turn)
    P = exp2(S * scale * log2(e) - lse),  dS = P (dP - delta)
    dQ += dS K                      (dS straight from registers)

handing the V stage back once dP is in and the K stage once dS K is done.  Each consumer first computes its rows'
``delta = rowsum(dO * O) - dlse`` and stores it for dK/dV, which runs next, as the portable dQ kernel does.

Masks and tables are the forward's (``hopper.window_tables``): a key box inside every row's window skips the mask.
A program whose dQ holds a NaN or an infinity flags its rows, and ``na_bwd_dq_nonfinite_kernel`` recomputes them one
window offset at a time (``kernels._dq_by_offset``), so non-finite inputs stay inside the windows that hold them.

It runs where ``decide.hopper_unsupported`` accepts the problem and dO and O allow the same descriptors; everything else
takes the portable kernel (``kernels.na_bwd_dq_kernel``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import hopper, kernels
from .kernels import _dq_by_offset, _program_group
from ..window import NAParams

gluon, gl = hopper.gluon, (hopper.gl if hopper.gluon is not None else None)
if gluon is not None:
    from .hopper import (_await_turn, _box_reciprocals, _consumer_rows, _load_halves, _load_kv, _mask_box, _pass_turn,
                         _program, _register_operand, _rings, _step_box, _tile_spans, _turn_barriers, _wgmma_layout,
                         fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

STAGES = 2  # K/V stages in shared memory
CONSUMER_REGS = 240  # S, dP and the dQ accumulator: 192 of a consumer thread's registers at head dim 128
PRODUCER_REGS = 24


if gluon is not None:

    @gluon.jit
    def _consume_rows(q_smem, do_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_bar, turns, O, DLSE, LSE,
                      DELTA, DQ, FLAGS, STARTS, ROW_OFFSETS, b, h, program, first0, first1, first2, lo0, lo1, lo2,
                      in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2, n_tiles, sob, sot, soh, sgb, sgt, sgh,
                      slb, slt, qk_scale, scale, L0, L1, L2, LMAX, has_dlse, mask, half):
        """Consumer: delta, then dQ of 64 query rows against every stage the producer fills, then their flags."""
        stages: gl.constexpr = k_smem.type.shape[0]
        U0: gl.constexpr = k_smem.type.shape[2]
        U1: gl.constexpr = k_smem.type.shape[3]
        U2: gl.constexpr = k_smem.type.shape[4]
        block_d: gl.constexpr = k_smem.type.shape[5]
        h_rows: gl.constexpr = q_smem.type.shape[2] * q_smem.type.shape[3] * q_smem.type.shape[4]
        cols: gl.constexpr = U0 * U1 * U2
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = _wgmma_layout(cols)
        g_layout: gl.constexpr = _wgmma_layout(block_d)
        ds_layout: gl.constexpr = _register_operand(g_layout)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        g_rows: gl.constexpr = gl.SliceLayout(1, g_layout)

        r, q_ok, tok, start0, stop0, start1, stop1, start2, stop2 = _consumer_rows(
            STARTS, ROW_OFFSETS, first0, first1, first2, half, L0, L1, L2, LMAX, h_rows, s_rows)
        l_off = b.to(gl.int64) * slb + tok * slt + h
        lse2 = gl.load(LSE + l_off, mask=q_ok, other=0.0) * 1.4426950408889634

        # delta = rowsum(dO * O) - dlse, from dO in shared memory and O read once
        tok_g = gl.convert_layout(tok, g_rows)
        ok_g = gl.convert_layout(q_ok, g_rows)
        d = gl.arange(0, block_d, layout=gl.SliceLayout(0, g_layout))
        o = gl.load(O + b.to(gl.int64) * sob + h * soh + tok_g[:, None] * sot + d[None, :], mask=ok_g[:, None],
                    other=0.0)
        do = do_smem.index(half).reshape([h_rows, block_d])
        q = q_smem.index(half).reshape([h_rows, block_d])
        mbarrier.wait(q_bar, 0)
        delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.load(g_layout).to(gl.float32), 1), s_rows)
        if has_dlse:
            delta -= gl.load(DLSE + l_off, mask=q_ok, other=0.0)
        gl.store(DELTA + l_off, delta, mask=q_ok)

        acc = gl.zeros([h_rows, block_d], gl.float32, layout=g_layout)
        n12_inv, n2_inv = _box_reciprocals(n12, n2)
        for t in range(n_tiles):
            stage = t % stages
            phase = (t // stages) & 1
            mbarrier.wait(k_ready.index(stage), phase)
            mbarrier.wait(v_ready.index(stage), phase)
            k_tile = k_smem.index(stage).reshape([cols, block_d])
            _await_turn(turns, half, t)
            s = warpgroup_mma(q, k_tile.permute((1, 0)), gl.zeros([h_rows, cols], gl.float32, layout=s_layout),
                              use_acc=False, is_async=True)
            dp = warpgroup_mma(do, v_smem.index(stage).reshape([cols, block_d]).permute((1, 0)),
                               gl.zeros([h_rows, cols], gl.float32, layout=s_layout), use_acc=False, is_async=True)
            _pass_turn(turns, half)
            s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
            mbarrier.arrive(v_empty.index(stage), count=1)
            if mask:  # the box decoded from t: carried coordinates, as the forward steps them, were slower here
                k0, k1, k2 = _step_box(t, n12, n2, n12_inv, n2_inv, lo0, lo1, lo2, U0, U1, U2)
                s = _mask_box(s, k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, start0, stop0, start1,
                              stop1, start2, stop2, U0, U1, U2)
            p = gl.exp2(s * qk_scale - lse2[:, None])
            ds = p * (dp - delta[:, None])
            acc = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds_layout), k_tile, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(k_empty.index(stage), count=1)

        dq = acc * scale
        nonfinite = gl.convert_layout(gl.sum(dq * 0.0, 1) != 0.0, s_rows)
        gl.store(FLAGS + program * (2 * h_rows) + r, nonfinite.to(gl.int8))
        gl.store(DQ + b.to(gl.int64) * sgb + h * sgh + tok_g[:, None] * sgt + d[None, :], dq.to(dtype),
                 mask=ok_g[:, None])

    @gluon.jit
    def na_bwd_dq_hopper_kernel(q_desc, do_desc, k_desc, v_desc, O, DLSE, LSE, DELTA, DQ, FLAGS, STARTS, SPANS,
                                ORDER, ROW_OFFSETS, sob, sot, soh, sgb, sgt, sgh, slb, slt, HQ, GROUP, qk_scale, scale,
                                L0, L1, L2, NT0, NT1, NT2, LMAX, NTMAX, half0, half1, half2, has_dlse, mask,
                                STAGES_: gl.constexpr, CONSUMER_REGS_: gl.constexpr, PRODUCER_REGS_: gl.constexpr):
        # q_desc / do_desc: Q and dO as [B, L0, L1, L2, heads * D] in boxes of half a query tile (``hopper.half_box``;
        # ``half*``: the second half's offset per axis); k_desc / v_desc: K and V in (1, U0, U1, U2, D) boxes.
        # STARTS / SPANS / ROW_OFFSETS: the forward's window tables (``hopper.window_tables``).  O: the forward's
        # output (strides sob, sot, soh); DQ: dQ (sgb, sgt, sgh); LSE, DELTA and DLSE share strides (slb, slt), and
        # DLSE is read where ``has_dlse``.  FLAGS[program, row] = 1 where the row's dQ holds a NaN / inf.
        tile, program, b, h = _program(HQ, ORDER)
        BLOCK_D: gl.constexpr = k_desc.block_type.shape[4]
        (first0, first1, first2, lo0, lo1, lo2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, n12, n2,
         n_tiles) = _tile_spans(SPANS, NT1, NT2, NTMAX, k_desc, tile)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = _rings(k_desc, v_desc, STAGES_, 2)
        turns = _turn_barriers()
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        fence_async_shared()

        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
        _load_halves(q_desc, q_smem, q_bar, b, first0, first1, first2, half0, half1, half2, h * BLOCK_D)
        _load_halves(do_desc, do_smem, q_bar, b, first0, first1, first2, half0, half1, half2, h * BLOCK_D)

        args = (q_smem, do_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_bar, turns, O, DLSE, LSE, DELTA,
                DQ, FLAGS, STARTS, ROW_OFFSETS, b, h, program, first0, first1, first2, lo0, lo1, lo2, in_lo0, in_hi0,
                in_lo1, in_hi1, in_lo2, in_hi2, n12, n2, n_tiles, sob, sot, soh, sgb, sgt, sgh, slb, slt, qk_scale,
                scale, L0, L1, L2, LMAX, has_dlse, mask)
        gl.warp_specialize([
            (_consume_rows, args + (gl.to_tensor(0),)),  # the consumer's half of the query box
            (_consume_rows, args + (gl.to_tensor(1),)),
            (_load_kv, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, (h // GROUP) * BLOCK_D,
                        lo0, lo1, lo2, n12, n2, n_tiles)),
        ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])


@triton.jit
def na_bwd_dq_nonfinite_kernel(
    Q, Kp, V, DO, LSE, DELTA, DQ, FLAGS,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, slb, slt, sgb, sgt, sgh,
    HQ, GROUP, HEAD_DIM, qk_scale, scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, NT0, NT1, NT2,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    BLOCK_D: tl.constexpr, IDX64: tl.constexpr, SUB: tl.constexpr,
):
    """dQ of the rows of the programs that ``na_bwd_dq_hopper_kernel`` flagged, again, one window offset at a time;
    every other program reads its flags and ends."""
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    if tl.max(tl.load(FLAGS + program * (T0 * T1 * T2) + tl.arange(0, T0 * T1 * T2)), 0) != 0:
        g0, tile0, g1, tile1, g2, tile2, b, h, Lg0, Lg1, Lg2 = _program_group(NT0, NT1, NT2, 1, 1, 1, L0, L1, L2,
                                                                             HQ, ACT0, ACT1)
        hk = h // GROUP
        b64 = b.to(tl.int64)
        _dq_by_offset(Q, Kp, V, Q, DO, LSE, DELTA, DQ, b64 * sqb + h * sqh, b64 * skb + hk * skh,
                      b64 * svb + hk * svh, b64 * sdb + h * sdh, b64 * slb, b64 * sgb + h * sgh, sqt, skt, svt, sdt,
                      slt, sgt, h, tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2,
                      1, 1, 1, HEAD_DIM, HEAD_DIM, qk_scale, scale, CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2, SUB,
                      BLOCK_D, BLOCK_D, False, IDX64)


@dataclass(frozen=True)
class HopperDq:
    """A backward problem's dQ launches on the Hopper kernel: the main kernel's and its non-finite fixup's
    (``build_launches``)."""

    grid: tuple
    starts: torch.Tensor  # the forward's window tables (``hopper.window_tables``)
    spans: torch.Tensor
    order: torch.Tensor  # the query tiles in the order the programs run them (``hopper.tile_order``)
    row_offsets: torch.Tensor
    scalars: tuple  # the main kernel's, after its tensor arguments
    meta: dict
    fixup_scalars: tuple
    fixup_meta: dict
    q_layouts: tuple  # (shape, strides, box) of Q's and dO's descriptors, one box per consumer
    kv_layouts: tuple
    q_tile: tuple = ()  # the forward's boxes (``decide.query_tiles``)
    kv_tile: tuple = ()
    masked: bool = False

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1]


def build_launches(q4, k4, v4, do4, o4, params: NAParams, scale: float, dq) -> HopperDq:
    """Tiles, tables, grid and arguments of a problem ``decide.hopper_dq_unsupported`` accepted; ``dq``: the
    ``[B, N, Hq, D]`` buffer (view) the launches write, whose strides are part of their arguments."""
    from . import decide, launch

    b, hq, hkv, d = q4.shape[0], q4.shape[-2], k4.shape[-2], q4.shape[-1]
    q_tile, kv_tile, masked, programs, nt, (starts, spans, row_offsets), order = hopper.query_boxes(params, q4.device)
    L, K, S, _, _ = launch._axes3(params)
    lse_strides = (params.num_tokens * hq, hq)
    box, offset = hopper.half_box(q_tile)
    scalars = (*launch._strides(o4), *launch._strides(dq), *lse_strides, hq, hq // hkv, scale * kernels.LOG2E, scale,
               *L, *nt, starts.shape[1], spans.shape[1], *offset)
    meta = dict(STAGES_=STAGES, CONSUMER_REGS_=CONSUMER_REGS, PRODUCER_REGS_=PRODUCER_REGS, num_warps=4)
    fixup_scalars = (*launch._strides(q4), *launch._strides(k4), *launch._strides(v4), *launch._strides(do4),
                     *lse_strides, *launch._strides(dq), hq, hq // hkv, d, scale * kernels.LOG2E, scale, *L, *K, *S,
                     *nt)
    return HopperDq((programs, b * hq), starts, spans, order, row_offsets, (*scalars, int(masked)), meta, fixup_scalars,
                    hopper.fixup_meta(params, q_tile, d), decide.host_kv_layouts(params, q4, do4, box),
                    decide.host_kv_layouts(params, k4, v4, kv_tile), q_tile, kv_tile, masked)
