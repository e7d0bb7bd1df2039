"""How fast can a Triton attention core loop run on this GPU, with the fused kernel's memory layout?

A question behind issues 3/4: the fused NA forward reaches only ~0.6-0.7 of SDPA per FLOP even where
no mask is needed (the stride variants, E target 0.8).  This probe times a stripped core loop -- every
query tile attends to one aligned, contiguous range of ``W`` keys, no masks, no RPB, heads-last
``[B, N, H, D]`` tensors -- in three load styles:

* ``ptr``: pointer tensors, as ``ops/fused/kernels.py`` loads today;
* ``tma``: host tensor descriptors over the ``[B * N, H * D]`` view (Hopper's bulk copy engine);
* ``tma_ws``: the same with ``tl.range(..., warp_specialize=True)`` (where the Triton build supports it).

Each variant is checked against SDPA on the same key ranges (relative error) and timed with
``triton.testing.do_bench`` (median); SDPA's dense rate on the full sequence is the E baseline.

    python benchmarks/core_loop_probe.py            # GPU: table of TFLOP/s and E per variant/config
    TRITON_INTERPRET=1 python benchmarks/core_loop_probe.py --check   # tiny correctness run on the CPU
"""
from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: only the pointer variant
    TensorDescriptor = None


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale):
    s = tl.dot(q, tl.trans(k))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _key_range(pid_m, N, W, BLOCK_M: tl.constexpr):
    """An aligned range of W keys around the query tile (clamped into the sequence)."""
    lo = pid_m * BLOCK_M + BLOCK_M // 2 - W // 2
    return tl.minimum(tl.maximum(lo, 0), N - W)


@triton.jit
def probe_ptr_kernel(Q, K, V, O, N, H, W, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    row_stride = H * HEAD_DIM
    base = b.to(tl.int64) * N * row_stride + h * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * row_stride + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo = _key_range(pid_m, N, W, BLOCK_M)
    for start in range(lo, lo + W, BLOCK_N):
        rows = start + offs_n
        k = tl.load(K + base + rows[:, None] * row_stride + offs_d[None, :])
        v = tl.load(V + base + rows[:, None] * row_stride + offs_d[None, :])
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale)
    out = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * row_stride + offs_d[None, :], out.to(O.dtype.element_ty))


@triton.jit
def probe_tma_kernel(desc_q, desc_k, desc_v, desc_o, N, H, W, qk_scale, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    row0 = b * N
    col = h * HEAD_DIM
    q = desc_q.load([row0 + pid_m * BLOCK_M, col])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo = _key_range(pid_m, N, W, BLOCK_M)
    for start in tl.range(lo, lo + W, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([row0 + start, col])
        v = desc_v.load([row0 + start, col])
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale)
    out = acc / l_i[:, None]
    desc_o.store([row0 + pid_m * BLOCK_M, col], out.to(desc_o.dtype))


def run_variant(variant, q, k, v, W, cfg):
    bm, bn, warps, stages = cfg
    B, N, H, D = q.shape
    o = torch.full_like(q, float("nan"))
    qk_scale = D ** -0.5 * 1.4426950408889634
    grid = (N // bm, B * H)
    if variant == "ptr":
        return o, lambda: probe_ptr_kernel[grid](q, k, v, o, N, H, W, qk_scale, D, bm, bn,
                                                  num_warps=warps, num_stages=stages)
    flat = [t.view(B * N, H * D) for t in (q, k, v, o)]
    dq, dk, dv, do = (TensorDescriptor.from_tensor(t, [bm if i in (0, 3) else bn, D]) for i, t in enumerate(flat))
    ws = variant == "tma_ws"
    return o, lambda: probe_tma_kernel[grid](dq, dk, dv, do, N, H, W, qk_scale, D, bm, bn, ws,
                                              num_warps=warps, num_stages=stages)


def reference(q, k, v, W, bm):
    """SDPA per query tile over its key range (float32)."""
    B, N, H, D = q.shape
    out = torch.empty_like(q, dtype=torch.float32)
    for m in range(N // bm):
        lo = min(max(m * bm + bm // 2 - W // 2, 0), N - W)
        qt = q[:, m * bm:(m + 1) * bm].transpose(1, 2).float()
        kt = k[:, lo:lo + W].transpose(1, 2).float()
        vt = v[:, lo:lo + W].transpose(1, 2).float()
        out[:, m * bm:(m + 1) * bm] = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="tiny correctness run (CPU interpreter)")
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.check:
        device, dtype, B, N, H, D, W = "cpu", torch.float16, 1, 128, 2, 16, 64
        configs = [(32, 16, 4, 1)]
        variants = ["ptr"] + (["tma"] if TensorDescriptor is not None else [])
    else:
        device, dtype, B, N, H, D, W = "cuda", torch.bfloat16, 1, args.n, args.heads, 128, args.window
        configs = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2),
                   (128, 128, 8, 2), (128, 128, 8, 3)]
        variants = ["ptr", "tma", "tma_ws"]
    q, k, v = (torch.randn(B, N, H, D, device=device, dtype=dtype) for _ in range(3))
    flops = 4 * B * H * N * W * D
    rows = []
    if not args.check:
        qd, kd, vd = (t.transpose(1, 2) for t in (q, k, v))
        sdpa_ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd),
                                          warmup=50, rep=300, return_mode="median")
        sdpa_tf = 4 * B * H * N * N * D / sdpa_ms / 1e9
        print(f"SDPA dense N={N}: {sdpa_ms:.3f} ms, {sdpa_tf:.0f} TFLOP/s", flush=True)
    refs = {}
    for cfg in configs:
        for variant in variants:
            try:
                o, fn = run_variant(variant, q, k, v, W, cfg)
                fn()
                if cfg[0] not in refs:
                    refs[cfg[0]] = reference(q, k, v, W, cfg[0])
                ref = refs[cfg[0]]
                err = ((o.float() - ref).norm() / ref.norm()).item()
                if args.check:
                    ms = float("nan")
                else:
                    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                tf = flops / ms / 1e9
                e = tf / sdpa_tf if not args.check else float("nan")
                rows.append((variant, cfg, err, ms, tf, e))
                print(f"{variant:7s} {cfg}: err {err:.2e}  {ms:.3f} ms  {tf:.0f} TFLOP/s  E {e:.2f}", flush=True)
            except Exception as exc:  # noqa: BLE001  (a config or feature this Triton lacks)
                print(f"{variant:7s} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    bad = [r for r in rows if not (r[2] < 2e-2)]
    if bad:
        raise SystemExit(f"wrong results: {bad}")
    print("| variant | BLOCK_M x BLOCK_N, warps, stages | ms | TFLOP/s | E |")
    print("|---|---|---|---|---|")
    for variant, cfg, err, ms, tf, e in rows:
        print(f"| {variant} | {cfg[0]}x{cfg[1]}, {cfg[2]}, {cfg[3]} | {ms:.3f} | {tf:.0f} | {e:.2f} |")


if __name__ == "__main__":
    main()
