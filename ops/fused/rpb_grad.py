"""The RPB gradient from dS in window layout (host side of the dQ kernel's ``STORE_DS``).

dRPB[h, r] sums dS(i, j) over every batch element and every (query i, key j) pair whose relative offset is r.
In the kernels' [queries, keys] tiles those pairs lie on diagonals, which Triton cannot reduce cheaply; a pass
that gathers one key row per query and offset (``na_bwd_drpb_kernel``) re-reads K and V once per offset, which
made it most of a small-window RPB backward (numbers in docs/fused.md).

Here the dQ kernel, which computes dS anyway, writes it in window layout: ``ds[b, token, h, slot]``, slot = the
key's row-major position in the query's window.  In that layout the offset of (query, slot) is, per axis, a fixed
function of the query's position and the slot (``ops.window.axis_neighbor_table``), so the sum is a batch
reduction followed by one small contraction per axis with a one-hot [positions, slots, offsets] table.

The buffer holds ``B * N * H * prod(K)`` float32 values (157 MB for nat-s1: B 128, 56x56, 2 heads, 7x7), so it is
used only up to ``WINDOW_BUFFER_BYTES``; larger problems keep the offset pass.
"""
from __future__ import annotations

import math
import string
import threading

import torch

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


def _onehots(params: NAParams, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per axis, [L, K, 2K - 1] float32: 1 where (position, slot) has that relative offset."""
    tables = []
    for L, K, s, d, causal in params.axes():
        _, _, rel = axis_neighbor_table(L, K, s, d, causal, device)
        tables.append(torch.nn.functional.one_hot(rel, 2 * K - 1).to(torch.float32))
    return tuple(tables)


# The tables per (problem, device), built once.  A cached table must stay outside CUDA-graph memory pools:
# torch.compile's CUDA graphs (cudagraph trees) route every allocation of the thread that warms up or records a
# graph into the graph's private pool and refuse a graph that leaves a pool tensor alive beyond its outputs.
_ONEHOTS: dict[tuple, tuple[torch.Tensor, ...]] = {}
MAX_CACHED_PROBLEMS = 64


def _axis_onehots(params: NAParams, device: torch.device) -> tuple[torch.Tensor, ...]:
    key = (params, device)
    tables = _ONEHOTS.get(key)
    if tables is not None:
        return tables
    if device.type != "cuda":
        tables = _onehots(params, device)
    elif torch.cuda.is_current_stream_capturing():  # no graph-pool tensor may outlive the capture: not cached
        return _onehots(params, device)
    else:
        tables = _built_on_another_thread(lambda: _onehots(params, device), device)
    if len(_ONEHOTS) < MAX_CACHED_PROBLEMS:
        _ONEHOTS[key] = tables
    return tables


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


def reduce_window_ds(ds: torch.Tensor, params: NAParams) -> torch.Tensor:
    """dRPB ``[H, prod(2K - 1)]`` (float32) from ``ds`` ``[B, N, H, prod(K)]``."""
    heads = ds.shape[2]
    rank = params.rank
    x = ds.sum(0).reshape(*params.spatial, heads, *params.kernel_size)
    letters = iter(string.ascii_letters)
    pos = [next(letters) for _ in range(rank)]
    head = next(letters)
    slot = [next(letters) for _ in range(rank)]
    off = [next(letters) for _ in range(rank)]
    dims = pos + [head] + slot
    # one axis at a time: (position, slot) -> offset; the operands stay the size of one batch element's dS
    for a, onehot in enumerate(_axis_onehots(params, ds.device)):
        out = [c for c in dims if c not in (pos[a], slot[a])] + [off[a]]
        x = torch.einsum(f"{''.join(dims)},{pos[a]}{slot[a]}{off[a]}->{''.join(out)}", x, onehot)
        dims = out
    return x.reshape(heads, -1)
