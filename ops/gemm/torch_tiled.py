"""PN / NN / IN as tiled batched GEMMs in plain PyTorch (CPU, float64 anywhere, and fallback).

Queries are cut into fixed-size N-D tiles inside one dilation group (``tiles.torch_tiles``); each tile
loads its halo, the keys covering the union of its windows, and multiplies the whole query tile with the
whole halo in one batched matmul.  Only then are the per-query window entries picked out (PN) or the
weights spread into the halo layout (NN, IN).  The tile GEMM does a few times the arithmetic a query
strictly needs, but replaces the per-query gathers of ``naive`` (``W`` copies of every key) by one halo
copy per tile, which is what makes it fast.  Tiles are processed in chunks under ``CHUNK_BYTES``.

Tensors are flat over space: ``[B, N, heads, dim]`` and weights ``[B, N, heads, W]``.  Math runs in
float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch

from ..window import NAParams
from .tiles import pad_to_3d, torch_tile_shape, torch_tiles

CHUNK_BYTES = 64 * 1024 * 1024


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _plan(params: NAParams, per_tile_elems, dtype):
    """Tile tables and chunk boundaries keeping each chunk's temporaries under CHUNK_BYTES."""
    p3 = pad_to_3d(params)
    tiles = torch_tiles(p3, torch_tile_shape(p3))
    per_tile = per_tile_elems(tiles.tile_queries, tiles.tile_halo) * torch.finfo(dtype).bits // 8
    step = max(1, CHUNK_BYTES // max(per_tile, 1))
    bounds = [(lo, min(tiles.num_tiles, lo + step)) for lo in range(0, tiles.num_tiles, step)]
    return tiles, bounds


def _rows(t: torch.Tensor, index: torch.Tensor, shape, dtype):
    """Rows ``index`` (flat positions) of a [B, N, ...] tensor, reshaped, in compute precision."""
    return t.index_select(1, index.reshape(-1)).to(dtype).reshape(shape)


def pn(a, b, params: NAParams, scale=1.0, rpb=None, fill=float("-inf"), out_dtype=None, ds=None):
    """Pointwise-neighborhood: ``out[n, h, w] = scale * <a[n, h], b[key(n, w), h // G]> (+ rpb)``.

    ``a [B, N, Ha, D]``, ``b [B, N, Hb, D]`` -> ``[B, N, Ha, W]``; empty (causal) slots get ``fill``.
    With ``ds = (logits, lse, delta)`` the epilogue of the attention backward is applied instead:
    ``out = P * (dot - delta)``, ``P = exp(logits - lse)``, empty slots 0.
    """
    B, N, HA, D = a.shape
    HB = b.shape[2]
    G = HA // HB
    W = params.window_size
    ct = compute_dtype(a.dtype)
    out = torch.empty(B, N, HA, W, dtype=out_dtype or a.dtype, device=a.device)
    tiles, bounds = _plan(params, lambda tq, th: B * (th * HB * D + tq * HA * (D + th + 3 * W)), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    for lo, hi in bounds:
        c = hi - lo
        ch = tiles.chunk(lo, hi, a.device, need_rel=rpb is not None)
        qa = _rows(a, ch.queries, (B, c, Tq, HB, G, D), ct)
        kb = _rows(b, ch.halo, (B, c, Th, HB, D), ct)
        s = torch.einsum("bctkgd,bcjkd->bctkgj", qa, kb)  # whole tile x whole halo
        s = torch.gather(s, -1, ch.local[None, :, :, None, None, :].expand(B, c, Tq, HB, G, W))
        if scale != 1.0:
            s = s * scale
        if rpb is not None:
            bias = rpb.flatten(1).to(ct)[:, ch.rel]  # [Ha, c, Tq, W]
            s = s + bias.permute(1, 2, 0, 3).reshape(1, c, Tq, HB, G, W)
        empty = ~ch.valid[None, :, :, None, None, :]
        if ds is not None:
            logits, lse, delta = ds
            p = torch.exp(_rows(logits, ch.queries, (B, c, Tq, HB, G, W), ct)
                          - _rows(lse, ch.queries, (B, c, Tq, HB, G, 1), ct))
            s = (p * (s - _rows(delta, ch.queries, (B, c, Tq, HB, G, 1), ct))).masked_fill(empty, 0.0)
        elif not bool(ch.valid.all()):
            s = s.masked_fill(empty, fill)
        # Repeated queries (padding of a group's last tile) write identical values twice.
        out.index_copy_(1, ch.queries.reshape(-1), s.reshape(B, c * Tq, HA, W).to(out.dtype))
    return out


def _spread(w, ch, shape, lse, ct, keep):
    """Weights of the chunk's queries spread into halo layout ``[..., Th]`` (zero off-window)."""
    B, c, Tq, HB, G, W = shape
    rows = _rows(w, ch.queries, shape, ct)
    if lse is not None:
        rows = torch.exp(rows - _rows(lse, ch.queries, (B, c, Tq, HB, G, 1), ct))
    th = ch.halo.shape[1]
    # Slots that must not contribute (empty causal slots, repeated queries) go to a trash column.
    target = torch.where(keep, ch.local, th)[None, :, :, None, None, :].expand(shape)
    z = torch.zeros(B, c, Tq, HB, G, th + 1, dtype=ct, device=w.device)
    return z.scatter_(-1, target, rows)[..., :th]


def nn(w, b, params: NAParams, scale=1.0, lse=None, out_dtype=None):
    """Neighborhood-neighborhood: ``out[n, h] = scale * sum_w P[n, h, w] b[key(n, w), h // G]``.

    ``w [B, N, Ha, W]`` (``P = w``, or ``exp(w - lse)`` with ``lse [B, N, Ha]``), ``b [B, N, Hb, Dv]``
    -> ``[B, N, Ha, Dv]``.  Empty slots are ignored whatever ``w`` holds there.
    """
    B, N, HA, W = w.shape
    HB, DV = b.shape[2], b.shape[3]
    G = HA // HB
    ct = compute_dtype(b.dtype)
    out = torch.empty(B, N, HA, DV, dtype=out_dtype or b.dtype, device=b.device)
    tiles, bounds = _plan(params, lambda tq, th: B * (th * HB * DV + tq * HA * (2 * th + 2 * W + DV)), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    for lo, hi in bounds:
        c = hi - lo
        ch = tiles.chunk(lo, hi, b.device)
        z = _spread(w, ch, (B, c, Tq, HB, G, W), lse, ct, ch.valid)
        vb = _rows(b, ch.halo, (B, c, Th, HB, DV), ct)
        o = torch.einsum("bctkgj,bcjkd->bctkgd", z, vb)
        if scale != 1.0:
            o = o * scale
        out.index_copy_(1, ch.queries.reshape(-1), o.reshape(B, c * Tq, HA, DV).to(out.dtype))
    return out


def inn(w, x, params: NAParams, heads_kv: int, scale=1.0, lse=None, out_dtype=None):
    """Inverse-neighborhood: ``out[m, k] = scale * sum_{n, h in group k, w: key(n, w) = m} P[n, h, w] x[n, h]``.

    ``w [B, N, Ha, W]`` (or logits with ``lse``), ``x [B, N, Ha, Dx]`` -> ``[B, N, heads_kv, Dx]``: the
    gradient of keys (from dS and q) and of values (from P and dO).
    """
    B, N, HA, W = w.shape
    DX = x.shape[3]
    HB = heads_kv
    G = HA // HB
    ct = compute_dtype(x.dtype)
    acc = torch.zeros(B, N, HB, DX, dtype=ct, device=x.device)
    tiles, bounds = _plan(params, lambda tq, th: B * (th * HB * DX + tq * HA * (2 * th + 2 * W + DX)), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    for lo, hi in bounds:
        c = hi - lo
        ch = tiles.chunk(lo, hi, x.device)
        z = _spread(w, ch, (B, c, Tq, HB, G, W), lse, ct, ch.valid & ch.owned[:, :, None])
        xq = _rows(x, ch.queries, (B, c, Tq, HB, G, DX), ct)
        dh = torch.einsum("bctkgj,bctkgd->bcjkd", z, xq)  # [B, c, Th, Hb, Dx]
        acc.index_add_(1, ch.halo.reshape(-1), dh.reshape(B, c * Th, HB, DX))
    if scale != 1.0:
        acc = acc * scale
    return acc.to(out_dtype or x.dtype)
