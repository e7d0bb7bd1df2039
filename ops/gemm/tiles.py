"""Tile tables: how the gemm backend cuts queries (and keys) into N-D tiles, and which keys each tile needs.

All window math comes from ``ops.window`` (``axis_window`` / ``axis_neighbor_table``); this module only
groups its per-axis answers by tile.  Two properties of those rules make tiles cheap, and the tests pin
both against ``ops.window``:

* inside one dilation group the window ``[start, stop)`` of query ``i'`` is monotone (never moves left
  as ``i'`` grows), so the keys of a run of queries ``[a, b]`` are the one range ``[start(a), stop(b))``:
  the *halo* of the tile;
* for the same reason the queries whose windows meet a run of keys ``[a, b]`` are the one range
  ``{i': stop(i') > a} & {i': start(i') <= b}``: the *inverse neighborhood* of a key tile (used by IN).

Tiles never mix dilation groups: a tile of queries of group ``g`` on an axis only needs keys of group
``g`` on that axis, so dilation becomes ``prod(d)`` independent non-dilated problems.

Coordinates: "orig" is the index along the axis, "group" is ``index // d`` inside the dilation group.
Problems of rank 1 and 2 are padded to rank 3 with leading axes of length 1 (``K = 1``), so the kernels
and the tiled PyTorch path are written once.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..window import NAParams, axis_neighbor_table, axis_window

RANK = 3  # every problem is handled as 3-D (leading axes of length 1)


def pad_to_3d(params: NAParams) -> NAParams:
    """The same problem with leading length-1 axes (K = s = d = 1) so that it has three spatial axes."""
    extra = RANK - params.rank
    return NAParams(
        (1,) * extra + params.spatial,
        (1,) * extra + params.kernel_size,
        (1,) * extra + params.stride,
        (1,) * extra + params.dilation,
        (False,) * extra + params.is_causal,
    )


@dataclass(frozen=True)
class AxisGroup:
    """One dilation group of one axis: its members (orig coords, ascending) and their windows."""

    group: int
    members: torch.Tensor  # [Lg] orig coords: group coord t is members[t] = t * d + group
    start: torch.Tensor  # [Lg] window start, group coords (non-decreasing)
    stop: torch.Tensor  # [Lg] window stop (exclusive), group coords (non-decreasing)


def axis_groups(L: int, K: int, s: int, d: int, causal: bool) -> list[AxisGroup]:
    i = torch.arange(L)
    g, _, start, stop = axis_window(i, L, K, s, d, causal)
    start = torch.as_tensor(start).expand(L)
    return [AxisGroup(grp, i[g == grp], start[g == grp], stop[g == grp]) for grp in range(d)]


def _tile_firsts(length: int, tile: int):
    """First and last group coordinate of each tile of ``tile`` consecutive positions."""
    first = torch.arange(0, length, tile)
    last = torch.clamp(first + tile, max=length) - 1
    return first, last


# ----------------------------------------------------------------------------------------------
# Tables for the Triton kernels (variable-size tiles, masked in the kernel)
# ----------------------------------------------------------------------------------------------

# Fields of a query tile (PN, NN): its first query, how many queries it has, and its halo.
Q_ORIGIN, Q_START, Q_COUNT, H_ORIGIN, H_START, H_LEN = range(6)
# Fields of a key tile (IN): its first key, how many keys, and its inverse neighborhood (query range).
K_ORIGIN, K_START, K_COUNT, R_ORIGIN, R_START, R_LEN = range(6)


def axis_query_tiles(L, K, s, d, causal, tile: int) -> torch.Tensor:
    """[tiles, 6] query tiles of one axis (fields Q_ORIGIN..H_LEN), every dilation group in turn."""
    rows = []
    for grp in axis_groups(L, K, s, d, causal):
        first, last = _tile_firsts(len(grp.members), tile)
        h_start, h_stop = grp.start[first], grp.stop[last]
        rows.append(torch.stack([grp.members[first], first, last - first + 1,
                                 h_start * d + grp.group, h_start, h_stop - h_start], dim=1))
    return torch.cat(rows)


def axis_key_tiles(L, K, s, d, causal, tile: int) -> torch.Tensor:
    """[tiles, 6] key tiles of one axis (fields K_ORIGIN..R_LEN) with their inverse neighborhoods."""
    rows = []
    for grp in axis_groups(L, K, s, d, causal):
        first, last = _tile_firsts(len(grp.members), tile)
        # queries with stop > first key, and with start <= last key (both monotone, so ranges)
        lo = torch.searchsorted(grp.stop, first, right=True)
        hi = torch.searchsorted(grp.start, last, right=True)
        rows.append(torch.stack([grp.members[first], first, last - first + 1,
                                 lo * d + grp.group, lo, (hi - lo).clamp(min=0)], dim=1))
    return torch.cat(rows)


def axis_window_table(L, K, s, d, causal) -> torch.Tensor:
    """[2, L]: window start (group coords) and length, indexed by the query's orig coordinate."""
    i = torch.arange(L)
    _, _, start, stop = axis_window(i, L, K, s, d, causal)
    start = torch.as_tensor(start).expand(L)
    return torch.stack([start, stop - start])


