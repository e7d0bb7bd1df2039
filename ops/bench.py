"""Op benchmark: NA backends beside dense SDPA on a standard problem set (one GPU, one run).

    python -m ops.bench                              # forward, bf16, every problem, fused/flex/naive
    python -m ops.bench --backward                   # forward + backward
    python -m ops.bench --jvp --backends fused,naive # forward-mode AD: torch.func.jvp in every input
    python -m ops.bench --problems nat-s1,2d-flux --backends fused,flex
    python -m ops.bench --custom "mine:2,8,64,64x64,13x13,1,1,0"   # name:B,H,D,spatial,K,stride,dilation,causal
    python -m ops.bench --out results/op_bench       # writes op_bench.csv and op_bench.json
    python -m ops.bench --rounds 5 --rep 300         # SDPA and the backends timed in 5 alternating rounds
    python -m ops.bench --backends fused,fused-portable   # the fused backend with and without its Hopper kernels

Per problem and backend: median ms (CUDA events through ``triton.testing.do_bench``, at least ``MIN_CALLS`` timed
calls; with ``--rounds N`` the median of N rounds that time SDPA and every backend in turn, so clock drift between
them does not bias E), effective TFLOP/s (forward 4*B*H*N*W*D with W = keys a query actually visits;
forward+backward counted as 3.5x the forward), speedup over SDPA (``scaled_dot_product_attention`` on
``[B, H, N, D]``, dense, same tokens, timed in the same run), efficiency ``E = speedup / (SDPA FLOPs / NA FLOPs)``
(= NA TFLOP/s over SDPA TFLOP/s), and GB/s for the bytes a perfect kernel must move (inputs read
once, outputs written once) with its fraction of the copy bandwidth measured in the same run;
problems whose FLOP/byte is under the measured matmul-rate / copy-bandwidth ratio are flagged
memory-bound.  ``--check`` compares the fused output on a sample of queries with a float64
gather reference built from ``ops.window`` (the dense oracle is too big for these sizes).
Imports only torch, triton and ``ops``.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from . import functional
from .spec import parse_problem_spec
from .timing import cuda_profile
from .window import NAParams, keys_per_query, neighbor_table


@dataclass
class BenchProblem:
    name: str
    batch: int
    heads: int
    dim: int
    spatial: tuple
    kernel_size: tuple
    stride: tuple = None
    dilation: tuple = None
    causal: tuple = None
    rpb: bool = False

    def __post_init__(self):
        rank = len(self.spatial)
        self.stride = self.stride or (1,) * rank
        self.dilation = self.dilation or (1,) * rank
        self.causal = self.causal or (False,) * rank

    @property
    def params(self) -> NAParams:
        return functional.make_params(self.spatial, self.kernel_size, self.stride, self.dilation, self.causal)

    def random_inputs(self, device, dtype, generator=None, requires_grad=False):
        """q, k, v ``[B, *spatial, H, D]`` and rpb (float32, scaled by 0.5; None without RPB), standard normal."""
        shape = (self.batch, *self.spatial, self.heads, self.dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=generator, requires_grad=requires_grad)
                   for _ in range(3))
        rpb = None
        if self.rpb:
            rpb = torch.randn(self.heads, *self.params.rpb_shape, device=device, dtype=torch.float32,
                              generator=generator) * 0.5
            rpb.requires_grad_(requires_grad)
        return q, k, v, rpb

    def attention(self, q, k, v, rpb, backend: str):
        """The problem's neighborhood attention of these inputs on ``backend``."""
        fn = {1: functional.na1d, 2: functional.na2d, 3: functional.na3d}[len(self.spatial)]
        return fn(q, k, v, self.kernel_size, self.stride, self.dilation, self.causal, rpb=rpb, backend=backend)


