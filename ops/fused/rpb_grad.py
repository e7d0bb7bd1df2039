"""The RPB gradient from the dQ kernel's dS: in the bias tiles' layout (``DS_BOXES``, the default; at the end of this
module) or in window layout (``STORE_DS`` / ``DS_ATOMIC``, without bias tiles or when deterministic).

dRPB[h, r] sums dS(i, j) over every batch element and every (query i, key j) pair whose relative offset is r.
In the kernels' [queries, keys] tiles those pairs lie on diagonals, which Triton cannot reduce cheaply; a pass
that gathers one key row per query and offset (``na_bwd_drpb_kernel``) re-reads K and V once per offset, which
made it most of a small-window RPB backward (numbers in docs/fused.md).

Here the dQ kernel, which computes dS anyway, writes it in window layout: ``ds[b, token, h, slot]``, slot = the
key's row-major position in the query's window.  In that layout the offset of (query, slot) is, per axis, a fixed
function of the query's position and the slot (``ops.window.axis_neighbor_table``): one small kernel
(``na_drpb_window_kernel``) sums it by offset, reading each element once through per-axis (position, offset) ->
slot tables.

By default dQ adds dS over the batch with float32 atomics into one ``N * H * prod(K)`` buffer, which stays in L2, in
no fixed order; deterministic runs (``torch.use_deterministic_algorithms``) store one buffer per batch element (``B``
times the bytes) and sum them in order (sizes in docs/fused.md, "RPB gradient: window-layout dS").  The buffer is
used up to ``WINDOW_BUFFER_BYTES``; larger problems keep the offset pass.
"""
from __future__ import annotations

import math
import threading

import torch

from . import kernels
from ..window import NAParams, axis_neighbor_table

WINDOW_BUFFER_BYTES = 1 << 30


def buffer_shape(batch: int, heads: int, params: NAParams) -> tuple[int, int, int, int]:
    return batch, params.num_tokens, heads, params.window_size


def window_path_ok(batch: int, heads: int, params: NAParams) -> bool:
    """The window-layout buffer fits ``WINDOW_BUFFER_BYTES`` (RPB is only defined on non-causal axes, where every
    window is full, so the kernel writes every element and the buffer needs no zeroing)."""
    if any(params.is_causal):
        return False
    return 4 * math.prod(buffer_shape(batch, heads, params)) <= WINDOW_BUFFER_BYTES


