"""Backend ``naive``: gather-based neighborhood attention in pure PyTorch (the paper's baseline).

Every query gathers its own window of keys and values.  Queries are processed in chunks so the
gathered ``[B, chunk, W, H, D]`` tensors stay under a fixed memory budget; the backward recomputes
each chunk's logits from the saved log-sum-exp (flash-style) instead of keeping them, so training
memory is bounded too.  Runs on any device and dtype (math in float32, float64 for float64).
"""
from __future__ import annotations

import functools

import torch

from ..autodiff import saved_inputs, second_order
from ..backends import constant_tensors, run_on_token_rows
from ..registered import register
from ..window import NAParams, neighbor_table

# Upper bound on the bytes of one chunk's gathered keys (values are the same order of size).  GPUs get a
# larger budget: with 64 MiB a 2d-flux query (6400 keys x 24 heads x 128 dims) fills a chunk alone, and
# 65536 one-query iterations spend their time launching kernels rather than gathering.
CHUNK_BYTES = 64 * 1024 * 1024
CUDA_CHUNK_BYTES = 1024 * 1024 * 1024


def _tables(params: NAParams, device: torch.device, lo: int, hi: int):
    """Slot tables of queries [lo, hi), built per chunk so no [N, W] table is ever held whole."""
    key, valid, rel = neighbor_table(params, queries=torch.arange(lo, hi, device=device))
    return key, valid, rel, not any(params.is_causal)


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_size(batch, window, heads_kv, dim, elem_bytes, device):
    per_query = batch * window * heads_kv * dim * elem_bytes
    budget = CUDA_CHUNK_BYTES if device.type == "cuda" else CHUNK_BYTES
    return max(1, budget // max(per_query, 1))


@functools.lru_cache(maxsize=256)
def _constant_tables(params: NAParams, device: torch.device, lo: int, hi: int):
    """``_tables`` built as real tensors outside any trace, once per problem and chunk: constants of a traced
    graph (built inside it they would be tens of index ops per call)."""
    with constant_tensors():
        return _tables(params, device, lo, hi)


class _Chunk:
    """Gathered window of one chunk of queries, in compute precision."""

    def __init__(self, q, k, v, rpb, params, lo, hi, scale, groups, tables=None):
        key_idx, valid, rel, all_valid = tables if tables is not None else _tables(params, q.device, lo, hi)
        ct = _compute_dtype(q.dtype)
        b, n, hq, d = q.shape
        hkv = k.shape[2]
        self.idx = key_idx  # [n_c, W]
        self.valid = None if all_valid else valid
        n_c, w = self.idx.shape
        self.q = q[:, lo:hi].to(ct).reshape(b, n_c, hkv, groups, d)
        flat_idx = self.idx.reshape(-1)
        self.k = k.index_select(1, flat_idx).to(ct).reshape(b, n_c, w, hkv, d)
        self.v = v.index_select(1, flat_idx).to(ct).reshape(b, n_c, w, hkv, v.shape[-1])
        self.rel = rel
        self.scale = scale
        self.rpb = rpb
        self.shape = (b, n_c, hkv, groups, w)

    def logits(self):
        s = torch.einsum("bnkgd,bnwkd->bnkgw", self.q, self.k) * self.scale
        if self.rpb is not None:
            b, n_c, hkv, groups, w = self.shape
            bias = self.rpb.flatten(1).to(s.dtype)[:, self.rel]  # [H, n_c, W]
            s = s + bias.reshape(hkv, groups, n_c, w).permute(2, 0, 1, 3).unsqueeze(0)
        if self.valid is not None:
            s = s.masked_fill(~self.valid[None, :, None, None, :], float("-inf"))
        return s


def _forward(q, k, v, params, rpb, scale):
    """Returns out [B, N, Hq, Dv] (input dtype) and lse [B, N, Hq] (compute dtype); flat spatial."""
    b, n, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    groups = hq // hkv
    ct = _compute_dtype(q.dtype)
    out = torch.empty(b, n, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, n, hq, dtype=ct, device=q.device)
    step = _chunk_size(b, params.window_size, hkv, max(d, dv), torch.finfo(ct).bits // 8, q.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        c = _Chunk(q, k, v, rpb, params, lo, hi, scale, groups)
        s = c.logits()
        m = torch.logsumexp(s, dim=-1)  # [b, n_c, hkv, g]
        p = torch.exp(s - m.unsqueeze(-1))
        o = torch.einsum("bnkgw,bnwkd->bnkgd", p, c.v)
        out[:, lo:hi] = o.reshape(b, hi - lo, hq, dv).to(q.dtype)
        lse[:, lo:hi] = m.reshape(b, hi - lo, hq)
    return out, lse


def plain_forward(q, k, v, rpb, params, scale):
    """``_forward`` as a graph of tensor ops, for ``torch.export`` / ``torch.jit.trace`` and for what autograd and
    ``torch.func`` differentiate beyond first order (``ops.autodiff``): constant index tables,
    chunks sized for one batch element (the graph then serves any batch; the example's batch size would otherwise
    fix the number of chunks), the chunks' outputs concatenated instead of written into an empty tensor."""
    b, n, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    groups = hq // hkv
    ct = _compute_dtype(q.dtype)
    step = _chunk_size(1, params.window_size, hkv, max(d, dv), torch.finfo(ct).bits // 8, q.device)
    outs, lses = [], []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        c = _Chunk(q, k, v, rpb, params, lo, hi, scale, groups,
                   tables=_constant_tables(params, torch.device(q.device), lo, hi))
        s = c.logits()
        m = torch.logsumexp(s, dim=-1)
        o = torch.einsum("bnkgw,bnwkd->bnkgd", torch.exp(s - m.unsqueeze(-1)), c.v)
        outs.append(o.reshape(b, hi - lo, hq, dv).to(q.dtype))
        lses.append(m.reshape(b, hi - lo, hq))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 1), torch.cat(lses, 1)


def _backward(q, k, v, params, rpb, scale, out, lse, d_out, d_lse):
    b, n, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    groups = hq // hkv
    ct = _compute_dtype(q.dtype)
    dq = torch.empty(b, n, hq, d, dtype=ct, device=q.device)
    dk = torch.zeros(b, n, hkv, d, dtype=ct, device=q.device)
    dv_ = torch.zeros(b, n, hkv, dv, dtype=ct, device=q.device)
    drpb = torch.zeros(hq, rpb[0].numel(), dtype=ct, device=q.device) if rpb is not None else None
    # delta_i = sum_j P_ij dP_ij = rowsum(dO * O) - dlse_i  (the lse gradient enters through dS = P*(dP - delta))
    delta = (d_out.to(ct) * out.to(ct)).sum(-1)
    if d_lse is not None:
        delta = delta - d_lse.to(ct)
    step = _chunk_size(b, params.window_size, hkv, max(d, dv), torch.finfo(ct).bits // 8, q.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        n_c = hi - lo
        c = _Chunk(q, k, v, rpb, params, lo, hi, scale, groups)
        s = c.logits()
        p = torch.exp(s - lse[:, lo:hi].reshape(b, n_c, hkv, groups, 1))
        do = d_out[:, lo:hi].to(ct).reshape(b, n_c, hkv, groups, dv)
        dp = torch.einsum("bnkgd,bnwkd->bnkgw", do, c.v)
        ds = p * (dp - delta[:, lo:hi].reshape(b, n_c, hkv, groups, 1))
        dq[:, lo:hi] = (torch.einsum("bnkgw,bnwkd->bnkgd", ds, c.k) * scale).reshape(b, n_c, hq, d)
        dk_g = torch.einsum("bnkgw,bnkgd->bnwkd", ds, c.q) * scale
        dv_g = torch.einsum("bnkgw,bnkgd->bnwkd", p, do)
        flat = c.idx.reshape(-1)
        dk.index_add_(1, flat, dk_g.reshape(b, -1, hkv, d))
        dv_.index_add_(1, flat, dv_g.reshape(b, -1, hkv, dv))
        if drpb is not None:
            # ds: [b, n_c, hkv, g, W] -> per query head and relative index
            ds_h = ds.sum(0).permute(1, 2, 0, 3).reshape(hq, -1)  # [Hq, n_c * W]
            drpb.index_add_(1, c.rel.reshape(-1), ds_h)
    return dq, dk, dv_, drpb


def plain_qk(q, k, rpb, params):
    """``ops.unfused.na_qk`` on flat ``[B, N, H, D]`` tensors as plain tensor ops: ``[B, N, H, prod(K)]`` logits,
    ``-inf`` in empty causal slots (what autograd and ``torch.func`` differentiate beyond first order)."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    key_idx, valid, rel, all_valid = _constant_tables(params, torch.device(q.device), 0, n)
    w = key_idx.shape[1]
    keys = k.index_select(1, key_idx.reshape(-1)).reshape(b, n, w, hkv, d)
    logits = torch.einsum("bnkgd,bnwkd->bnkgw", q.reshape(b, n, hkv, hq // hkv, d), keys).reshape(b, n, hq, w)
    if rpb is not None:
        logits = logits + rpb.flatten(1)[:, rel].permute(1, 0, 2).to(logits.dtype)  # [N, H, W]
    if not all_valid:
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return logits


def plain_av(attn, v, params):
    """``ops.unfused.na_av`` on flat tensors as plain tensor ops: weights ``[B, N, H, prod(K)]`` times the values of
    their slots, ``[B, N, H, Dv]`` (empty causal slots ignored)."""
    b, n, hq, w = attn.shape
    hkv, dv = v.shape[2], v.shape[3]
    key_idx, valid, _, all_valid = _constant_tables(params, torch.device(v.device), 0, n)
    if not all_valid:
        attn = attn.masked_fill(~valid[:, None, :], 0.0)
    values = v.index_select(1, key_idx.reshape(-1)).reshape(b, n, w, hkv, dv)
    out = torch.einsum("bnkgw,bnwkd->bnkgd", attn.reshape(b, n, hkv, hq // hkv, w), values)
    return out.reshape(b, n, hq, dv)


def _forward_rows(q, k, v, rpb, params, scale):
    return _forward(q, k, v, params, rpb, scale)


def _gradients(q, k, v, rpb, out, lse, d_out, d_lse, params, scale):
    """``(dq, dk, dv, drpb or None)`` in the inputs' dtypes and shapes: the backward both autograd paths share."""
    dq, dk, dv, drpb = _backward(q, k, v, params, rpb, scale, out, lse, d_out, d_lse)
    if drpb is not None:
        drpb = drpb.reshape(rpb.shape).to(rpb.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), drpb


class _NaiveAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rpb, params, scale):
        out, lse = _forward(q, k, v, params, rpb, scale)
        ctx.save_for_backward(q, k, v, rpb, out, lse)
        ctx.params, ctx.scale = params, scale
        return out, lse

    @staticmethod
    @second_order(saved_inputs)
    def backward(ctx, d_out, d_lse):
        q, k, v, rpb, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        return (*_gradients(q, k, v, rpb, out, lse, d_out, d_lse, ctx.params, ctx.scale), None, None)


class NaiveBackend:
    name = "naive"

    def unsupported(self, problem) -> str | None:
        return None  # any device, any dtype, every window rule

    def attention(self, q, k, v, params: NAParams, rpb, scale, need_lse=True):
        if torch.compiler.is_compiling():  # one opaque op in the graph (ops.registered)
            return _registered(q, k, v, rpb, params, scale)
        return run_on_token_rows(_NaiveAttention.apply, q, k, v, rpb, params, scale)

    def traced_attention(self, q, k, v, params: NAParams, rpb, scale):
        # (differentiable by the recorded ops themselves: a traced module can still be trained)
        return run_on_token_rows(plain_forward, q, k, v, rpb, params, scale)


_registered = register("naive", _forward_rows, _gradients)
BACKEND = NaiveBackend()