def standard_problems() -> list[BenchProblem]:
    """The standard problem set (table in ``docs/fused.md``): long 1-D / 2-D / 3-D windows with their stride
    variants, a causal 3-D problem, and the NA shapes of NAT-Tiny, DiNAT-Tiny and NAT-Small at 224 px, batch 128
    (with RPB, as the models train)."""
    P = BenchProblem
    return [
        P("1d-32k", 1, 16, 128, (32768,), (2048,)),
        P("1d-32k-s256", 1, 16, 128, (32768,), (2048,), (256,)),
        P("2d-flux", 1, 24, 128, (256, 256), (80, 80)),
        P("2d-flux-s16", 1, 24, 128, (256, 256), (80, 80), (16, 16)),
        P("3d-hunyuan", 1, 24, 128, (30, 48, 80), (18, 24, 24)),
        P("3d-hunyuan-s16x8x8", 1, 24, 128, (30, 48, 80), (18, 24, 24), (16, 8, 8)),
        P("3d-causal", 2, 16, 64, (16, 32, 32), (5, 7, 7), causal=(True, False, False)),
        P("nat-s1", 128, 2, 32, (56, 56), (7, 7)),
        P("nat-s1-rpb", 128, 2, 32, (56, 56), (7, 7), rpb=True),
        P("dinat-s1", 128, 2, 32, (56, 56), (7, 7), dilation=(8, 8)),
        P("nat-s3", 128, 8, 32, (14, 14), (7, 7)),
        # NAT-Tiny's four stages as trained (batch 128, 224 px, head dim 32, 7x7, trainable RPB)
        P("nat-tiny-1", 128, 2, 32, (56, 56), (7, 7), rpb=True),
        P("nat-tiny-2", 128, 4, 32, (28, 28), (7, 7), rpb=True),
        P("nat-tiny-3", 128, 8, 32, (14, 14), (7, 7), rpb=True),
        P("nat-tiny-4", 128, 16, 32, (7, 7), (7, 7), rpb=True),
        # DiNAT-Tiny's dilated blocks (every other block; the others are NAT-Tiny's): dilation 224 / 4 / 2**i // 7
        P("dinat-tiny-1", 128, 2, 32, (56, 56), (7, 7), dilation=(8, 8), rpb=True),
        P("dinat-tiny-2", 128, 4, 32, (28, 28), (7, 7), dilation=(4, 4), rpb=True),
        P("dinat-tiny-3", 128, 8, 32, (14, 14), (7, 7), dilation=(2, 2), rpb=True),
        # NAT-Small's stages: NAT-Tiny's maps with 1.5x the heads (head dim 32)
        P("nat-small-1", 128, 3, 32, (56, 56), (7, 7), rpb=True),
        P("nat-small-2", 128, 6, 32, (28, 28), (7, 7), rpb=True),
        P("nat-small-3", 128, 12, 32, (14, 14), (7, 7), rpb=True),
        P("nat-small-4", 128, 24, 32, (7, 7), (7, 7), rpb=True),
    ]


def parse_custom(text: str) -> BenchProblem:
    """``name:B,H,D,spatial,K,stride,dilation,causal`` with per-axis values joined by 'x' (``ops.spec``)."""
    name, _, spec = text.partition(":")
    try:
        f = parse_problem_spec(spec)
    except ValueError as err:
        raise ValueError(f"--custom: expected name:B,H,D,spatial,K[,stride,dilation,causal[,rpb]], got {text!r}") from err
    return BenchProblem(name, f["batch"], f["heads"], f["dim"], f["spatial"], f["kernel_size"], f["stride"],
                        f["dilation"], f["causal"], f["rpb"])


# ------------------------------------------------------------------------------------------------
@dataclass
class Row:
    problem: str
    backend: str
    mode: str
    ms: float | None = None
    tflops: float | None = None
    speedup_vs_sdpa: float | None = None
    efficiency: float | None = None
    gbps: float | None = None
    bw_fraction: float | None = None
    memory_bound: bool | None = None
    check_rel_err: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def round_order(names: list, r: int) -> list:
    """``names`` in the order round ``r`` times them: from the r-th on, wrapping."""
    return names[r % len(names):] + names[:r % len(names)]


