"""LayerNorm micro-benchmark on CUDA: torch (F.layer_norm + cast to bf16, what autocast does) vs the
Triton LayerNorm, NAT-Tiny shapes at batch 128, bf16 autocast, float32 residual input with grad.

    python benchmarks/layer_norm_bench.py            # the table
    python benchmarks/layer_norm_bench.py --sweep    # also a few backward launch shapes
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import ops.layer_norm as lnmod

SHAPES = [(128, 56, 56, 64), (128, 28, 28, 128), (128, 14, 14, 256), (128, 7, 7, 512)]
WARMUP, REPS = 10, 50


def time_ms(fn):
    """GPU time per call: a sleep kernel holds the stream while all reps are queued, so the kernels run
    back to back and the events time the GPU, not Python's launch overhead."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPS)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def wall_ms(fn):
    """Host time per call with the queue drained each time (launch overhead included)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_case(shape):
    C = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=torch.float32).requires_grad_()
    weight = (1 + 0.1 * torch.randn(C, device="cuda")).requires_grad_()
    bias = (0.1 * torch.randn(C, device="cuda")).requires_grad_()
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return x, weight, bias, dy


def torch_ln(x, weight, bias):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return F.layer_norm(x, x.shape[-1:], weight, bias, 1e-5).to(torch.bfloat16)


def triton_ln(x, weight, bias):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return lnmod.layer_norm(x, x.shape[-1:], weight, bias, 1e-5)


def fwd_bwd(ln, x, weight, bias, dy):
    return torch.autograd.grad(ln(x, weight, bias), (x, weight, bias), dy)


def row(shape):
    x, weight, bias, dy = make_case(shape)
    n = x.numel()
    with torch.no_grad():
        t_fwd = time_ms(lambda: torch_ln(x, weight, bias))
        k_fwd = time_ms(lambda: triton_ln(x, weight, bias))
    t_all = time_ms(lambda: fwd_bwd(torch_ln, x, weight, bias, dy))
    k_all = time_ms(lambda: fwd_bwd(triton_ln, x, weight, bias, dy))

    wall = (wall_ms(lambda: fwd_bwd(torch_ln, x, weight, bias, dy)),
            wall_ms(lambda: fwd_bwd(triton_ln, x, weight, bias, dy)))
    y_ref, y = torch_ln(x, weight, bias), triton_ln(x, weight, bias)
    assert y.dtype == torch.bfloat16
    grads_ref, grads = fwd_bwd(torch_ln, x, weight, bias, dy), fwd_bwd(triton_ln, x, weight, bias, dy)
    errors = [(y.float() - y_ref.float()).abs().max().item()]
    errors += [((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, grads_ref)]
    # bytes the Triton path must move: fwd x fp32 in + y bf16 out; bwd x fp32 + dy bf16 in, dx fp32 out
    fwd_gbs = n * 6 / k_fwd / 1e6
    all_gbs = n * 16 / k_all / 1e6
    print(f"{str(list(shape)):>20} | {t_fwd:7.3f} {k_fwd:7.3f} {t_fwd / k_fwd:5.2f}x {fwd_gbs:6.0f} | "
          f"{t_all:7.3f} {k_all:7.3f} {t_all / k_all:5.2f}x {all_gbs:6.0f} | "
          + " ".join(f"{e:.1e}" for e in errors) + f" | host f+b {wall[0]:.3f} {wall[1]:.3f}")
    return t_fwd, k_fwd, t_all, k_all


def sweep(shape):
    """GPU time of the Triton backward kernel alone for a few (tile elements, warps, programs per SM)."""
    x, weight, bias, dy = make_case(shape)
    rows = x.detach().reshape(-1, shape[-1])
    dyr = dy.reshape(rows.shape)
    _, stats = lnmod.layer_norm_forward(rows, weight, bias, 1e-5, torch.bfloat16)
    real_num_warps, real_per_sm = lnmod._num_warps, lnmod.BACKWARD_PROGRAMS_PER_SM
    cells = [("default", time_ms(lambda: lnmod.layer_norm_backward(dyr, rows, weight, stats)))]
    for tile, warps, per_sm in ((1024, 2, 8), (2048, 2, 8), (2048, 4, 16), (1024, 2, 16)):
        block_rows = max(1, tile // triton_next_pow2(shape[-1]))
        lnmod._num_warps = lambda *_: warps
        lnmod.BACKWARD_PROGRAMS_PER_SM = per_sm
        cells.append((f"{tile}/{warps}w/{per_sm}",
                      time_ms(lambda: lnmod.layer_norm_backward(dyr, rows, weight, stats, block_rows=block_rows))))
    lnmod._num_warps, lnmod.BACKWARD_PROGRAMS_PER_SM = real_num_warps, real_per_sm
    print(f"{str(list(shape)):>20} | bwd " + ", ".join(f"{name} {ms:.4f}" for name, ms in cells))


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("times in ms (median of", REPS, "); torch = F.layer_norm under bf16 autocast + .to(bf16); "
          "GB/s = bytes the Triton path must move / its time")
    print(f"{'shape':>20} | {'fwd:torch':>7} {'triton':>7} {'speed':>6} {'GB/s':>6} | "
          f"{'f+b:torch':>7} {'triton':>7} {'speed':>6} {'GB/s':>6} | "
          "max err y(abs) dx dw db (rel) | host ms f+b torch triton")
    totals = [0.0] * 4
    for shape in SHAPES:
        totals = [a + b for a, b in zip(totals, row(shape))]
    print(f"{'sum':>20} | {totals[0]:7.3f} {totals[1]:7.3f} {totals[0] / totals[1]:5.2f}x {'':>6} | "
          f"{totals[2]:7.3f} {totals[3]:7.3f} {totals[2] / totals[3]:5.2f}x")
    if "--sweep" in sys.argv:
        for shape in SHAPES + [(128 * 49, 1024), (2048, 4096), (512, 8192)]:
            sweep(shape)


if __name__ == "__main__":
    main()
