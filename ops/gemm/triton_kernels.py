"""PN / NN / IN as Triton kernels: N-D query tiles, haloed key tiles, tensor-core tile GEMMs.

One program handles one N-D tile of queries (PN, NN) or keys (IN) of one dilation group, for one batch
element and head.  It walks the tile's halo (PN, NN: the keys covering the union of its windows) or
inverse neighborhood (IN: the queries whose windows meet its keys) in flat chunks, multiplies whole
chunks on the tensor cores, and keeps only the (query, key) pairs the window admits:

* PN scatters the admitted logits to ``out[query, slot]`` (optionally: + RPB, or the attention-backward
  epilogue ``dS = P * (dP - delta)``);
* NN gathers the admitted weights into a ``[queries, keys]`` tile and multiplies it with the value tile;
* IN gathers the transposed weights ``[keys, queries]`` and multiplies them with the query-side tile, so
  every key's gradient is written by exactly one program (no atomics, deterministic).

Which pairs are admitted is read from tables built by ``ops.gemm.tiles`` out of ``ops.window`` (the
window start and length of every query coordinate, the halo / inverse range of every tile): the kernels
re-derive no window rule.  Problems are padded to three spatial axes; ``RANK`` (constexpr) skips the
padded axes' pair arithmetic.

NN and IN multiply whole chunks, so a zero weight times a NaN (or infinite) value or query row would reach
rows whose windows do not hold it.  Their loops stay as they are; a program whose result holds a NaN or an
infinity computes its rows again pair by pair (``_nn_by_slot``, ``_in_by_query``), where a row only meets
its own window's entries (the fused backend does the same, ``ops/fused/kernels.py``).  Token rows are
indexed in int64 from the batch index on (``_token_row``), and grids are split by batch where B * heads
passes CUDA's grid limit (``ops.fused.decide.batch_chunks``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..fused import decide as fused_decide
from ..window import NAParams
from .tiles import kernel_tables, kernel_tile_shape, pad_to_3d

NUM_FIELDS = 6  # fields per tile in the tile tables (tiles.Q_ORIGIN .. H_LEN / K_ORIGIN .. R_LEN)
BLOCK_CHUNK = 64  # keys (PN, NN) or queries (IN) per inner GEMM step
MAX_HEAD_DIM = 256


@triton.jit
def _tile_axis(tab_ptr, TM, axis: tl.constexpr, u, t, dil):
    """Per-axis view of tile ``u``: rows ``t`` of the tile and its key (or query) range."""
    base = tab_ptr + axis * 6 * TM + u
    origin = tl.load(base)
    first = tl.load(base + TM)
    count = tl.load(base + 2 * TM)
    r_origin = tl.load(base + 3 * TM)
    r_first = tl.load(base + 4 * TM)
    r_len = tl.load(base + 5 * TM)
    ok = t < count
    coord = tl.where(ok, origin + t * dil, 0)
    return ok, coord, first + t, r_origin, r_first, r_len


@triton.jit
def _window(wtab_ptr, WM, axis: tl.constexpr, coord, ok):
    """Window start (group coords) and length of the queries at ``coord`` on ``axis``."""
    start = tl.load(wtab_ptr + (axis * 2) * WM + coord, mask=ok, other=0)
    length = tl.load(wtab_ptr + (axis * 2 + 1) * WM + coord, mask=ok, other=0)
    return start, length


@triton.jit
def _token_row(bi, n, token, heads, h):
    """Flat row ``(bi * n + token) * heads + h`` of a ``[B, N, heads, ...]`` tensor, in int64 from the batch index on:
    ``bi * n`` alone passes 2**31 on large maps."""
    return (bi.to(tl.int64) * n + token) * heads + h


@triton.jit
def _holds_nonfinite(x):
    """Whether a [rows, cols] tile holds a NaN or an infinity (``x * 0`` is 0 for a finite ``x``, else NaN)."""
    return tl.sum(tl.sum(x * 0.0, 1), 0) != 0.0


@triton.jit
def _unflatten(f, len1, len2):
    """Flat index over a [len0, len1, len2] range -> per-axis offsets."""
    f2 = f % len2
    rest = f // len2
    return rest // len1, rest % len1, f2


@triton.jit
def _coord_row(bi, n, c0, c1, c2, L1, L2, heads, h):
    """``_token_row`` of the token at coordinates ``(c0, c1, c2)`` of an ``[L0, L1, L2]`` map."""
    return _token_row(bi, n, (c0 * L1 + c1) * L2 + c2, heads, h)


@triton.jit
def _program_tile(heads, TPA1, TPA2):
    """The program's batch element, head (of ``heads``) and tile index per axis, on a ``(tiles, B * heads)`` grid
    whose tiles are numbered row-major over ``[TPA0, TPA1, TPA2]``."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    u2 = pid % TPA2
    u1 = (pid // TPA2) % TPA1
    u0 = pid // (TPA2 * TPA1)
    return bh // heads, bh % heads, u0, u1, u2


@triton.jit
def _tile_rows(tab_ptr, TM, u0, u1, u2, r, T1: tl.constexpr, T2: tl.constexpr, DIL0, DIL1, DIL2):
    """``_tile_axis`` on the three axes for the rows ``r`` (flat, row-major over ``[T0, T1, T2]``) of tile
    ``(u0, u1, u2)``: whether each row exists, then per axis its coordinates, its group coordinates and the tile's
    range origin, first group coordinate and length."""
    ok0, c0, g0, o0, f0, n0 = _tile_axis(tab_ptr, TM, 0, u0, r // (T1 * T2), DIL0)
    ok1, c1, g1, o1, f1, n1 = _tile_axis(tab_ptr, TM, 1, u1, (r // T2) % T1, DIL1)
    ok2, c2, g2, o2, f2, n2 = _tile_axis(tab_ptr, TM, 2, u2, r % T2, DIL2)
    return ok0 & ok1 & ok2, c0, c1, c2, g0, g1, g2, o0, o1, o2, f0, f1, f2, n0, n1, n2


@triton.jit
def _windows(wtab_ptr, WM, c0, c1, c2, ok):
    """``_window`` on the three axes: window start and length per axis of the queries at ``(c0, c1, c2)``."""
    ws0, wl0 = _window(wtab_ptr, WM, 0, c0, ok)
    ws1, wl1 = _window(wtab_ptr, WM, 1, c1, ok)
    ws2, wl2 = _window(wtab_ptr, WM, 2, c2, ok)
    return ws0, wl0, ws1, wl1, ws2, wl2


@triton.jit
def _window_slots(kg0, kg1, kg2, ws0, wl0, ws1, wl1, ws2, wl2, K1, K2, RANK: tl.constexpr):
    """Whether each key (group coordinates ``kg``) lies in each query's window (start ``ws``, length ``wl``), and its
    slot there, row-major over ``[K0, K1, K2]``; the caller broadcasts keys against queries.  Axes past ``RANK`` are
    padding (one key, one query) and are not compared."""
    s2 = kg2 - ws2
    ok = (s2 >= 0) & (s2 < wl2)
    slot = s2
    if RANK >= 2:
        s1 = kg1 - ws1
        ok = ok & (s1 >= 0) & (s1 < wl1)
        slot = slot + s1 * K2
    if RANK >= 3:
        s0 = kg0 - ws0
        ok = ok & (s0 >= 0) & (s0 < wl0)
        slot = slot + s0 * (K1 * K2)
    return ok, slot


@triton.jit
def _chunk(f_lo, total, len1, len2, BLOCK: tl.constexpr):
    """Entries ``f_lo .. f_lo + BLOCK - 1`` of a flat ``[len0, len1, len2]`` range (a tile's halo or inverse
    neighborhood): whether each lies in the range (``total`` entries), and its offsets per axis."""
    f = f_lo + tl.arange(0, BLOCK)
    f_ok = f < total
    f0, f1, f2 = _unflatten(f, len1, len2)
    return f_ok, f0, f1, f2


@triton.jit
def _pn_kernel(a_ptr, b_ptr, out_ptr, rpb_ptr, lg_ptr, lse_ptr, delta_ptr, qtab_ptr, wtab_ptr, TM, WM,
               N, HA, HB, D, W, scale, L1, L2, K0, K1, K2, R, DIL0, DIL1, DIL2, TPA1, TPA2,
               T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_D: tl.constexpr, RANK: tl.constexpr, HAS_RPB: tl.constexpr, DS_MODE: tl.constexpr,
               PREC: tl.constexpr, ACC: tl.constexpr):
    BLOCK_Q: tl.constexpr = T0 * T1 * T2
    bi, h, u0, u1, u2 = _program_tile(HA, TPA1, TPA2)
    hb = h // (HA // HB)
    q_ok, qc0, qc1, qc2, qg0, qg1, qg2, ho0, ho1, ho2, hs0, hs1, hs2, hl0, hl1, hl2 = _tile_rows(
        qtab_ptr, TM, u0, u1, u2, tl.arange(0, BLOCK_Q), T1, T2, DIL0, DIL1, DIL2)
    ws0, wl0, ws1, wl1, ws2, wl2 = _windows(wtab_ptr, WM, qc0, qc1, qc2, q_ok)
    row = _coord_row(bi, N, qc0, qc1, qc2, L1, L2, HA, h)  # [BLOCK_Q] (batch, query, head)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(a_ptr + row[:, None] * D + d[None, :], mask=q_ok[:, None] & (d[None, :] < D), other=0.0)
    if DS_MODE:
        lse = tl.load(lse_ptr + row, mask=q_ok, other=0.0)
        delta = tl.load(delta_ptr + row, mask=q_ok, other=0.0)
    halo = hl0 * hl1 * hl2
    for f_lo in range(0, halo, BLOCK_K):
        f_ok, f0, f1, f2 = _chunk(f_lo, halo, hl1, hl2, BLOCK_K)
        key = _coord_row(bi, N, ho0 + f0 * DIL0, ho1 + f1 * DIL1, ho2 + f2 * DIL2, L1, L2, HB, hb)
        k = tl.load(b_ptr + key[None, :] * D + d[:, None], mask=f_ok[None, :] & (d[:, None] < D), other=0.0)
        s = tl.dot(q, k, input_precision=PREC) * scale  # [BLOCK_Q, BLOCK_K]: whole tile x halo chunk
        # Keep the admitted pairs: per axis, key's group coord minus the query's window start.
        ok, slot = _window_slots((hs0 + f0)[None, :], (hs1 + f1)[None, :], (hs2 + f2)[None, :], ws0[:, None],
                                 wl0[:, None], ws1[:, None], wl1[:, None], ws2[:, None], wl2[:, None], K1, K2, RANK)
        ok = ok & q_ok[:, None] & f_ok[None, :]
        if HAS_RPB:
            # Bias index j' - i' + K - 1 per axis, row-major over the (2K - 1)-sized axes of rpb.
            rel = (hs2 + f2)[None, :] - qg2[:, None] + (K2 - 1)
            if RANK >= 2:
                rel = rel + ((hs1 + f1)[None, :] - qg1[:, None] + (K1 - 1)) * (2 * K2 - 1)
            if RANK >= 3:
                rel = rel + ((hs0 + f0)[None, :] - qg0[:, None] + (K0 - 1)) * ((2 * K1 - 1) * (2 * K2 - 1))
            s += tl.load(rpb_ptr + h * R + rel, mask=ok, other=0.0).to(ACC)
        dst = row[:, None] * W + slot
        if DS_MODE:
            logit = tl.load(lg_ptr + dst, mask=ok, other=0.0).to(ACC)
            s = tl.exp(logit - lse[:, None]) * (s - delta[:, None])
        tl.store(out_ptr + dst, s.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _nn_kernel(w_ptr, v_ptr, out_ptr, lse_ptr, qtab_ptr, wtab_ptr, TM, WM,
               N, HA, HB, DV, W, scale, L1, L2, K1, K2, DIL0, DIL1, DIL2, TPA1, TPA2,
               T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_DV: tl.constexpr, RANK: tl.constexpr, LSE_MODE: tl.constexpr, PREC: tl.constexpr,
               ACC: tl.constexpr, GATHER_ROWS: tl.constexpr):
    BLOCK_Q: tl.constexpr = T0 * T1 * T2
    bi, h, u0, u1, u2 = _program_tile(HA, TPA1, TPA2)
    hb = h // (HA // HB)
    q_ok, qc0, qc1, qc2, qg0, qg1, qg2, ho0, ho1, ho2, hs0, hs1, hs2, hl0, hl1, hl2 = _tile_rows(
        qtab_ptr, TM, u0, u1, u2, tl.arange(0, BLOCK_Q), T1, T2, DIL0, DIL1, DIL2)
    ws0, wl0, ws1, wl1, ws2, wl2 = _windows(wtab_ptr, WM, qc0, qc1, qc2, q_ok)
    row = _coord_row(bi, N, qc0, qc1, qc2, L1, L2, HA, h)
    if LSE_MODE:
        lse = tl.load(lse_ptr + row, mask=q_ok, other=0.0)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_Q, BLOCK_DV], dtype=ACC)
    halo = hl0 * hl1 * hl2
    for f_lo in range(0, halo, BLOCK_K):
        f_ok, f0, f1, f2 = _chunk(f_lo, halo, hl1, hl2, BLOCK_K)
        ok, slot = _window_slots((hs0 + f0)[None, :], (hs1 + f1)[None, :], (hs2 + f2)[None, :], ws0[:, None],
                                 wl0[:, None], ws1[:, None], wl1[:, None], ws2[:, None], wl2[:, None], K1, K2, RANK)
        ok = ok & q_ok[:, None] & f_ok[None, :]
        p = tl.load(w_ptr + row[:, None] * W + slot, mask=ok, other=0.0).to(ACC)
        if LSE_MODE:
            p = tl.where(ok, tl.exp(p - lse[:, None]), 0.0)
        # the key rows after the weights: computed before them, ptxas emits more instructions for this kernel
        key = _coord_row(bi, N, ho0 + f0 * DIL0, ho1 + f1 * DIL1, ho2 + f2 * DIL2, L1, L2, HB, hb)
        v = tl.load(v_ptr + key[:, None] * DV + dv[None, :], mask=f_ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    if _holds_nonfinite(acc):  # a NaN / inf value or weight reached the tile: its rows again, pair by pair (rare)
        _nn_by_slot(w_ptr, v_ptr, out_ptr, lse_ptr, qtab_ptr, wtab_ptr, TM, WM, u0, u1, u2, bi, h, hb, N, HA, HB, DV,
                    W, scale, L1, L2, K1, K2, DIL0, DIL1, DIL2, T0, T1, T2, GATHER_ROWS, BLOCK_DV, LSE_MODE, ACC)
    else:
        acc = acc * scale
        tl.store(out_ptr + row[:, None] * DV + dv[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=q_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def _nn_by_slot(w_ptr, v_ptr, out_ptr, lse_ptr, qtab_ptr, wtab_ptr, TM, WM, u0, u1, u2, bi, h, hb, N, HA, HB, DV, W,
                scale, L1, L2, K1, K2, DIL0, DIL1, DIL2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                SUB: tl.constexpr, BLOCK_DV: tl.constexpr, LSE_MODE: tl.constexpr, ACC: tl.constexpr):
    """NN for the program's query tile, ``SUB`` rows at a time: per row and window slot, its weight times the value
    row of that slot's key (empty slots skipped), stored to ``out``."""
    dv = tl.arange(0, BLOCK_DV)
    for first in tl.range(0, T0 * T1 * T2, SUB, num_stages=1):
        q_ok, qc0, qc1, qc2, _, _, _, _, _, _, _, _, _, _, _, _ = _tile_rows(
            qtab_ptr, TM, u0, u1, u2, first + tl.arange(0, SUB), T1, T2, DIL0, DIL1, DIL2)
        ws0, wl0, ws1, wl1, ws2, wl2 = _windows(wtab_ptr, WM, qc0, qc1, qc2, q_ok)
        row = _coord_row(bi, N, qc0, qc1, qc2, L1, L2, HA, h)
        if LSE_MODE:
            lse = tl.load(lse_ptr + row, mask=q_ok, other=0.0)
        acc = tl.zeros([SUB, BLOCK_DV], dtype=ACC)
        for slot in tl.range(0, W, num_stages=1):
            s0 = slot // (K1 * K2)
            s1 = (slot // K2) % K1
            s2 = slot % K2
            ok = q_ok & (s0 < wl0) & (s1 < wl1) & (s2 < wl2)
            kc0 = (ws0 + s0) * DIL0 + qc0 % DIL0  # the slot's key, original coordinates
            kc1 = (ws1 + s1) * DIL1 + qc1 % DIL1
            kc2 = (ws2 + s2) * DIL2 + qc2 % DIL2
            key = _coord_row(bi, N, kc0, kc1, kc2, L1, L2, HB, hb)
            p = tl.load(w_ptr + row * W + slot, mask=ok, other=0.0).to(ACC)
            if LSE_MODE:
                p = tl.exp(p - lse)
            v = tl.load(v_ptr + key[:, None] * DV + dv[None, :], mask=ok[:, None] & (dv[None, :] < DV), other=0.0)
            acc += tl.where(ok[:, None], p[:, None] * v.to(ACC), 0.0)
        tl.store(out_ptr + row[:, None] * DV + dv[None, :], (acc * scale).to(out_ptr.dtype.element_ty),
                 mask=q_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def _in_kernel(w_ptr, x_ptr, out_ptr, lse_ptr, ktab_ptr, wtab_ptr, TM, WM,
               N, HA, HB, DX, W, scale, L1, L2, K1, K2, DIL0, DIL1, DIL2, TPA1, TPA2,
               T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, BLOCK_Q: tl.constexpr,
               BLOCK_DX: tl.constexpr, RANK: tl.constexpr, LSE_MODE: tl.constexpr, PREC: tl.constexpr,
               ACC: tl.constexpr, GATHER_ROWS: tl.constexpr):
    BLOCK_KT: tl.constexpr = T0 * T1 * T2
    bi, hb, u0, u1, u2 = _program_tile(HB, TPA1, TPA2)
    G = HA // HB
    k_ok, kc0, kc1, kc2, kg0, kg1, kg2, ro0, ro1, ro2, _, _, _, rl0, rl1, rl2 = _tile_rows(
        ktab_ptr, TM, u0, u1, u2, tl.arange(0, BLOCK_KT), T1, T2, DIL0, DIL1, DIL2)
    krow = _coord_row(bi, N, kc0, kc1, kc2, L1, L2, HB, hb)
    dx = tl.arange(0, BLOCK_DX)
    acc = tl.zeros([BLOCK_KT, BLOCK_DX], dtype=ACC)
    span = rl0 * rl1 * rl2
    for f_lo in range(0, span, BLOCK_Q):
        f_ok, f0, f1, f2 = _chunk(f_lo, span, rl1, rl2, BLOCK_Q)
        qc0 = tl.where(f_ok, ro0 + f0 * DIL0, 0)
        qc1 = tl.where(f_ok, ro1 + f1 * DIL1, 0)
        qc2 = tl.where(f_ok, ro2 + f2 * DIL2, 0)
        ws0, wl0, ws1, wl1, ws2, wl2 = _windows(wtab_ptr, WM, qc0, qc1, qc2, f_ok)
        # Pairs (key of the tile, query of the chunk): the key's slot in the query's window.
        ok, slot = _window_slots(kg0[:, None], kg1[:, None], kg2[:, None], ws0[None, :], wl0[None, :], ws1[None, :],
                                 wl1[None, :], ws2[None, :], wl2[None, :], K1, K2, RANK)
        ok = ok & k_ok[:, None] & f_ok[None, :]
        for gi in range(0, G):
            qrow = _coord_row(bi, N, qc0, qc1, qc2, L1, L2, HA, hb * G + gi)
            p = tl.load(w_ptr + qrow[None, :] * W + slot, mask=ok, other=0.0).to(ACC)
            if LSE_MODE:
                lse = tl.load(lse_ptr + qrow, mask=f_ok, other=0.0)
                p = tl.where(ok, tl.exp(p - lse[None, :]), 0.0)
            x = tl.load(x_ptr + qrow[:, None] * DX + dx[None, :], mask=f_ok[:, None] & (dx[None, :] < DX),
                        other=0.0)
            acc = tl.dot(p.to(x.dtype), x, acc, input_precision=PREC)
    if _holds_nonfinite(acc):  # a NaN / inf row or weight reached the tile: its keys again, pair by pair (rare)
        _in_by_query(w_ptr, x_ptr, out_ptr, lse_ptr, ktab_ptr, wtab_ptr, TM, WM, u0, u1, u2, bi, hb, N, HA, HB, DX, W,
                     scale, L1, L2, K1, K2, DIL0, DIL1, DIL2, T0, T1, T2, GATHER_ROWS, BLOCK_DX, LSE_MODE, ACC)
    else:
        acc = acc * scale
        tl.store(out_ptr + krow[:, None] * DX + dx[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=k_ok[:, None] & (dx[None, :] < DX))


@triton.jit
def _in_by_query(w_ptr, x_ptr, out_ptr, lse_ptr, ktab_ptr, wtab_ptr, TM, WM, u0, u1, u2, bi, hb, N, HA, HB, DX, W,
                 scale, L1, L2, K1, K2, DIL0, DIL1, DIL2, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                 SUB: tl.constexpr, BLOCK_DX: tl.constexpr, LSE_MODE: tl.constexpr, ACC: tl.constexpr):
    """IN for the program's key tile, ``SUB`` keys at a time: per query of the tile's inverse neighborhood (and query
    head of the kv head), its row times its weight at each key's slot, kept only for keys inside its window."""
    G = HA // HB
    dx = tl.arange(0, BLOCK_DX)
    for first in tl.range(0, T0 * T1 * T2, SUB, num_stages=1):
        k_ok, kc0, kc1, kc2, kg0, kg1, kg2, ro0, ro1, ro2, _, _, _, rl0, rl1, rl2 = _tile_rows(
            ktab_ptr, TM, u0, u1, u2, first + tl.arange(0, SUB), T1, T2, DIL0, DIL1, DIL2)
        krow = _coord_row(bi, N, kc0, kc1, kc2, L1, L2, HB, hb)
        acc = tl.zeros([SUB, BLOCK_DX], dtype=ACC)
        for f in tl.range(0, rl0 * rl1 * rl2 * G, num_stages=1):  # the tile's queries, each query head in turn
            f0, f1, f2 = _unflatten(f // G, rl1, rl2)
            qc0 = ro0 + f0 * DIL0
            qc1 = ro1 + f1 * DIL1
            qc2 = ro2 + f2 * DIL2
            ws0, wl0 = _window(wtab_ptr, WM, 0, qc0, qc0 >= 0)  # a query of the range: always in bounds
            ws1, wl1 = _window(wtab_ptr, WM, 1, qc1, qc1 >= 0)
            ws2, wl2 = _window(wtab_ptr, WM, 2, qc2, qc2 >= 0)
            s0 = kg0 - ws0  # each key's slot in the query's window, per axis
            s1 = kg1 - ws1
            s2 = kg2 - ws2
            ok = k_ok & (s0 >= 0) & (s0 < wl0) & (s1 >= 0) & (s1 < wl1) & (s2 >= 0) & (s2 < wl2)
            qrow = _coord_row(bi, N, qc0, qc1, qc2, L1, L2, HA, hb * G + f % G)
            p = tl.load(w_ptr + qrow * W + (s0 * K1 + s1) * K2 + s2, mask=ok, other=0.0).to(ACC)
            if LSE_MODE:
                p = tl.exp(p - tl.load(lse_ptr + qrow))
            x = tl.load(x_ptr + qrow * DX + dx, mask=dx < DX, other=0.0).to(ACC)
            acc += tl.where(ok[:, None], p[:, None] * x[None, :], 0.0)
        tl.store(out_ptr + krow[:, None] * DX + dx[None, :], (acc * scale).to(out_ptr.dtype.element_ty),
                 mask=k_ok[:, None] & (dx[None, :] < DX))


# ----------------------------------------------------------------------------------------------
# Launchers (flat-space tensors [B, N, heads, dim], weights [B, N, heads, W])
# ----------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: float32 follows torch's float32 matmul setting as the fused kernels do (3xTF32,
    ~fp32, at "highest"; TF32 at "high" / "medium": ``ops.fused.autotune.dot_precision``); other dtypes are exact
    either way."""
    if dtype != torch.float32:
        return "ieee"
    return fused_decide.dot_precision(dtype)


def _acc(dtype: torch.dtype):
    """Accumulator type: float64 for float64 inputs (interpreter only), else float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _stages(block_dim: int, dtype: torch.dtype) -> int:
    """Software-pipelining depth: 3 buffers of the streamed tile, 2 when rows exceed 256 bytes (smem)."""
    return 3 if block_dim * dtype.itemsize <= 256 else 2


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _launch_in_batch_chunks(kernel, tiles: int, heads: int, args: list, batched: tuple, **meta) -> None:
    """``kernel`` over a ``(tiles, B * heads)`` grid, in batch chunks whose B * heads fits CUDA's grid
    (``ops.fused.decide.batch_chunks``); the positional ``args`` at the indices ``batched`` are ``[B, ...]`` tensors,
    sliced per chunk (the kernels index rows from the batch element on)."""
    batch = args[batched[0]].shape[0]
    for lo, hi in fused_decide.batch_chunks(batch, heads):
        chunk = [a[lo:hi] if i in batched else a for i, a in enumerate(args)]
        kernel[(tiles, (hi - lo) * heads)](*chunk, **meta)


def _gather_rows(block: int) -> int:
    """Rows per step of ``_nn_by_slot`` / ``_in_by_query`` (the fused kernels' rule, ``decide.gather_rows``)."""
    return fused_decide.gather_rows(block, block)


def _setup(params: NAParams, device):
    p3 = pad_to_3d(params)
    tile = kernel_tile_shape(p3)
    tables = kernel_tables(p3, tile, torch.device(device))
    common = dict(
        L1=p3.spatial[1], L2=p3.spatial[2], K1=p3.kernel_size[1], K2=p3.kernel_size[2],
        DIL0=p3.dilation[0], DIL1=p3.dilation[1], DIL2=p3.dilation[2],
        T0=tile[0], T1=tile[1], T2=tile[2], RANK=params.rank,
    )
    return p3, tables, common


def pn(a, b, params: NAParams, scale=1.0, rpb=None, fill=float("-inf"), out_dtype=None, ds=None, out=None):
    """See ``torch_tiled.pn`` (same contract; with ``out=logits`` each element is read, then written, by
    the same program; a given ``out`` keeps whatever its empty causal slots hold)."""
    B, N, HA, D = a.shape
    HB = b.shape[2]
    W = params.window_size
    a, b = a.contiguous(), b.contiguous()
    p3, tables, common = _setup(params, a.device)
    dtype = out_dtype or a.dtype
    if out is not None:
        assert out.is_contiguous() and out.shape == (B, N, HA, W)  # its empty slots are left as they are
    elif ds is not None or any(params.is_causal):
        # Empty causal slots are never visited by the kernel: pre-fill them.
        out = torch.full((B, N, HA, W), 0.0 if ds is not None else fill, dtype=dtype, device=a.device)
    else:
        out = torch.empty(B, N, HA, W, dtype=dtype, device=a.device)
    dummy = out
    lg = lse = delta = dummy
    if ds is not None:
        lg, lse, delta = (t.contiguous() for t in ds)
    rpb_arg = rpb.contiguous() if rpb is not None else dummy
    args = [a, b, out, rpb_arg, lg, lse, delta, tables.query_tiles, tables.windows,
            tables.query_tiles.shape[2], tables.windows.shape[2], N, HA, HB, D, W, float(scale)]
    _launch_in_batch_chunks(
        _pn_kernel, tables.num_query_tiles, HA, args, (0, 1, 2, 4, 5, 6),
        K0=p3.kernel_size[0], R=math.prod(p3.rpb_shape),
        TPA1=tables.tiles_per_axis[1], TPA2=tables.tiles_per_axis[2], BLOCK_K=BLOCK_CHUNK, BLOCK_D=_block(D),
        HAS_RPB=rpb is not None, DS_MODE=ds is not None, PREC=_precision(a.dtype), ACC=_acc(a.dtype),
        num_stages=_stages(_block(D), a.dtype), **common,
    )
    return out


def _weighted_rows(kernel, w, x, params: NAParams, out_heads: int, scale, lse, out_dtype, *, per_key_tile: bool):
    """Launches NN (one program per query tile, ``x`` the values, ``out`` per query head) or IN
    (``per_key_tile``: one program per key tile, ``x`` the query-side rows, ``out`` per kv head): the
    ``w``-weighted sums of ``x``'s rows, ``[B, N, out_heads, x's dim]``."""
    B, N, HA, W = w.shape
    DX = x.shape[3]
    heads_kv = out_heads if per_key_tile else x.shape[2]
    w, x = w.contiguous(), x.contiguous()
    _, tables, common = _setup(params, x.device)
    if per_key_tile:
        tiles, num_tiles, per_axis = tables.key_tiles, tables.num_key_tiles, tables.key_tiles_per_axis
    else:
        tiles, num_tiles, per_axis = tables.query_tiles, tables.num_query_tiles, tables.tiles_per_axis
    out = torch.empty(B, N, out_heads, DX, dtype=out_dtype or x.dtype, device=x.device)
    args = [w, x, out, lse.contiguous() if lse is not None else w, tiles, tables.windows,
            tiles.shape[2], tables.windows.shape[2], N, HA, heads_kv, DX, W, float(scale)]
    block = _block(DX)
    blocks = dict(BLOCK_Q=BLOCK_CHUNK, BLOCK_DX=block) if per_key_tile else dict(BLOCK_K=BLOCK_CHUNK, BLOCK_DV=block)
    _launch_in_batch_chunks(
        kernel, num_tiles, out_heads, args, (0, 1, 2, 3), TPA1=per_axis[1], TPA2=per_axis[2],
        LSE_MODE=lse is not None, PREC=_precision(x.dtype), ACC=_acc(x.dtype), GATHER_ROWS=_gather_rows(block),
        num_stages=_stages(block, x.dtype), **blocks, **common,
    )
    return out


def nn(w, b, params: NAParams, scale=1.0, lse=None, out_dtype=None):
    """See ``torch_tiled.nn`` (same contract)."""
    return _weighted_rows(_nn_kernel, w, b, params, w.shape[2], scale, lse, out_dtype, per_key_tile=False)


def inn(w, x, params: NAParams, heads_kv: int, scale=1.0, lse=None, out_dtype=None):
    """See ``torch_tiled.inn`` (same contract)."""
    return _weighted_rows(_in_kernel, w, x, params, heads_kv, scale, lse, out_dtype, per_key_tile=True)