def time_alternating(fns: dict, rounds: int, bench) -> tuple[dict, dict]:
    """``({name: [ms per round]}, {name: error})``: every function timed once per round, each round starting one
    function later than the one before (round r runs them from the r-th on, wrapping); one that raises is reported
    and left out of the later rounds.

    SDPA's own time moves by several percent between processes on one GPU, so a baseline timed once, before
    the backends, carries the clock's drift into every speedup and E; alternating rounds spread it over all of them
    and the medians over the rounds drop the outliers.  The place in a round matters too: two backends running the
    same kernel, timed second and third after SDPA's long dense run, differed by 7-13% (H100, 1-D problems) in
    favour of the one timed right after SDPA, every round; rotating the order gives every function every place."""
    times, errors = {name: [] for name in fns}, {}
    for r in range(rounds):
        for name in round_order(list(fns), r):
            fn = fns[name]
            if name in errors:
                continue
            try:
                times[name].append(bench(fn))
            except Exception as err:  # noqa: BLE001  (e.g. out of memory: report it, time the others)
                errors[name] = err
    return times, errors


# Timed calls per measurement, at least.  ``do_bench`` times as many calls as fit in ``rep`` ms, so a 100 ms budget
# left a 37 ms call two samples and a 190 ms call one: eight such measurements of one 37 ms step ranged over
# 35.5-40.5 ms, where 20 calls back to back stayed within 37.2-37.5 (H100, 2d-flux-s16 forward + backward).
MIN_CALLS = 10


def _bench(fn, warmup_ms, rep_ms):
    """Median ms of ``fn`` by ``do_bench`` (L2 flushed before each call), over ``rep_ms`` of calls or ``MIN_CALLS``
    calls, whichever is more."""
    import triton.testing

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(rep_ms, MIN_CALLS * start.elapsed_time(end))
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep, return_mode="median")