@dataclass(frozen=True)
class KernelTables:
    query_tiles: torch.Tensor  # int32 [3, 6, M]: per axis, fields x tiles
    key_tiles: torch.Tensor  # int32 [3, 6, M]
    windows: torch.Tensor  # int32 [3, 2, max L]
    tiles_per_axis: tuple[int, int, int]  # query tiles per axis
    key_tiles_per_axis: tuple[int, int, int]

    @property
    def num_query_tiles(self) -> int:
        return math.prod(self.tiles_per_axis)

    @property
    def num_key_tiles(self) -> int:
        return math.prod(self.key_tiles_per_axis)


def _pack(per_axis: list[torch.Tensor], device) -> torch.Tensor:
    """Stacks per-axis [n_a, F] tables into one int32 [3, F, max n] tensor (padding never read)."""
    width = max(t.shape[0] for t in per_axis)
    out = torch.zeros(len(per_axis), per_axis[0].shape[1], width, dtype=torch.int32)
    for a, t in enumerate(per_axis):
        out[a, :, : t.shape[0]] = t.T.to(torch.int32)
    return out.to(device)


@functools.lru_cache(maxsize=128)
def kernel_tables(params3: NAParams, tile: tuple[int, int, int], device: torch.device) -> KernelTables:
    """Tables for a rank-3 (padded) problem with query/key tiles of ``tile`` positions per axis."""
    q_tiles = [axis_query_tiles(*axis, t) for axis, t in zip(params3.axes(), tile)]
    k_tiles = [axis_key_tiles(*axis, t) for axis, t in zip(params3.axes(), tile)]
    windows = [axis_window_table(*axis).T for axis in params3.axes()]
    return KernelTables(
        _pack(q_tiles, device), _pack(k_tiles, device), _pack(windows, device),
        tuple(t.shape[0] for t in q_tiles), tuple(t.shape[0] for t in k_tiles),
    )


def _grow_round_robin(caps: list[int], target: int) -> list[int]:
    """A 3-axis tile grown by doubling, last (contiguous) axis first, round-robin, until its size
    reaches ``target`` or every axis reaches its cap (a doubling past a cap stops at the cap)."""
    tile = [1, 1, 1]
    grown = True
    while math.prod(tile) < target and grown:
        grown = False
        for a in (2, 1, 0):
            if tile[a] < caps[a] and math.prod(tile) < target:
                tile[a] = min(caps[a], tile[a] * 2)
                grown = True
    return tile


