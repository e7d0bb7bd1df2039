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

Traced calls (``ops.backends.tracing()``: ``torch.export``, ONNX export, ``torch.jit.trace``) record a graph that
must serve any input: they take the contained products always (the check would be a decision on one example's
values), their tile tables enter the graph as constants, and their chunks are sized for one batch element.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from ..backends import constant_tensors, tracing
from ..window import NAParams
from .tiles import _chunk_tables, pad_to_3d, torch_tile_shape, torch_tiles

CHUNK_BYTES = 64 * 1024 * 1024


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_chunks(params: NAParams, batch, per_tile_elems, dtype):
    """Tile tables and chunk boundaries keeping each chunk's temporaries (``batch`` x ``per_tile_elems`` per tile)
    under CHUNK_BYTES (a tile chunk: a range of tiles processed together).  A traced call sizes its chunks for
    one batch element: its graph serves any batch size."""
    p3 = pad_to_3d(params)
    traced = tracing()
    if traced:
        batch = 1
        with constant_tensors():
            tiles = torch_tiles(p3, torch_tile_shape(p3))
    else:
        tiles = torch_tiles(p3, torch_tile_shape(p3))
    per_tile = batch * per_tile_elems(tiles.tile_queries, tiles.tile_halo) * torch.finfo(dtype).bits // 8
    step = max(1, CHUNK_BYTES // max(per_tile, 1))
    bounds = [(lo, min(tiles.num_tiles, lo + step)) for lo in range(0, tiles.num_tiles, step)]
    return tiles, bounds


def _chunk(tiles, lo: int, hi: int, device, need_rel: bool = False):
    """The index tables of tiles [lo, hi); a traced call's are built outside the trace and cached, so that the
    graph holds them as constants (shared by the calls of one problem)."""
    if not tracing():
        return tiles.chunk(lo, hi, device, need_rel)
    with constant_tensors():
        return _chunk_tables(tiles, lo, hi, torch.device(device), need_rel)


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
    tiles, bounds = _tile_chunks(params, B, lambda tq, th: th * HB * D + tq * HA * (D + th + 3 * W), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    a_hm, b_hm = _head_major(a.to(ct), HB), b.to(ct).permute(0, 2, 1, 3).contiguous()  # [B,Hb,N,G,D], [B,Hb,N,D]
    if ds is not None:
        logits, lse, delta = ds
        lse, delta = lse.unsqueeze(-1), delta.unsqueeze(-1)
    for lo, hi in bounds:
        c = hi - lo
        ch = _chunk(tiles, lo, hi, a.device, need_rel=rpb is not None)
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


def _query_windows(ch, keep, dtype, device):
    """``[1, 1, c, Tq, Th]``: 1 where a tile query's window holds the halo position, else 0; the same for every batch
    element and head, so it is built (and, in a traced graph of fixed shapes, folded into a constant) once per
    chunk rather than in the size of the weights."""
    c, tq = ch.queries.shape
    return _spread_rows(torch.ones(1, 1, c, tq, 1, ch.local.shape[-1], dtype=dtype, device=device), ch, keep)


def _contained_rows_matmul(z, x, windows):
    """``_contained_matmul`` for NN: ``z [B, Hkv, c, Tq * G, Th] @ x [B, Hkv, c, Th, X]`` with the query windows
    ``windows [1, 1, c, Tq, Th]`` of ``_query_windows`` shared by the ``G`` query heads of each row."""
    B, HB, c, rows, X = z.shape[0], z.shape[1], z.shape[2], z.shape[3], x.shape[-1]
    tq = windows.shape[3]
    bad = ~torch.isfinite(x)
    out = torch.matmul(z, x.masked_fill(bad, 0.0)).reshape(B, HB, c, tq, rows // tq, X)
    hit = torch.matmul(windows, bad.to(windows.dtype)) > 0  # [B, Hkv, c, Tq, X]
    return out.masked_fill(hit.unsqueeze(4), float("nan")).reshape(B, HB, c, rows, X)


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
    propagation) are taken as finite, which gives the output's shape without reading any value.  A traced call
    (``tracing()``) answers False without reading ``x``: its graph takes the contained products, right for any
    values, where a check would freeze one example's answer (or, in ``torch.export``, fail on a data-dependent
    branch)."""
    if tracing():
        return False
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
    tiles, bounds = _tile_chunks(params, B, lambda tq, th: th * HB * DV + tq * HA * (2 * th + 2 * W + DV), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    b_hm = b.to(ct).permute(0, 2, 1, 3).contiguous()
    finite = _all_finite(b_hm)
    for lo, hi in bounds:
        c = hi - lo
        ch = _chunk(tiles, lo, hi, b.device)
        keep = None if ch.all_valid else ch.valid
        z = _spread(w, ch, HB, lse, ct, keep)
        vb = b_hm.index_select(2, ch.halo.reshape(-1)).reshape(B, HB, c, Th, DV)
        o = torch.matmul(z, vb) if finite else _contained_rows_matmul(z, vb, _query_windows(ch, keep, ct, b.device))
        o = o.reshape(B, HB, c, Tq, G, DV)
        if scale != 1.0:
            o = o * scale
        out.index_copy_(1, ch.queries.reshape(-1), _to_rows_layout(o).to(out.dtype))
    return out


@functools.lru_cache(maxsize=128)
def _row_of_query(tiles) -> torch.Tensor:
    """``[N]``: for every query, its row among all tiles' query rows ``[num_tiles * Tq]`` (in the tile that owns it;
    a group's last tile repeats its last query, unowned)."""
    with constant_tensors():
        ch = tiles.build_chunk(0, tiles.num_tiles, "cpu")
        owned = ch.owned.reshape(-1)
        row_of = torch.empty(math.prod(tiles.spatial), dtype=torch.long)
        row_of[ch.queries.reshape(-1)[owned]] = torch.arange(owned.numel())[owned]
        return row_of


@dataclass(frozen=True)
class _TracedTables:
    """A chunk's tables for ``attention_forward``, shaped as it uses them (a traced graph then holds no reshapes of
    them)."""

    queries: torch.Tensor  # [c * Tq] flat query index
    halo: torch.Tensor  # [c * Th] flat key index
    local: torch.Tensor  # [1, 1, c, Tq, 1, W] halo position of every window slot
    target: torch.Tensor  # [1, 1, c, Tq, 1, W] the same, empty causal slots sent to a trash column Th
    empty: torch.Tensor | None  # bool [1, 1, c, Tq, 1, W]: empty (causal) slots; None where there are none
    windows: torch.Tensor  # [1, 1, c, Tq, Th] in the compute dtype: 1 where the halo position is in the window
    rel: torch.Tensor | None  # [c, Tq, W] index into rpb.flatten(1)


@functools.lru_cache(maxsize=64)
def _traced_tables(tiles, lo: int, hi: int, device: torch.device, need_rel: bool, dtype: torch.dtype):
    with constant_tensors():
        ch = tiles.build_chunk(lo, hi, device, need_rel)
        c, tq, w = ch.local.shape
        th = ch.halo.shape[1]
        slots = (1, 1, c, tq, 1, w)
        target = torch.where(ch.valid, ch.local, th)
        window = torch.zeros(c, tq, th + 1, dtype=torch.bool, device=device).scatter_(-1, target, True)[..., :th]
        return _TracedTables(ch.queries.reshape(-1), ch.halo.reshape(-1), ch.local.reshape(slots),
                             target.reshape(slots), None if ch.all_valid else (~ch.valid).reshape(slots),
                             window.to(dtype).reshape(1, 1, c, tq, th), ch.rel)


def attention_forward(q, k, v, params: NAParams, scale: float, rpb=None):
    """``(out, lse)`` of attention as a traced graph needs it: per chunk, PN (one halo GEMM, the window's entries
    picked out), the log-sum-exp and softmax over the window, the weights spread into the halo and NN (one GEMM, the
    contained products), with the tables as constants; the weights stay in the tiles' layout instead of being
    written out to ``[B, N, H, W]`` and read back (``pn`` then ``nn``), so the graph holds about half the ops.
    ``q [B, N, Hq, D]``, ``k [B, N, Hkv, D]``, ``v [B, N, Hkv, Dv]`` -> ``out [B, N, Hq, Dv]`` (input dtype),
    ``lse [B, N, Hq]`` (compute dtype)."""
    B, N, HA, D = q.shape
    HB, DV = k.shape[2], v.shape[3]
    G = HA // HB
    W = params.window_size
    ct = compute_dtype(q.dtype)
    tiles, bounds = _tile_chunks(params, B, lambda tq, th: th * HB * (D + DV) + tq * HA * (D + 2 * th + 3 * W + DV), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    cast = lambda t: t if t.dtype == ct else t.to(ct)  # noqa: E731  (no cast op in the graph where none is needed)
    q_hm = _head_major(cast(q), HB)  # [B, Hkv, N, G, D]
    k_hm, v_hm = (cast(t).permute(0, 2, 1, 3).contiguous() for t in (k, v))  # [B, Hkv, N, D]
    bias = None if rpb is None else cast(rpb).flatten(1)
    outs, lses = [], []
    for lo, hi in bounds:
        c = hi - lo
        t = _traced_tables(tiles, lo, hi, torch.device(q.device), rpb is not None, ct)
        qa = q_hm.index_select(2, t.queries).reshape(B, HB, c, Tq * G, D)
        kb = k_hm.index_select(2, t.halo).reshape(B, HB, c, Th, D)
        s = torch.matmul(qa, kb.transpose(-1, -2)).reshape(B, HB, c, Tq, G, Th)  # whole tile x whole halo
        s = torch.gather(s, -1, t.local.expand(B, HB, c, Tq, G, W))
        if scale != 1.0:
            s = s * scale
        if bias is not None:
            s = s + bias[:, t.rel].reshape(HB, G, c, Tq, W).permute(0, 2, 3, 1, 4)
        if t.empty is not None:
            s = s.masked_fill(t.empty, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, c, Tq, G]
        z = torch.zeros(B, HB, c, Tq, G, Th + 1, dtype=ct, device=q.device)
        z = z.scatter(-1, t.target.expand(B, HB, c, Tq, G, W), torch.exp(s - lse.unsqueeze(-1)))
        z = z.reshape(B, HB, c, Tq * G, Th + 1)[..., :Th]
        vb = v_hm.index_select(2, t.halo).reshape(B, HB, c, Th, DV)
        outs.append(_contained_rows_matmul(z, vb, t.windows).reshape(B, HB, c * Tq, G, DV))
        lses.append(lse.reshape(B, HB, c * Tq, G))
    out, lse = (xs[0] if len(xs) == 1 else torch.cat(xs, 2) for xs in (outs, lses))
    row_of = _row_of_query(tiles).to(q.device)
    out = out.index_select(2, row_of).permute(0, 2, 1, 3, 4).reshape(B, N, HA, DV)
    lse = lse.index_select(2, row_of).permute(0, 2, 1, 3).reshape(B, N, HA)
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse


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
    tiles, bounds = _tile_chunks(params, B, lambda tq, th: th * HB * DX + tq * HA * (2 * th + 2 * W + DX), ct)
    Tq, Th = tiles.tile_queries, tiles.tile_halo
    x_hm = _head_major(x.to(ct), HB)
    finite = _all_finite(x_hm)
    for lo, hi in bounds:
        c = hi - lo
        ch = _chunk(tiles, lo, hi, x.device)
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