def measure_ceilings(device) -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate on this device."""
    n = 1 << 28  # 512 MiB of bf16
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), 25, 200)
    copy_gbps = 2 * src.numel() * 2 / ms / 1e6
    del src, dst
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = _bench(lambda: a @ b, 25, 200)
    return {"copy_GBps": copy_gbps, "matmul_bf16_TFLOPs": 2 * 8192**3 / ms / 1e9}


def _naive_too_big(p: BenchProblem, backward: bool) -> str | None:
    # naive gathers every window in float32: B * N * W * Hkv * D * 4 bytes for keys and values each
    gathered = 2 * p.batch * p.params.num_tokens * p.params.window_size * p.heads * p.dim * 4
    limit = 2.5e10
    if gathered > limit:
        return f"skipped: naive would gather {gathered / 1e9:.0f} GB"
    return None


def _reference_sample(q, k, v, rpb, params, scale, samples, gen):
    """float64 output of a random sample of queries (gather over ops.window's neighbor table)."""
    b, n, h, d = q.shape[0], params.num_tokens, q.shape[-2], q.shape[-1]
    idx = torch.randint(0, n, (samples,), generator=gen, device="cpu").to(q.device)
    key, valid, rel = neighbor_table(params, queries=idx)
    qf = q.reshape(b, n, h, d)[:, idx].double()  # [B, S, H, D]
    kf = k.reshape(b, n, -1, d)
    vf = v.reshape(b, n, -1, v.shape[-1])
    group = h // kf.shape[2]
    out = torch.empty(b, samples, h, v.shape[-1], dtype=torch.float64, device=q.device)
    for s in range(samples):
        ks = kf[:, key[s]].double().repeat_interleave(group, dim=2)  # [B, W, H, D]
        vs = vf[:, key[s]].double().repeat_interleave(group, dim=2)
        logits = torch.einsum("bhd,bwhd->bhw", qf[:, s], ks) * scale
        if rpb is not None:
            logits = logits + rpb.reshape(h, -1)[:, rel[s]].double()[None]
        logits = logits.masked_fill(~valid[s][None, None], float("-inf"))
        out[:, s] = torch.einsum("bhw,bwhd->bhd", torch.softmax(logits, -1), vs)
    return idx, out


# the fused backend with its Hopper kernels turned off (``ops/fused/hopper.py``, ``hopper_dq.py``,
# ``hopper_dkdv.py``), to time the two side by side
PORTABLE = "fused-portable"


def _backend_call(p: BenchProblem, name: str, q, k, v, rpb, d_out=None, tangents=None):
    """``(call, fn)`` for one backend on its own leaves of the inputs: ``call()`` returns the attention output, ``fn()``
    is what gets timed (``call`` and, given ``d_out``, its backward; given ``tangents``, ``torch.func.jvp`` of it in
    every input).  Built per backend in a function of its own, since the timing rounds run after every backend's
    first call."""
    if tangents is not None:
        leaves = (q, k, v) + ((rpb,) if rpb is not None else ())
        backend = "fused" if name == PORTABLE else name

        def attend(q, k, v, rpb=None):
            return p.attention(q, k, v, rpb, backend)

        def jvp():
            return torch.func.jvp(attend, leaves, tangents[: len(leaves)])

        return (lambda: attend(*leaves)), jvp
    if d_out is not None:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        rpb = rpb.detach().requires_grad_(True) if rpb is not None else None

    def call():
        return p.attention(q, k, v, rpb, "fused" if name == PORTABLE else name)

    leaves = (q, k, v) + ((rpb,) if rpb is not None else ())

    def timed():
        if d_out is None:
            return call()
        # gradients returned, not accumulated into .grad (a training step's zeroed grads add nothing)
        return torch.autograd.grad(call(), leaves, d_out)

    if name != PORTABLE:
        return call, timed

    def portable(fn):  # the Hopper kernels stay off for the forward and the backward (planned inside the call)
        def run():
            from .fused import hopper
            with hopper.disabled():
                return fn()
        return run

    return portable(call), portable(timed)


DEVICE = "cuda"  # the benchmark's device (tests run ``run_problem`` on the CPU with a stand-in timer)


def run_problem(p: BenchProblem, backends, backward, dtype, ceilings, args, log, jvp: bool = False) -> list[Row]:
    """``jvp``: time ``torch.func.jvp`` in every input (q, k, v, rpb) instead of the forward; counted as 3x the
    forward's FLOPs (per query-key pair the logits and their tangent take three dot products, the output and its
    tangent three weighted sums, against one and one)."""
    device = torch.device(DEVICE)
    params = p.params
    n = params.num_tokens
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, rpb = p.random_inputs(device, dtype, gen)
    d_out = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    tangents = None
    if jvp:
        backward = False
        tangents = tuple(torch.randn(t.shape, device=device, dtype=t.dtype, generator=gen)
                         for t in (q, k, v, rpb) if t is not None)
    mode = "jvp" if jvp else "fwd+bwd" if backward else "fwd"
    factor = 3.0 if jvp else 3.5 if backward else 1.0
    w = keys_per_query(params)
    na_flops = factor * 4 * p.batch * p.heads * n * w * p.dim
    sdpa_flops = factor * 4 * p.batch * p.heads * n * n * p.dim
    elem = torch.finfo(dtype).bits // 8
    tensor_bytes = p.batch * n * p.heads * p.dim * elem
    # forward: read q, k, v, write out (+ lse fp32); backward adds read q, k, v, out, dout, lse, write dq, dk, dv
    lse_bytes = p.batch * n * p.heads * 4
    min_bytes = 4 * tensor_bytes + lse_bytes + (8 * tensor_bytes + lse_bytes if backward else 0)
    balance = ceilings["matmul_bf16_TFLOPs"] * 1e12 / (ceilings["copy_GBps"] * 1e9)
    memory_bound = na_flops / min_bytes < balance
    rows = []

    # Dense SDPA baseline on [B, H, N, D].
    sq, sk, sv = (t.reshape(p.batch, n, p.heads, p.dim).transpose(1, 2).contiguous() for t in (q, k, v))
    sdo = d_out.reshape(p.batch, n, p.heads, p.dim).transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if jvp:  # dense forward mode has the math kernel only (the fused SDPA kernels define no tangent)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stangents = tuple(t.reshape(p.batch, n, p.heads, p.dim).transpose(1, 2).contiguous() for t in tangents[:3])

        def sdpa_fn():
            with sdpa_kernel([SDPBackend.MATH]):
                torch.func.jvp(sdpa, (sq, sk, sv), stangents)
    elif backward:
        for t in (sq, sk, sv):
            t.requires_grad_(True)

        def sdpa_fn():
            torch.autograd.grad(sdpa(sq, sk, sv), (sq, sk, sv), sdo)
    else:
        def sdpa_fn():
            sdpa(sq, sk, sv)
    sdpa_fn()  # warm-up and library selection outside the timing
    sdpa_row = Row(p.name, "sdpa", mode, None, None, 1.0, None, None, None, None, note="dense, same tokens")
    rows.append(sdpa_row)
    timed = {"sdpa": sdpa_fn}  # what runs (and how) first; timed afterwards in alternating rounds

    for name in backends:
        row = Row(p.name, name, mode)
        rows.append(row)
        if name == "naive":
            reason = _naive_too_big(p, backward)
            if reason:
                row.note = reason
                log(f"  {name:10s} {reason}")
                continue
        call, fn = _backend_call(p, name, q, k, v, rpb, d_out if backward else None, tangents)
        t0 = time.time()
        seen = _fused_choices() if name == "fused" else {}
        try:
            fn()  # first call: compile / autotune outside the timing
            if device.type == "cuda":
                torch.cuda.synchronize()
            first = time.time() - t0
            if name == "fused":  # the tiles each kernel ran with (tuned or default), for the record
                row.extra["launches"] = {key[0]: launch for key, launch in _fused_choices().items() if key not in seen}
        except Exception as err:  # a backend that cannot run this problem: report, keep going
            row.note = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            log(f"  {name:10s} {row.note}")
            torch.cuda.empty_cache()
            continue
        timed[name] = fn
        row.extra["first_call_s"] = round(first, 2)
        if name == "fused" and args.check and not backward:
            with torch.no_grad():
                out = call()
                scale = p.dim**-0.5
                idx, ref = _reference_sample(q, k, v, rpb, params, scale, args.check, torch.Generator().manual_seed(1))
                got = out.reshape(p.batch, n, p.heads, p.dim)[:, idx].double()
                row.check_rel_err = ((got - ref).abs().max() / ref.abs().max()).item()

    t0 = time.time()
    times, errors = time_alternating(timed, args.rounds, lambda fn: _bench(fn, args.warmup, args.rep))
    if "sdpa" in errors:
        raise errors["sdpa"]
    sdpa_ms = statistics.median(times["sdpa"])
    sdpa_row.ms, sdpa_row.tflops = sdpa_ms, sdpa_flops / sdpa_ms / 1e9
    log(f"  sdpa       {sdpa_ms:9.3f} ms  ({args.rounds} round(s) of every backend: {time.time() - t0:.1f}s)")
    for row in rows:
        if row.backend not in timed or row.backend == "sdpa":
            continue
        if row.backend in errors:
            err = errors[row.backend]
            row.note = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            log(f"  {row.backend:10s} {row.note}")
            continue
        ms = row.ms = statistics.median(times[row.backend])
        row.tflops = na_flops / ms / 1e9
        row.speedup_vs_sdpa = sdpa_ms / ms
        row.efficiency = row.speedup_vs_sdpa * na_flops / sdpa_flops
        row.gbps = min_bytes / ms / 1e6
        row.bw_fraction = row.gbps / ceilings["copy_GBps"]
        row.memory_bound = memory_bound
        log(f"  {row.backend:10s} {ms:9.3f} ms  {row.tflops:7.1f} TFLOP/s  x{row.speedup_vs_sdpa:6.2f} vs SDPA  "
            f"E={row.efficiency:5.2f}  {row.gbps:7.0f} GB/s ({100 * row.bw_fraction:4.1f}% copy)"
            + (f"  check {row.check_rel_err:.1e}" if row.check_rel_err is not None else "")
            + f"  (first call {row.extra['first_call_s']:.1f}s)")
    if args.rounds > 1:
        for row in rows:
            if times.get(row.backend):
                row.extra["round_ms"] = [round(ms, 4) for ms in times[row.backend]]
    return rows


def kernel_floor_bytes(p: BenchProblem, elem: int) -> dict:
    """Bytes each fused kernel must move at least (its inputs read once, its outputs written once), by kernel
    name: T = one [B, N, H, D] tensor, L = one float32 value per query row (lse, delta), S = the float32 window-layout
    dS that dQ adds up over the batch (one value per token, head and window slot; it stays in L2, so dQ's floor
    leaves it out, and the dRPB kernel reads it once).  The bias-tile kernels (RPB per box, shared by the batch)
and the dRPB reduction of dQ's tile-layout dS are named with no floor: their few microseconds are bound by their
launch."""
    n = p.params.num_tokens
    rows = p.batch * n * p.heads
    t, lse = rows * p.dim * elem, rows * 4
    ds = n * p.heads * keys_per_query(p.params) * 4 if p.rpb else 0
    return {
        "na_fwd_kernel": 4 * t,  # q, k, v in, out (the lse store is skipped in inference)
        "na_bwd_dq_kernel": 6 * t + 2 * lse,  # q, k, v, out, dO in, dq out; lse in, delta out
        "na_bwd_dkdv_kernel": 6 * t + 2 * lse,
        "na_drpb_window_kernel": ds,
        "na_bias_tiles_kernel": 0,
        "na_bias_tiles_inverse_kernel": 0,
        "na_drpb_tiles_kernel": 0,
    }


def kernel_breakdown(p: BenchProblem, fn, copy_gbps: float, elem: int, calls: int = 5) -> list[dict]:
    """Device time per kernel of one ``fn()`` (median-free: the mean over ``calls`` profiled calls) beside the
    time its floor bytes take at the measured copy bandwidth.  Kernels not named in ``kernel_floor_bytes`` (torch's
    own: buffer zeroing, casts) are grouped as "other"."""
    from torch.autograd import DeviceType

    fn()
    torch.cuda.synchronize()
    with cuda_profile() as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    floors = kernel_floor_bytes(p, elem)
    spent: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.name if event.name in floors else "other"
        spent[name] = spent.get(name, 0.0) + event.self_device_time_total / 1e3 / calls
    out = []
    for name, ms in spent.items():
        floor_ms = floors.get(name, 0) / copy_gbps / 1e6
        out.append(dict(problem=p.name, kernel=name, ms=ms, floor_ms=floor_ms,
                        x_floor=ms / floor_ms if floor_ms else None))
    return out


def format_kernel_table(entries: list[dict]) -> str:
    lines = ["| problem | kernel | ms | floor ms | x floor |", "|---|---|---|---|---|"]
    for e in entries:
        x = "" if e["x_floor"] is None else f"{e['x_floor']:.2f}"
        lines.append(f"| {e['problem']} | {e['kernel']} | {e['ms']:.4f} | {e['floor_ms']:.4f} | {x} |")
    return "\n".join(lines)


def format_table(rows: list[Row]) -> str:
    head = "| problem | mode | backend | ms | TFLOP/s | x SDPA | E | GB/s | % copy BW | note |"
    lines = [head, "|" + "---|" * 10]
    f = lambda x, fmt: "" if x is None else format(x, fmt)  # noqa: E731
    for r in rows:
        note = r.note + (" (memory-bound)" if r.memory_bound else "")
        if r.check_rel_err is not None:
            note += f" check {r.check_rel_err:.1e}"
        lines.append(f"| {r.problem} | {r.mode} | {r.backend} | {f(r.ms, '.3f')} | {f(r.tflops, '.1f')} | "
                     f"{f(r.speedup_vs_sdpa, '.2f')} | {f(r.efficiency, '.2f')} | {f(r.gbps, '.0f')} | "
                     f"{f(None if r.bw_fraction is None else 100 * r.bw_fraction, '.1f')} | {note.strip()} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ops.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", default="all", help="comma-separated names from the standard set, or 'all'")
    ap.add_argument("--custom", action="append", default=[], help="name:B,H,D,spatial,K[,stride,dilation,causal,rpb]")
    ap.add_argument("--backends", default="fused,flex,naive")
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    ap.add_argument("--jvp", action="store_true",
                    help="time torch.func.jvp in every input (forward mode; fused: its tangent kernel, the other "
                         "backends: the plain-op reference)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--autotune", action="store_true", help="tune fused kernels (cached on disk) before timing")
    ap.add_argument("--check", type=int, default=0, help="check fused on this many sampled queries (fwd only)")
    ap.add_argument("--warmup", type=float, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=float, default=100, help="do_bench repetition budget (ms; at least MIN_CALLS calls)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time SDPA and every backend this many times in alternating rounds; medians reported")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile the fused backend's kernels one by one against the bytes each must move")
    ap.add_argument("--out", default=None, help="path prefix for .csv / .json results")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.jvp and (args.backward or args.kernels or args.check):
        ap.error("--jvp times forward mode alone: leave out --backward, --kernels and --check")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.autotune:
        from .fused import autotune

        autotune.set_autotune(True)
    problems = standard_problems()
    if args.problems != "all":
        wanted = args.problems.split(",") if args.problems else []
        known = {p.name: p for p in problems}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            ap.error(f"unknown problems {unknown}; choose from {sorted(known)}")
        problems = [known[w] for w in wanted]
    problems += [parse_custom(c) for c in args.custom]
    backends = [b for b in args.backends.split(",") if b]

    def log(msg):
        print(msg, flush=True)

    env = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": __import__("triton").__version__, "dtype": args.dtype,
        "command": "python -m ops.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "timing": f"do_bench median, L2 flushed, warmup {args.warmup} ms, {args.rep} ms or {MIN_CALLS} calls at least",
    }
    env.update(measure_ceilings(torch.device("cuda")))
    log(json.dumps(env))
    rows, kernels = [], []
    for i, p in enumerate(problems, 1):  # "[i/n]": how far the run is (ops imports no progress-bar library)
        log(f"[{i}/{len(problems)}] {p.name}: B={p.batch} H={p.heads} D={p.dim} spatial={p.spatial} K={p.kernel_size} s={p.stride} "
            f"d={p.dilation} causal={p.causal} rpb={p.rpb}")
        rows += run_problem(p, backends, args.backward, dtype, env, args, log, jvp=args.jvp)
        if args.kernels:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, rpb = p.random_inputs(torch.device("cuda"), dtype, gen)
            d_out = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen) if args.backward else None
            _, fn = _backend_call(p, "fused", q, k, v, rpb, d_out)
            kernels += kernel_breakdown(p, fn, env["copy_GBps"], torch.finfo(dtype).bits // 8)
        torch.cuda.empty_cache()
        if args.out:  # after every problem, so a run cut short still leaves its results
            write_results(args.out, env, rows)
    print(format_table(rows))
    if kernels:
        print()
        print(format_kernel_table(kernels))
    return rows


def _fused_choices() -> dict:
    """The fused backend's tile configuration per kernel and plan decided so far in this process."""
    from .fused import decide

    choices = {}
    for key, plan in decide._PLANS.items():
        configs = {"fwd": plan.config} if key[0] == "forward" else {"dq": plan.dq_config, "dkdv": plan.dkdv_config}
        choices.update({(kernel, *key[1:]): asdict(config) for kernel, config in configs.items() if config})
    return choices


def write_results(prefix: str, env: dict, rows: list[Row]) -> None:
    with open(prefix + ".json", "w") as fh:
        json.dump({"env": env, "rows": [asdict(r) for r in rows]}, fh, indent=1)
    with open(prefix + ".csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[k for k in asdict(rows[0]) if k != "extra"])
        writer.writeheader()
        for r in rows:
            writer.writerow({k: v for k, v in asdict(r).items() if k != "extra"})


if __name__ == "__main__":
    main()
