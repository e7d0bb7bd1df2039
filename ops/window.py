"""Neighborhood window rules as index math: the single source every backend imports.

The rules (``docs/semantics.md``, identical to NATTEN >= 0.20), per spatial axis of length ``L`` with
kernel ``K``, stride ``s``, dilation ``d`` and a causal flag:

* query ``i`` and key ``j`` interact only inside one dilation group: ``i % d == j % d``;
  inside the group the coordinates are ``i' = i // d`` and ``j' = j // d`` and the group has
  ``Lg = L // d + (g < L % d)`` positions, ``g = i % d``;
* non-causal: ``leader = min((i' // s) * s + s // 2, Lg - 1)``,
  ``start = clamp(leader - K // 2, 0, Lg - K)``, keys ``j'`` in ``[start, start + K)``;
* causal: ``leader = min((i' // s) * s + s - 1, Lg - 1)``, keys ``j'`` in
  ``[max(leader - K + 1, 0), i']``;
* an N-D query attends to an N-D key iff every axis admits it.

Neighbor slots: slot ``t`` (0 <= t < K) of query ``i`` is the key ``j' = start + t``; in the causal
case the slots past ``i'`` are empty.  N-D slots are row-major over the per-axis slots.  The
relative positional bias index of (i, j) on an axis is ``j' - i' + K - 1``.

Every function here is elementwise on integer tensors (or Python ints), so the same code builds
gather tables (naive / gemm backends) and runs inside ``flex_attention``'s ``mask_mod``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "NAParams",
    "axis_window",
    "axis_admits",
    "axis_neighbor_table",
    "neighbor_table",
    "admits",
    "keys_per_query",
]


@dataclass(frozen=True)
class NAParams:
    """Validated, per-axis neighborhood parameters (all tuples have one entry per spatial axis)."""

    spatial: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    is_causal: tuple[bool, ...]

    @property
    def rank(self) -> int:
        return len(self.spatial)

    @property
    def window_size(self) -> int:
        """Neighbor slots per query, prod(K)."""
        return math.prod(self.kernel_size)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.spatial)

    @property
    def rpb_shape(self) -> tuple[int, ...]:
        return tuple(2 * k - 1 for k in self.kernel_size)

    def axes(self):
        """Yields (L, K, s, d, causal) per axis."""
        return zip(self.spatial, self.kernel_size, self.stride, self.dilation, self.is_causal)


# min/max that work on Python ints, on tensors, and on a mix (also inside vmap, e.g. flex mask_mod).
def _minimum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.where(a < b, a, b)
    return min(a, b)


def _maximum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.where(a > b, a, b)
    return max(a, b)


def axis_window(i, L: int, K: int, s: int, d: int, causal: bool):
    """Window of query ``i`` on one axis, in dilation-group coordinates.

    Returns ``(g, i_g, start, stop)``: the dilation group of ``i``, its index inside the group,
    and the half-open range ``[start, stop)`` of admitted keys ``j'`` (group coordinates; the key's
    axis index is ``j' * d + g``).  ``i`` may be an int or an integer tensor (elementwise).
    """
    g = i % d
    i_g = i // d
    group_len = L // d + (g < L % d) * 1
    if causal:
        leader = _minimum((i_g // s) * s + (s - 1), group_len - 1)
        start = _maximum(leader - K + 1, 0)
        stop = i_g + 1
    else:
        leader = _minimum((i_g // s) * s + s // 2, group_len - 1)
        start = _minimum(_maximum(leader - K // 2, 0), group_len - K)
        stop = start + K
    return g, i_g, start, stop


def axis_admits(i, j, L: int, K: int, s: int, d: int, causal: bool):
    """True where key ``j`` is in the window of query ``i`` on this axis (elementwise)."""
    g, _, start, stop = axis_window(i, L, K, s, d, causal)
    j_g = j // d
    return (j % d == g) & (j_g >= start) & (j_g < stop)


def admits(q_coords: Sequence, k_coords: Sequence, params: NAParams):
    """True where the N-D key is in the N-D query's window (every axis admits it)."""
    ok = None
    for qi, kj, (L, K, s, d, c) in zip(q_coords, k_coords, params.axes()):
        a = axis_admits(qi, kj, L, K, s, d, c)
        ok = a if ok is None else ok & a
    return ok


def axis_neighbor_table(L: int, K: int, s: int, d: int, causal: bool, device=None):
    """Per-axis slot tables for all ``L`` queries.

    Returns ``(key, valid, rel)``, each ``[L, K]``: the key's axis index for every slot, whether
    the slot is inside the window (only causal windows have empty slots; their key is clamped to
    a valid index so gathers stay in bounds), and the relative-position index ``j' - i' + K - 1``.
    """
    i = torch.arange(L, device=device)
    g, i_g, start, stop = axis_window(i, L, K, s, d, causal)
    slot = torch.arange(K, device=device)
    j_g = start[:, None] + slot[None, :]
    valid = j_g < stop[:, None]
    rel = j_g - i_g[:, None] + (K - 1)
    j_g = torch.minimum(j_g, (stop - 1)[:, None])
    key = j_g * d + g[:, None]
    return key, valid, rel.clamp(0, 2 * K - 2)


def neighbor_table(params: NAParams, device=None, queries: torch.Tensor | None = None):
    """N-D slot tables over flattened (row-major) query and key indices.

    ``queries`` (1-D tensor of flat query indices, default all ``N = prod(spatial)``) lets callers
    build the tables chunk by chunk.  Returns ``(key, valid, rel)``, each ``[len(queries), W]``
    with ``W = prod(kernel_size)``: the flat key index, the validity mask, and the flat index
    into ``rpb.flatten(1)`` (shape ``[H, prod(2K-1)]``).
    """
    if queries is None:
        queries = torch.arange(params.num_tokens, device=device)
    # Unravel flat query indices into per-axis coordinates (row-major: last axis fastest).
    coords, rest = [], queries
    for L in reversed(params.spatial):
        coords.append(rest % L)
        rest = rest // L
    coords.reverse()
    key = valid = rel = None
    for coord, (L, K, s, d, c) in zip(coords, params.axes()):
        k_a, v_a, r_a = (t[coord] for t in axis_neighbor_table(L, K, s, d, c, queries.device))  # [n, K]
        if key is None:
            key, valid, rel = k_a, v_a, r_a
            continue
        # Row-major outer product of the slots so far with this axis's slots.
        n = key.shape[0]
        key = (key[:, :, None] * L + k_a[:, None, :]).reshape(n, -1)
        valid = (valid[:, :, None] & v_a[:, None, :]).reshape(n, -1)
        rel = (rel[:, :, None] * (2 * K - 1) + r_a[:, None, :]).reshape(n, -1)
    return key, valid, rel


def keys_per_query(params: NAParams) -> float:
    """Mean number of keys a query actually visits (for FLOP counts: prod(K) unless causal)."""
    total = 1.0
    for L, K, s, d, c in params.axes():
        if not c:
            total *= K
            continue
        i = torch.arange(L)
        _, _, start, stop = axis_window(i, L, K, s, d, c)
        total *= float((stop - start).double().mean())
    return total