def kernel_tile_shape(params3: NAParams, target: int = 64, minimum: int = 16) -> tuple[int, int, int]:
    """Power-of-two query tile per axis with ``prod == target`` where the group lengths allow.

    Grows the axes round-robin from the last (contiguous) one, never past the next power of two of
    the longest dilation group; a tile below ``minimum`` positions (``tl.dot`` needs 16) is padded
    on the last axis (those rows are masked).
    """
    tile = _grow_round_robin([1 << max(0, math.ceil(math.log2(-(-L // d)))) for L, _, _, d, _ in params3.axes()],
                             target)
    while math.prod(tile) < minimum:
        tile[2] *= 2
    return tuple(tile)


# ----------------------------------------------------------------------------------------------
# Tables for the tiled PyTorch path (fixed-size tiles and halos, so all tiles batch together)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AxisTiles:
    """Fixed-size tiles of one axis: ``T`` queries and a halo of ``H`` keys each (all orig coords)."""

    queries: torch.Tensor  # [n, T] query coords (the last tile of a group repeats its last query)
    owned: torch.Tensor  # [n, T] False for repeated queries (each query is owned by exactly one tile)
    halo: torch.Tensor  # [n, H] key coords covering every window of the tile
    local: torch.Tensor  # [n, T, K] halo position of every slot (empty causal slots: a valid position)
    valid: torch.Tensor  # [n, T, K] slot inside the window
    rel: torch.Tensor  # [n, T, K] relative-position index j' - i' + K - 1


def axis_torch_tiles(L, K, s, d, causal, tile: int) -> AxisTiles:
    key, valid, rel = axis_neighbor_table(L, K, s, d, causal)  # [L, K] each
    spans = []
    for grp in axis_groups(L, K, s, d, causal):
        Lg = len(grp.members)
        first = torch.arange(0, Lg, tile)
        pos = first[:, None] + torch.arange(tile)[None, :]
        owned = pos < Lg
        pos = pos.clamp(max=Lg - 1)
        h_start = grp.start[first]
        spans.append((grp, Lg, pos, owned, h_start, grp.stop[pos[:, -1]] - h_start))
    halo_len = max(int(span.max()) for *_, span in spans)
    queries, owned_all, halo, local, valid_all, rel_all = [], [], [], [], [], []
    for grp, Lg, pos, owned, h_start, _ in spans:
        # Shift halos that would run past the group end back inside it (same length for every tile).
        h_start = torch.clamp(torch.clamp(h_start, max=Lg - halo_len), min=0)
        h_pos = (h_start[:, None] + torch.arange(halo_len)[None, :]).clamp(max=Lg - 1)
        q = grp.members[pos]  # [n, T]
        queries.append(q)
        owned_all.append(owned)
        halo.append(grp.members[h_pos])
        local.append(key[q] // d - h_start[:, None, None])
        valid_all.append(valid[q])
        rel_all.append(rel[q])
    cat = lambda xs: torch.cat(xs)  # noqa: E731
    return AxisTiles(cat(queries), cat(owned_all), cat(halo), cat(local), cat(valid_all), cat(rel_all))


@dataclass(frozen=True, eq=False)  # hashed by identity: instances are cached and used as cache keys
class TorchTiles:
    axes: tuple[AxisTiles, AxisTiles, AxisTiles]
    spatial: tuple[int, int, int]
    kernel_size: tuple[int, int, int]

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(a.queries.shape[0] for a in self.axes)

    @property
    def num_tiles(self) -> int:
        return math.prod(self.counts)

    @property
    def tile_queries(self) -> int:
        return math.prod(a.queries.shape[1] for a in self.axes)

    @property
    def tile_halo(self) -> int:
        return math.prod(a.halo.shape[1] for a in self.axes)

    def chunk(self, lo: int, hi: int, device, need_rel: bool = False) -> "TileChunk":
        """Flat N-D index tables of tiles [lo, hi) (row-major over the per-axis tiles).

        Small tables are cached (they are rebuilt for every call otherwise); large ones are not, so
        the cache stays bounded (``CHUNK_CACHE_ENTRIES`` x ``CHUNK_CACHE_BYTES``).
        """
        table_bytes = (hi - lo) * self.tile_queries * math.prod(self.kernel_size) * 17  # local, rel, valid
        if table_bytes > CHUNK_CACHE_BYTES:
            return self.build_chunk(lo, hi, device, need_rel)
        return _chunk_tables(self, lo, hi, torch.device(device), need_rel)

    def build_chunk(self, lo: int, hi: int, device, need_rel: bool = False) -> "TileChunk":
        u = torch.arange(lo, hi)
        picks = []
        for count in reversed(self.counts):
            picks.append(u % count)
            u = u // count
        picks.reverse()

        def outer(field, sizes=None):
            """Row-major outer product over axes of per-axis [n, T_a] or [n, T_a, K_a] tables.

            Index tables combine as ``acc * size_a + x`` (flat row-major index); masks as ``acc & x``.
            """
            acc = None
            for axis, pick, size in zip(self.axes, picks, sizes or (None,) * len(self.axes)):
                x = getattr(axis, field)[pick]
                if acc is None:
                    acc = x
                    continue
                if x.dim() == 2:
                    a, b = acc[:, :, None], x[:, None, :]
                else:
                    a, b = acc[:, :, None, :, None], x[:, None, :, None, :]
                acc = (a & b) if size is None else (a * size + b)
                acc = acc.reshape(acc.shape[0], -1) if x.dim() == 2 else acc.flatten(1, 2).flatten(2, 3)
            return acc

        halo_sizes = [a.halo.shape[1] for a in self.axes]
        rel_sizes = [2 * K - 1 for K in self.kernel_size]
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        valid = outer("valid")
        return TileChunk(
            queries=to(outer("queries", self.spatial)),
            owned=to(outer("owned")),
            halo=to(outer("halo", self.spatial)),
            local=to(outer("local", halo_sizes)),
            valid=to(valid),
            rel=to(outer("rel", rel_sizes)) if need_rel else None,
            all_valid=bool(valid.all()),
        )


CHUNK_CACHE_ENTRIES = 64
CHUNK_CACHE_BYTES = 4 * 1024 * 1024


@functools.lru_cache(maxsize=CHUNK_CACHE_ENTRIES)
def _chunk_tables(tiles: "TorchTiles", lo: int, hi: int, device: torch.device, need_rel: bool) -> "TileChunk":
    return tiles.build_chunk(lo, hi, device, need_rel)


@dataclass(frozen=True)
class TileChunk:
    queries: torch.Tensor  # [c, Tq] flat query index
    owned: torch.Tensor  # [c, Tq]
    halo: torch.Tensor  # [c, Th] flat key index
    local: torch.Tensor  # [c, Tq, W] flat halo position of each slot
    valid: torch.Tensor  # [c, Tq, W]
    rel: torch.Tensor | None  # [c, Tq, W] flat index into rpb.flatten(1)
    all_valid: bool  # no empty (causal) slot in the chunk


@functools.lru_cache(maxsize=128)
def torch_tiles(params3: NAParams, tile: tuple[int, int, int]) -> TorchTiles:
    axes = tuple(axis_torch_tiles(*axis, t) for axis, t in zip(params3.axes(), tile))
    return TorchTiles(axes, params3.spatial, params3.kernel_size)


def torch_tile_shape(params3: NAParams, target: int = 64) -> tuple[int, int, int]:
    """Query tile for the PyTorch path: ~``target`` queries, no axis longer than its dilation groups."""
    tile = _grow_round_robin([-(-L // d) for L, _, _, d, _ in params3.axes()], target)
    return tuple(tile)
