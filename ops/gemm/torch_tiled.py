"""PN / NN / IN as tiled batched GEMMs in plain PyTorch (CPU, float64 anywhere, and fallback).

Queries are cut into fixed-size N-D tiles inside one dilation group (``tiles.torch_tiles``); each tile
loads its halo, the keys covering the union of its windows, and multiplies the whole query tile with the
whole halo in one batched matmul.  Only then are the per-query window entries picked out (PN) or the
weights spread into the halo layout (NN, IN).  The tile GEMM does a few times the arithmetic a query
strictly needs, but replaces the per-query gathers of ``naive`` (``W`` copies of every key) by one halo
copy per tile, which is what makes it fast.  Tiles are processed in chunks under ``CHUNK_BYTES``.

Tensors are flat over space: ``[B, N, heads, dim]`` and weights ``[B, N, heads, W]``.  Math runs in
float32 (float64 for float64 inputs).

NN and IN multiply whole tiles by whole halos, where a zero weight times a NaN (or infinite) row is NaN: where
the rows hold such values (one check per call), those products leave them out and mark instead the outputs
whose windows hold one (``_contained_matmul``), so they reach exactly those outputs.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

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


def _head_major(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """[B, N, Hkv * G, X] -> contiguous [B, Hkv, N, G, X]: a kv head's query heads become GEMM rows."""
    B, N, H, X = t.shape
    return t.reshape(B, N, heads_kv, H // heads_kv, X).permute(0, 2, 1, 3, 4).contiguous()


def _weight_rows(t: torch.Tensor, index: torch.Tensor, heads_kv: int, dtype) -> torch.Tensor:
    """Rows ``index`` [c, Tq] of a [B, N, H, X] tensor as [B, Hkv, c, Tq, G, X] (a view after the copy)."""
    B, _, H, X = t.shape
    c, tq = index.shape
    rows = t.index_select(1, index.reshape(-1)).to(dtype)
    return rows.reshape(B, c, tq, heads_kv, H // heads_kv, X).permute(0, 3, 1, 2, 4, 5)


def _to_rows_layout(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, c, Tq, G, X] -> [B, c * Tq, Hkv * G, X] for ``index_copy_`` into a [B, N, H, X] output."""
    B, HB, c, tq, G, X = x.shape
    return x.permute(0, 2, 3, 1, 4, 5).reshape(B, c * tq, HB * G, X)


def pn(a, b, params: NAParams, scale=1.0, rpb=None, fill=float("-inf"), out_dtype=None, ds=None, out=None):
    """Pointwise-neighborhood: ``out[n, h, w] = scale * <a[n, h], b[key(n, w), h // G]> (+ rpb)``.

    ``a [B, N, Ha, D]``, ``b [B, N, Hb, D]`` -> ``[B, N, Ha, W]``; empty (causal) slots get ``fill``.
    With ``ds = (logits, lse, delta)`` the epilogue of the attention backward is applied instead:
    ``out = P * (dot - delta)``, ``P = exp(logits - lse)``, empty slots 0.  ``out`` may be given, and
    may be ``logits`` itself (each query's row is read before it is written, by the same tile).
    Empty causal slots of a given ``out`` in the ``ds`` mode are left as they are (nothing reads them).
    """
    B, N, HA, D = a.shape
    HB = b.shape[2]
    G = HA // HB
    W = params.window_size
    ct = compute_dtype(a.dtype)
    if out is None:
        out = torch.empty(B, N, HA, W, dtype=out_dtype or a.dtype, device=a.device)
    tiles, bounds = _plan(params, lambda tq, th: B * (th * HB * D + tq * HA * (D + th + 3 * W)), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    a_hm, b_hm = _head_major(a.to(ct), HB), b.to(ct).permute(0, 2, 1, 3).contiguous()  # [B,Hb,N,G,D], [B,Hb,N,D]
    if ds is not None:
        logits, lse, delta = ds
        lse, delta = lse.unsqueeze(-1), delta.unsqueeze(-1)
    for lo, hi in bounds:
        c = hi - lo
        ch = tiles.chunk(lo, hi, a.device, need_rel=rpb is not None)
        qa = a_hm.index_select(2, ch.queries.reshape(-1)).reshape(B, HB, c, Tq * G, D)
        kb = b_hm.index_select(2, ch.halo.reshape(-1)).reshape(B, HB, c, Th, D)
        s = torch.matmul(qa, kb.transpose(-1, -2)).reshape(B, HB, c, Tq, G, Th)  # whole tile x whole halo
        s = torch.gather(s, -1, ch.local[None, None, :, :, None, :].expand(B, HB, c, Tq, G, W))
        if scale != 1.0:
            s = s * scale
        if rpb is not None:
            bias = rpb.flatten(1).to(ct)[:, ch.rel]  # [Ha, c, Tq, W]
            s = s + bias.reshape(HB, G, c, Tq, W).permute(0, 2, 3, 1, 4)
        empty = None if ch.all_valid else ~ch.valid[None, None, :, :, None, :]
        if ds is not None:
            p = torch.exp(_weight_rows(logits, ch.queries, HB, ct) - _weight_rows(lse, ch.queries, HB, ct))
            s = p * (s - _weight_rows(delta, ch.queries, HB, ct))
            if empty is not None:  # (exp(-inf - lse) * finite = 0 already; NaN-proof anyway)
                s = s.masked_fill(empty, 0.0)
        elif empty is not None:
            s = s.masked_fill(empty, fill)
        # Repeated queries (padding of a group's last tile) write identical values twice.
        out.index_copy_(1, ch.queries.reshape(-1), _to_rows_layout(s).to(out.dtype))
    return out


def _spread(w, ch, heads_kv, lse, ct, keep):
    """Weights of the chunk's queries spread into halo layout [B, Hkv, c, Tq * G, Th] (zero off-window)."""
    rows = _weight_rows(w, ch.queries, heads_kv, ct)  # [B, Hb, c, Tq, G, W]
    if lse is not None:
        rows = torch.exp(rows - _weight_rows(lse.unsqueeze(-1), ch.queries, heads_kv, ct))
    return _spread_rows(rows, ch, keep)


def _spread_rows(rows, ch, keep):
    """[B, Hkv, c, Tq, G, W] per-slot values of the chunk's queries in halo layout [B, Hkv, c, Tq * G, Th]."""
    B, HB, c, tq, G, W = rows.shape
    th = ch.halo.shape[1]
    # Slots that must not contribute (empty causal slots, repeated queries) go to a trash column.
    target = ch.local if keep is None else torch.where(keep, ch.local, th)
    z = torch.zeros(B, HB, c, tq, G, th + 1, dtype=rows.dtype, device=rows.device)
    z.scatter_(-1, target[None, None, :, :, None, :].expand(rows.shape), rows)
    return z.reshape(B, HB, c, tq * G, th + 1)[..., :th]


def _window_indicator(z, ch, keep):
    """1 where ``z`` (a ``_spread`` result) has a window slot, else 0: the layout of ``z``, whatever its values."""
    B, HB, c, rows, _ = z.shape
    tq = ch.queries.shape[1]
    ones = z.new_ones(B, HB, c, tq, rows // tq, ch.local.shape[-1])
    return _spread_rows(ones, ch, keep)


def _contained_matmul(z, x, window):
    """``z @ x`` with the non-finite entries of ``x`` left out of the products and NaN in every output whose window
    (``window``, the 0 / 1 layout of ``z``) holds one: a zero weight outside the window times NaN is not NaN here."""
    bad = ~torch.isfinite(x)
    out = torch.matmul(z, x.masked_fill(bad, 0.0))
    return out.masked_fill(torch.matmul(window, bad.to(window.dtype)) > 0, float("nan"))


def _all_finite(x: torch.Tensor) -> bool:
    """Whether ``x`` holds no NaN / infinity (one check per call).  Tensors without data (meta, fake: shape
    propagation) are taken as finite, which gives the output's shape without reading any value."""
    if x.device.type == "meta" or is_fake(x):
        return True
    return bool(torch.isfinite(x).all())


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
    b_hm = b.to(ct).permute(0, 2, 1, 3).contiguous()
    finite = _all_finite(b_hm)
    for lo, hi in bounds:
        c = hi - lo
        ch = tiles.chunk(lo, hi, b.device)
        keep = None if ch.all_valid else ch.valid
        z = _spread(w, ch, HB, lse, ct, keep)
        vb = b_hm.index_select(2, ch.halo.reshape(-1)).reshape(B, HB, c, Th, DV)
        o = torch.matmul(z, vb) if finite else _contained_matmul(z, vb, _window_indicator(z, ch, keep))
        o = o.reshape(B, HB, c, Tq, G, DV)
        if scale != 1.0:
            o = o * scale
        out.index_copy_(1, ch.queries.reshape(-1), _to_rows_layout(o).to(out.dtype))
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
    acc = torch.zeros(B, HB, N, DX, dtype=ct, device=x.device)
    tiles, bounds = _plan(params, lambda tq, th: B * (th * HB * DX + tq * HA * (2 * th + 2 * W + DX)), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    x_hm = _head_major(x.to(ct), HB)
    finite = _all_finite(x_hm)
    for lo, hi in bounds:
        c = hi - lo
        ch = tiles.chunk(lo, hi, x.device)
        keep = ch.valid & ch.owned[:, :, None]
        z = _spread(w, ch, HB, lse, ct, keep)
        xq = x_hm.index_select(2, ch.queries.reshape(-1)).reshape(B, HB, c, Tq * G, DX)
        if finite:
            dh = torch.matmul(z.transpose(-1, -2), xq)  # [B, Hb, c, Th, Dx]
        else:
            dh = _contained_matmul(z.transpose(-1, -2), xq, _window_indicator(z, ch, keep).transpose(-1, -2))
        acc.index_add_(2, ch.halo.reshape(-1), dh.reshape(B, HB, c * Th, DX))
    if scale != 1.0:
        acc = acc * scale
    return acc.permute(0, 2, 1, 3).to(out_dtype or x.dtype).contiguous()