def _slot_tables(params: NAParams, device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Per axis (padded to three with length-1 axes), ``[L, 2K - 1]``: the window slot of each position that holds
    each relative offset index, or -1; flattened into one int32 tensor, with the element offsets of axes 1 and 2."""
    pad = 3 - params.rank
    axes = [(1, 1, 1, 1, False)] * pad + list(params.axes())
    tables = []
    for L, K, s, d, causal in axes:
        _, valid, rel = axis_neighbor_table(L, K, s, d, causal)
        table = torch.full((L, 2 * K - 1), -1, dtype=torch.int32)
        rows, slots = valid.nonzero(as_tuple=True)  # a row's valid slots hold distinct offsets
        table[rows, rel[rows, slots]] = slots.to(torch.int32)
        tables.append(table.flatten())
    starts = (tables[0].numel(), tables[0].numel() + tables[1].numel())
    return torch.cat(tables).to(device), starts


# The tables per (problem, device), built once.  A cached table must stay outside CUDA-graph memory pools:
# torch.compile's CUDA graphs (cudagraph trees) route every allocation of the thread that warms up or records a
# graph into the graph's private pool and refuse a graph that leaves a pool tensor alive beyond its outputs.
_SLOT_TABLES: dict[tuple, tuple[torch.Tensor, tuple[int, ...]]] = {}
MAX_CACHED_PROBLEMS = 64


def slot_tables(params: NAParams, device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
    return _cached(_SLOT_TABLES, (params, device), lambda: _slot_tables(params, device), device)


def _cached(cache: dict, key: tuple, build, device: torch.device):
    """``cache[key]``, made by ``build()`` on first use outside any CUDA-graph pool (see above)."""
    value = cache.get(key)
    if value is not None:
        return value
    if device.type != "cuda":
        value = build()
    elif torch.cuda.is_current_stream_capturing():  # no graph-pool tensor may outlive the capture: not cached
        return build()
    else:
        value = _built_on_another_thread(build, device)
    if len(cache) < MAX_CACHED_PROBLEMS:
        cache[key] = value
    return value


def _built_on_another_thread(build, device: torch.device):
    """``build()`` run on a helper thread (whose allocations no graph pool takes), on the default stream, which
    the caller's current stream then waits for."""
    result = []
    worker = threading.Thread(target=lambda: result.append(build()))
    worker.start()
    worker.join()
    if not result:
        raise RuntimeError("rpb_grad: building the offset tables failed (see the thread's traceback above)")
    torch.cuda.current_stream(device).wait_stream(torch.cuda.default_stream(device))
    return result[0]


REDUCE_BLOCK = 256


def reduce_arguments(params: NAParams, heads: int, starts: tuple[int, int]) -> tuple[tuple[int, int], tuple]:
    """Grid and scalar arguments of ``na_drpb_window_kernel`` (one program per relative offset and head) for a
    problem, given the axis starts of its slot tables (``slot_tables``).  Its tensors: the batch-summed dS
    ``[N, H, prod(K)]``, the tables and the float32 dRPB ``[H, prod(2K - 1)]``."""
    pad = 3 - params.rank
    L = (1,) * pad + tuple(params.spatial)
    K = (1,) * pad + tuple(params.kernel_size)
    W = tuple(2 * k - 1 for k in K)
    return (math.prod(W), heads), (params.num_tokens, heads, params.window_size, L[1], L[2], *W, K[1], K[2], *starts)


def reduce_window_ds(ds: torch.Tensor, params: NAParams, launch=None) -> torch.Tensor:
    """dRPB ``[H, prod(2K - 1)]`` (float32) from ``ds`` ``[B, N, H, prod(K)]`` (B = 1 for the batch-summed buffer
    of dQ's atomics): a batch sum where B > 1, then one ``na_drpb_window_kernel`` launch, through ``launch`` (a
    backward plan's, called with the tensors) where given."""
    x = (ds[0] if ds.shape[0] == 1 else ds.sum(0)).contiguous()
    heads = x.shape[1]
    tables, starts = slot_tables(params, ds.device)
    out = torch.empty(heads, math.prod(params.rpb_shape), dtype=torch.float32, device=ds.device)
    if launch is None:
        grid, scalars = reduce_arguments(params, heads, starts)
        kernels.na_drpb_window_kernel[grid](x, tables, out, *scalars, BLOCK_N=REDUCE_BLOCK, num_warps=4)
    else:
        launch((x, tables, out))
    return out


# --- dS in the bias tiles' layout ------------------------------------------------------------------------------------
# With bias tiles (``decide.BIAS_TILES``) dQ adds dS over the batch into a buffer laid out like its bias tiles: whole
# [queries, keys] tiles, contiguous atomics with no index arithmetic, where the window layout needs a slot and a mask
# per element, which was the larger cost (docs/fused.md, "RPB gradient: tile-layout dS").  Each
# element's relative offset is fixed by the problem and the tiles, so a gather index per offset, built once, turns the
# buffer into dRPB in one pass (``na_drpb_tiles_kernel``).
TILE_REDUCE_BLOCK = 512


def tile_gather_index(offsets: torch.Tensor, n_rel: int) -> torch.Tensor:
    """``[n_rel, M]`` int32: for each relative offset, the positions of the tile-layout elements that hold it
    (``offsets``: the int32 offset of every element, -1 outside the windows), padded with -1 to the longest row."""
    flat = offsets.flatten().long()
    pos = torch.nonzero(flat >= 0).squeeze(1)
    key = flat[pos]
    order = torch.argsort(key, stable=True)
    pos, key = pos[order], key[order]
    counts = torch.bincount(key, minlength=n_rel)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    firsts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(key.numel(), device=key.device) - firsts[key]
    index = torch.full((n_rel, width), -1, dtype=torch.int32, device=offsets.device)
    index[key, rank] = pos.to(torch.int32)
    return index


_TILE_INDEX: dict[tuple, torch.Tensor] = {}


def tile_index(key: tuple, offsets_launch, elements: int, n_rel: int, device: torch.device) -> torch.Tensor:
    """The gather index of one problem's dQ tiles (``key``: what decides them), cached; ``offsets_launch`` writes
    the offsets (``na_bias_tiles_kernel`` with ``OFFSETS``) into an int32 buffer of ``elements``.  Built outside
    CUDA-graph pools, like the slot tables."""
    def build():
        offsets = torch.full((elements,), -1, dtype=torch.int32, device=device)  # boxes past a program's loop: -1
        offsets_launch((offsets, offsets, offsets))  # (RPB unused in this mode, BIAS, ZEROED unused)
        return tile_gather_index(offsets, n_rel)

    return _cached(_TILE_INDEX, (key, device), build, device)


def reduce_tile_ds(ds: torch.Tensor, index: torch.Tensor, heads: int, launch=None) -> torch.Tensor:
    """dRPB ``[H, R]`` (float32) from dQ's batch-summed tile-layout dS (``heads`` equal parts) and the problem's
    gather index ``[R, M]``, through ``launch`` (a backward plan's) where given."""
    n_rel, width = index.shape
    out = torch.empty(heads, n_rel, dtype=torch.float32, device=ds.device)
    if launch is None:
        kernels.na_drpb_tiles_kernel[(n_rel, heads)](ds, index, out, ds.numel() // heads, width, n_rel,
                                                   BLOCK=TILE_REDUCE_BLOCK, num_warps=4)
    else:
        launch((ds, index, out))
    return out
