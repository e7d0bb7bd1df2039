"""Test oracle: dense O(N^2) masked attention built straight from the rules of docs/semantics.md.

Deliberately independent of ``ops.window``: plain Python loops over (query, key) pairs, so a bug
in the shared window module cannot hide behind an oracle that shares it.
"""
from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass

import torch


def _axis_keys(i: int, L: int, K: int, s: int, d: int, causal: bool):
    """Key indices (original coordinates) admitted for query i on one axis, straight from docs/semantics.md."""
    g = i % d
    ip = i // d
    Lg = L // d + (1 if g < L % d else 0)
    if causal:
        leader = min((ip // s) * s + s - 1, Lg - 1)
        lo, hi = max(leader - K + 1, 0), ip  # inclusive
    else:
        leader = min((ip // s) * s + s // 2, Lg - 1)
        lo = min(max(leader - K // 2, 0), Lg - K)
        hi = lo + K - 1
    return {jp * d + g: jp - ip + K - 1 for jp in range(lo, hi + 1)}


def dense_mask_and_bias_index(spatial, kernel_size, stride, dilation, causal):
    """Boolean mask [N, N] (query, key) and, per admitted pair, the per-axis RPB index tuple (shared between calls
    with the same rules: callers only read them)."""
    return _dense_mask_and_bias_index(tuple(int(x) for x in spatial), tuple(int(x) for x in kernel_size),
                                      tuple(int(x) for x in stride), tuple(int(x) for x in dilation),
                                      tuple(bool(c) for c in causal))


@functools.lru_cache(maxsize=8)  # large-window problems take seconds to build
def _dense_mask_and_bias_index(spatial, kernel_size, stride, dilation, causal):
    per_axis = [
        [_axis_keys(i, L, K, s, d, c) for i in range(L)]
        for L, K, s, d, c in zip(spatial, kernel_size, stride, dilation, causal)
    ]
    coords = list(itertools.product(*[range(L) for L in spatial]))
    index = {c: n for n, c in enumerate(coords)}
    N = len(coords)
    mask = torch.zeros(N, N, dtype=torch.bool)
    rel = {}
    for qn, qc in enumerate(coords):
        axis_sets = [per_axis[a][qc[a]] for a in range(len(spatial))]
        for kc in itertools.product(*[sorted(s) for s in axis_sets]):
            kn = index[kc]
            mask[qn, kn] = True
            rel[(qn, kn)] = tuple(axis_sets[a][kc[a]] for a in range(len(spatial)))
    return mask, rel


def oracle_attention(q, k, v, spatial, kernel_size, stride, dilation, causal, rpb=None, scale=None,
                     extra_k=None, extra_v=None):
    """Dense masked attention in float64.  q/k/v heads-last [B, *spatial, H, D]; returns (out, lse)."""
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    Hkv, Dv = k.shape[-2], v.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    mask, rel = dense_mask_and_bias_index(spatial, kernel_size, stride, dilation, causal)
    N = mask.shape[0]
    qf = q.double().reshape(B, N, H, D).transpose(1, 2)  # [B, H, N, D]
    rep = H // Hkv
    kf = k.double().reshape(B, N, Hkv, D).transpose(1, 2).repeat_interleave(rep, dim=1)
    vf = v.double().reshape(B, N, Hkv, Dv).transpose(1, 2).repeat_interleave(rep, dim=1)
    logits = qf @ kf.transpose(-1, -2) * scale  # [B, H, N, N]
    if rpb is not None:
        qs, ks = mask.nonzero(as_tuple=True)
        idx = [torch.tensor([rel[(a, b)][ax] for a, b in zip(qs.tolist(), ks.tolist())]) for ax in range(len(spatial))]
        gathered = rpb.double()[(slice(None), *idx)]  # [H, nnz]
        full = torch.zeros(H, N, N, dtype=torch.float64)
        full[:, qs, ks] = gathered
        logits = logits + full
    logits = logits.masked_fill(~mask, float("-inf"))
    if extra_k is not None:
        ek = extra_k.double().transpose(1, 2).repeat_interleave(rep, dim=1)  # [B, H, X, D]
        ev = extra_v.double().transpose(1, 2).repeat_interleave(rep, dim=1)
        logits = torch.cat([logits, qf @ ek.transpose(-1, -2) * scale], dim=-1)
        vf = torch.cat([vf, ev], dim=2)
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.softmax(logits, dim=-1) @ vf  # [B, H, N, Dv]
    out = out.transpose(1, 2).reshape(B, *spatial, H, Dv)
    lse = lse.transpose(1, 2).reshape(B, *spatial, H)
    return out, lse


@dataclass
class RandomProblem:
    spatial: tuple
    kernel_size: tuple
    stride: tuple
    dilation: tuple
    causal: tuple
    batch: int
    heads: int
    heads_kv: int
    dim: int
    dim_v: int
    use_rpb: bool

    def kwargs(self):
        return dict(kernel_size=self.kernel_size, stride=self.stride, dilation=self.dilation, is_causal=self.causal)

    def tensors(self, dtype=torch.float64, device="cpu", generator=None, requires_grad=False):
        shape = (self.batch, *self.spatial)
        mk = lambda *s: torch.randn(*s, dtype=dtype, device=device, generator=generator)  # noqa: E731
        q = mk(*shape, self.heads, self.dim)
        k = mk(*shape, self.heads_kv, self.dim)
        v = mk(*shape, self.heads_kv, self.dim_v)
        rpb = mk(self.heads, *[2 * K - 1 for K in self.kernel_size]) if self.use_rpb else None
        if requires_grad:
            for t in (q, k, v, rpb):
                if t is not None:
                    t.requires_grad_(True)
        return q, k, v, rpb


def random_axis(rng: random.Random, max_length: int = 40) -> tuple[int, int, int, int, bool]:
    """One valid axis ``(L, K, s, d, causal)``: any length, dilation, kernel and stride docs/semantics.md allows."""
    L = rng.randint(1, max_length)
    d = rng.randint(1, L)
    K = rng.randint(1, L // d)
    s = rng.randint(1, K)
    return L, K, s, d, rng.random() < 0.5


def random_problem(rng: random.Random, rank: int | None = None, max_tokens: int = 96, allow_rpb=True,
                   allow_causal=True, max_dim=8) -> RandomProblem:
    """Draws a valid problem: random spatial sizes, K from 1 to L, stride, dilation, causal, GQA, RPB."""
    rank = rank or rng.choice([1, 2, 3])
    max_side = {1: max_tokens, 2: int(math.sqrt(max_tokens)), 3: max(2, int(round(max_tokens ** (1 / 3))))}[rank]
    spatial, ks, ss, ds, cs = [], [], [], [], []
    for _ in range(rank):
        L = rng.randint(1, max_side)
        d = rng.randint(1, max(1, min(4, L)))
        K = rng.randint(1, L // d)
        s = rng.randint(1, K)
        spatial.append(L), ks.append(K), ss.append(s), ds.append(d)
        cs.append(allow_causal and rng.random() < 0.3)
    heads_kv = rng.choice([1, 2])
    heads = heads_kv * rng.choice([1, 2])
    use_rpb = allow_rpb and not any(cs) and rng.random() < 0.5
    return RandomProblem(tuple(spatial), tuple(ks), tuple(ss), tuple(ds), tuple(cs), rng.randint(1, 2), heads,
                         heads_kv, rng.randint(1, max_dim), rng.randint(1, max_dim), use_rpb)
