"""Forward-mode derivative (JVP) of neighborhood attention: one Triton kernel, one pass per query.

Given the primal inputs, their tangents and the primal lse, ``forward_tangent`` returns the tangents of the
attention output and of its lse.  Per query ``i`` with neighbor set ``N(i)`` (``docs/semantics.md``):

    S_ij   = scale * q_i . k_j + rpb_ij                          P = softmax of S over N(i)
    tS_ij  = scale * (tq_i . k_j + q_i . tk_j) + trpb_ij
    t_lse_i = sum_j P_ij tS_ij
    t_out_i = sum_j P_ij (tS_ij - t_lse_i) v_j + sum_j P_ij tv_j

Why a kernel of its own: the backward kernels give vector-Jacobian products, and a JVP built from them (or from
autograd's double-backward trick) would take several passes and materialise per-window tensors.  Here every query
row visits its window once, gathering its own key, value and their tangents per window slot (the same per-row
gather as the ``*_by_offset`` paths of ``kernels.py``), and keeps its running sums on chip.

Choices:

* The weights come from the primal lse, ``P_ij = exp(S_ij - lse_i)``, instead of an online softmax with a running
  maximum.  The lse is an output of the primal call anyway, and with it no accumulator ever needs rescaling (an
  online max would rescale three [rows, Dv] sums at every slot); ``exp(S - lse) <= 1`` cannot overflow.  The kernel
  still divides every sum by its own ``sum_j exp(S_ij - lse_i)`` (1 up to rounding), so an lse rounded differently
  from the logits recomputed here (another backend, another summation order) leaves the weights normalised.
* ``tS`` is accumulated relative to the row's first slot (a key every query admits): ``t_out`` is a covariance
  of ``tS`` and ``v`` under P, and computing it as ``E[tS v] - E[tS] E[v]`` loses digits in proportion to the
  common part of ``tS`` (a bias tangent shared by the whole window, keys with a large mean); shifting by one
  sample of ``tS`` removes that common part, and the lse tangent gets it back exactly.
* ``out`` is accepted (the primal outputs of the call) and checked, but the kernel sums ``P v`` itself in the
  accumulation dtype rather than reading the output rounded to the input dtype.
* Math in float32, in float64 for float64 inputs; ``t_out`` in the input dtype, ``t_lse`` in float32 (float64 for
  float64 inputs), as the primal lse.
* Every problem runs as 3-D (missing leading axes have length 1, kernel 1); a program owns ``BLOCK_M`` consecutive
  flat query rows of one (batch element, head), on a 1-D grid whose neighbouring programs share a head (and so most
  of their keys); GQA maps query head ``h`` to key/value head ``h // (Hq / Hkv)``.
* No ``tl.dot``: the rows of a program have different windows in general (dilation groups, borders, strides), so
  each slot is a gather of one key per row and the logits are row-wise dot products.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..window import NAParams
from .window_jit import group_length, window_start, window_stop

__all__ = ["forward_tangent"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def _axis_window(c, L, K, S, DIL, CAUSAL: tl.constexpr):
    """Per row on one axis: dilation group, group coordinate, and the admitted keys ``[start, stop)`` (group
    coordinates)."""
    g = c % DIL
    i = c // DIL
    start = window_start(i, group_length(L, DIL, g), K, S, CAUSAL)
    return g, i, start, window_stop(i, start, K, CAUSAL)


@triton.jit
def _rows(PTR, base, tok, stride_tok, offs, ok, ACC: tl.constexpr):
    """[rows, cols] gather of one head's vectors at the tokens ``tok`` (zero where ``ok`` is false)."""
    return tl.load(PTR + base + tok[:, None] * stride_tok + offs[None, :], mask=ok, other=0.0).to(ACC)


@triton.jit
def _na_jvp_kernel(
    Q, Kp, V, RPB, TQ, TK, TV, TRPB, LSE, TOUT, TLSE,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    stqb, stqt, stqh, stkb, stkt, stkh, stvb, stvt, stvh,
    slb, slt, slh,
    N, ROW_BLOCKS, HEADS, GROUP, L0, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2, HEAD_DIM, VALUE_DIM,
    qk_scale: tl.float64,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    HAS_RPB: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
    HAS_TRPB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr,
):
    HAS_TS: tl.constexpr = HAS_TQ or HAS_TK or HAS_TRPB
    pid = tl.program_id(0)
    bh = pid // ROW_BLOCKS
    b = (bh // HEADS).to(tl.int64)
    h = bh % HEADS
    hk = h // GROUP
    scale = (qk_scale + tl.zeros([], ACC)).to(ACC)  # a float64 argument (a Python float when interpreted)

    rows = (pid % ROW_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    n = tl.minimum(rows, N - 1)  # rows past the end: a valid query whose results are not stored
    g0, i0, start0, stop0 = _axis_window(n // (L1 * L2), L0, K0, S0, D0, CAUSAL0)
    g1, i1, start1, stop1 = _axis_window((n // L2) % L1, L1, K1, S1, D1, CAUSAL1)
    g2, i2, start2, stop2 = _axis_window(n % L2, L2, K2, S2, D2, CAUSAL2)
    # The key of slot (a0, a1, a2) and its bias index are linear in the slot: a per-row base (slot 0) plus an offset
    # common to all rows, so the loop keeps few per-row values (registers).
    key0 = ((start0 * D0 + g0) * L1 + (start1 * D1 + g1)) * L2 + (start2 * D2 + g2)
    rel0 = ((start0 - i0 + K0 - 1) * (2 * K1 - 1) + (start1 - i1 + K1 - 1)) * (2 * K2 - 1) + (start2 - i2 + K2 - 1)
    span0 = stop0 - start0  # slots of the window per axis (K except on causal axes)
    span1 = stop1 - start1
    span2 = stop2 - start2
    n64 = n.to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < VALUE_DIM
    q = _rows(Q, b * sqb + h * sqh, n64, sqt, offs_d, row_ok[:, None] & d_ok[None, :], ACC)
    if HAS_TQ:
        tq = _rows(TQ, b * stqb + h * stqh, n64, stqt, offs_d, row_ok[:, None] & d_ok[None, :], ACC)
    lse = tl.load(LSE + b * slb + n64 * slt + h * slh, mask=row_ok, other=0.0).to(ACC)
    n_rel = (2 * K0 - 1) * (2 * K1 - 1) * (2 * K2 - 1)

    p_sum = tl.zeros([BLOCK_M], ACC)  # sum p            (p = exp(S - lse), 1 up to rounding)
    ps_sum = tl.zeros([BLOCK_M], ACC)  # sum p x          (x = tS - ts_ref)
    ts_ref = tl.zeros([BLOCK_M], ACC)  # tS of slot 0
    pv = tl.zeros([BLOCK_M, BLOCK_DV], ACC)  # sum p v
    psv = tl.zeros([BLOCK_M, BLOCK_DV], ACC)  # sum p x v
    ptv = tl.zeros([BLOCK_M, BLOCK_DV], ACC)  # sum p tv
    for t in tl.range(0, K0 * K1 * K2, num_stages=1):
        # slot t, row-major over the per-axis slots (a0, a1, a2)
        a0 = t // (K1 * K2)
        a1 = (t // K2) % K1
        a2 = t % K2
        adm = row_ok  # only causal axes have empty slots (past the query)
        if CAUSAL0:
            adm = adm & (a0 < span0)
        if CAUSAL1:
            adm = adm & (a1 < span1)
        if CAUSAL2:
            adm = adm & (a2 < span2)
        key = (key0 + ((a0 * D0) * L1 + a1 * D1) * L2 + a2 * D2).to(tl.int64)
        rel = rel0 + (a0 * (2 * K1 - 1) + a1) * (2 * K2 - 1) + a2
        k = _rows(Kp, b * skb + hk * skh, key, skt, offs_d, adm[:, None] & d_ok[None, :], ACC)
        v = _rows(V, b * svb + hk * svh, key, svt, offs_dv, adm[:, None] & dv_ok[None, :], ACC)
        s = tl.sum(q * k, 1) * scale
        if HAS_RPB:
            s += tl.load(RPB + h * n_rel + rel, mask=adm, other=0.0).to(ACC)
        p = tl.where(adm, tl.exp(s - lse), 0.0)
        p_sum += p
        pv += p[:, None] * v
        if HAS_TS:
            ts = tl.zeros([BLOCK_M], ACC)
            if HAS_TQ:
                ts += tl.sum(tq * k, 1)
            if HAS_TK:
                tk = _rows(TK, b * stkb + hk * stkh, key, stkt, offs_d, adm[:, None] & d_ok[None, :], ACC)
                ts += tl.sum(q * tk, 1)
            ts = ts * scale
            if HAS_TRPB:
                ts += tl.load(TRPB + h * n_rel + rel, mask=adm, other=0.0).to(ACC)
            ts_ref = tl.where(t == 0, ts, ts_ref)  # slot 0 lies in every window
            px = p * (ts - ts_ref)
            ps_sum += px
            psv += px[:, None] * v
        if HAS_TV:
            tv = _rows(TV, b * stvb + hk * stvh, key, stvt, offs_dv, adm[:, None] & dv_ok[None, :], ACC)
            ptv += p[:, None] * tv

    inv = 1.0 / tl.where(row_ok, p_sum, 1.0)
    mean_x = ps_sum * inv  # E[tS] - ts_ref
    t_out = (psv - mean_x[:, None] * pv + ptv) * inv[:, None]
    t_lse = ts_ref + mean_x
    out_rows = (b * N + n64) * HEADS + h  # the outputs are contiguous [B, N, H(, Dv)]
    tl.store(TOUT + out_rows[:, None] * VALUE_DIM + offs_dv[None, :], t_out.to(TOUT.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(TLSE + out_rows, t_lse.to(TLSE.dtype.element_ty), mask=row_ok)


def _check(name: str, x, shape, device):
    """A tensor argument (None: absent) of the given shape on ``device``; errors name the argument."""
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device}, got {x.device}")


def _token_view(x, B, N):
    """``x`` as ``[B, N, H, C]`` with a unit last stride (a view where possible), and its batch, token, head strides."""
    x = x.reshape(B, N, x.shape[-2], x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(1), x.stride(2)


def forward_tangent(q, k, v, rpb, tq, tk, tv, trpb, out, lse, params: NAParams, scale: float):
    """Tangents ``(t_out, t_lse)`` of ``(out, lse) = NA(q, k, v, rpb)`` along ``(tq, tk, tv, trpb)``.

    ``q [B, *spatial, Hq, D]``, ``k [B, *spatial, Hkv, D]``, ``v [B, *spatial, Hkv, Dv]`` (Hkv divides Hq), ``rpb``
    None or ``[Hq, 2K-1 per axis]`` (non-causal axes only); ``out [B, *spatial, Hq, Dv]`` and ``lse [B, *spatial, Hq]``
    (natural log) the primal outputs for ``params`` and ``scale``.  Each tangent has its primal's shape or is None
    (zero).  Returns ``t_out`` in q's dtype and ``t_lse`` in float32 (float64 for float64 inputs).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}")
    if not isinstance(params, NAParams):
        raise ValueError(f"params: expected ops.window.NAParams, got {type(params).__name__}")
    rank = params.rank
    if rank not in (1, 2, 3):
        raise ValueError(f"params: rank must be 1, 2 or 3, got {rank}")
    if q.dim() != rank + 3:
        raise ValueError(f"q: expected rank {rank + 3} [B, *spatial, H, D] for {rank}-D attention, got {q.dim()}")
    if tuple(q.shape[1:-2]) != tuple(params.spatial):
        raise ValueError(f"q: spatial shape {tuple(q.shape[1:-2])} does not match params.spatial {params.spatial}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q: dtype {q.dtype} not supported (float16, bfloat16, float32, float64)")
    if q.numel() == 0:
        raise ValueError(f"q: empty tensor (shape {tuple(q.shape)})")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    B, spatial, Hq, D = q.shape[0], tuple(q.shape[1:-2]), q.shape[-2], q.shape[-1]
    dev = q.device
    if k.dim() != q.dim():
        raise ValueError(f"k: expected rank {q.dim()}, got {k.dim()}")
    Hkv = k.shape[-2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k: key/value heads ({Hkv}) must divide query heads ({Hq}) (GQA/MQA)")
    _check("k", k, (B, *spatial, Hkv, D), dev)
    if v.dim() != q.dim():
        raise ValueError(f"v: expected rank {q.dim()}, got {v.dim()}")
    Dv = v.shape[-1]
    _check("v", v, (B, *spatial, Hkv, Dv), dev)
    if Dv == 0:
        raise ValueError("v: empty value head dim")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {x.dtype} differs from q's {q.dtype}")
    for name, x, ref in (("tq", tq, q), ("tk", tk, k), ("tv", tv, v)):
        _check(name, x, ref.shape, dev)
    rpb_shape = (Hq, *params.rpb_shape)
    if rpb is not None:
        _check("rpb", rpb, rpb_shape, dev)
        if any(params.is_causal):
            raise ValueError("rpb: not defined on causal axes (is_causal=%s)" % (params.is_causal,))
    if trpb is not None:
        if rpb is None:
            raise ValueError("trpb: given without rpb")
        _check("trpb", trpb, rpb_shape, dev)
    _check("out", out, (B, *spatial, Hq, Dv), dev)
    if out is None:
        raise ValueError("out: expected the primal output, got None")
    if lse is None:
        raise ValueError("lse: expected the primal lse, got None")
    _check("lse", lse, (B, *spatial, Hq), dev)
    if dev.type != "cuda" and type(_na_jvp_kernel).__name__ != "InterpretedFunction":
        raise ValueError(f"q: needs CUDA tensors, got device {dev} (set TRITON_INTERPRET=1 before importing "
                         "ops.fused to run the kernel through Triton's interpreter on CPU)")

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    t_out = torch.empty(B, *spatial, Hq, Dv, dtype=q.dtype, device=dev)
    t_lse = torch.empty(B, *spatial, Hq, dtype=acc, device=dev)
    if tq is None and tk is None and tv is None and trpb is None:
        return t_out.zero_(), t_lse.zero_()

    N = params.num_tokens
    pad = 3 - rank  # run as 3-D: leading axes of length 1, kernel 1
    L = (1,) * pad + tuple(params.spatial)
    Ks = (1,) * pad + tuple(params.kernel_size)
    Ss = (1,) * pad + tuple(params.stride)
    Ds = (1,) * pad + tuple(params.dilation)
    Cs = (False,) * pad + tuple(bool(c) for c in params.is_causal)

    qv, *sq = _token_view(q, B, N)
    kv, *sk = _token_view(k, B, N)
    vv, *sv = _token_view(v, B, N)
    tqv, *stq = _token_view(tq, B, N) if tq is not None else (qv, 0, 0, 0)
    tkv, *stk = _token_view(tk, B, N) if tk is not None else (kv, 0, 0, 0)
    tvv, *stv = _token_view(tv, B, N) if tv is not None else (vv, 0, 0, 0)
    lse3 = lse.reshape(B, N, Hq)
    rpb_flat = rpb.reshape(Hq, -1).contiguous() if rpb is not None else qv
    trpb_flat = trpb.reshape(Hq, -1).contiguous() if trpb is not None else qv

    block_d = triton.next_power_of_2(D)
    block_dv = triton.next_power_of_2(Dv)
    # Rows per program and warps: about 256 elements of a [rows, head dim] tile per warp, so that the per-slot gathers,
    # the three [rows, Dv] sums and the per-row values stay in registers.
    width = max(block_d, block_dv)
    block_m = max(16, min(64, 1024 // width))
    num_warps = 8 if block_m * width >= 2048 else 4
    row_blocks = triton.cdiv(N, block_m)
    grid = (row_blocks * B * Hq,)
    _na_jvp_kernel[grid](
        qv, kv, vv, rpb_flat, tqv, tkv, tvv, trpb_flat, lse3, t_out, t_lse,
        *sq, *sk, *sv, *stq, *stk, *stv, *lse3.stride(),
        N, row_blocks, Hq, Hq // Hkv, *L, *Ks, *Ss, *Ds, D, Dv, float(scale),
        *Cs, rpb is not None, tq is not None, tk is not None, tv is not None, trpb is not None,
        block_m, block_d, block_dv, tl.float64 if acc == torch.float64 else tl.float32,
        num_warps=num_warps,
    )
    return t_out, t_lse
