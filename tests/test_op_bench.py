"""``ops.bench``'s timing rounds and per-backend calls (the GPU parts run on the device; these need none)."""
import pytest
import torch

from ops import bench


def test_time_alternating_interleaves_rounds_and_reports_failures():
    """Each round times every function once, starting one function later than the round before (so clock drift
    and the place in a round spread over all of them); one that raises is reported once and left out of the later
    rounds."""
    order = []

    def timed(name, ms):
        def fn():
            order.append(name)
            if name == "broken" and order.count("broken") == 2:
                raise RuntimeError("out of memory")
            return ms
        return fn

    fns = {"sdpa": timed("sdpa", 4.0), "fused": timed("fused", 0.5), "broken": timed("broken", 1.0)}
    times, errors = bench.time_alternating(fns, 3, lambda fn: fn())
    assert order == ["sdpa", "fused", "broken", "fused", "broken", "sdpa", "sdpa", "fused"]
    assert times == {"sdpa": [4.0] * 3, "fused": [0.5] * 3, "broken": [1.0]}
    assert list(errors) == ["broken"] and "out of memory" in str(errors["broken"])


@pytest.mark.parametrize("call_ms, rep, expect_rep", [(37.0, 100, 370.0), (0.5, 100, 100), (190.0, 3000, 3000)])
def test_bench_times_at_least_min_calls(monkeypatch, call_ms, rep, expect_rep):
    """``_bench`` times one call first and gives ``do_bench`` a budget of at least ``MIN_CALLS`` such calls: a
    budget that fits only one or two calls of a large problem leaves its median to one or two flushed samples."""
    import triton.testing

    class Event:  # a stand-in CUDA event: every timed interval lasts ``call_ms``
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def elapsed_time(self, end):
            return call_ms

    calls, budgets = [], []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, return_mode: budgets.append(rep) or 1.5)
    assert bench._bench(lambda: calls.append(1), 25, rep) == 1.5
    assert calls == [1] and budgets == [pytest.approx(expect_rep)] and bench.MIN_CALLS == 10


@pytest.mark.parametrize("backward", [False, True])
def test_backend_calls_keep_their_own_backend_and_inputs(monkeypatch, backward):
    """The timing rounds run after every backend's first call, so each timed function must hold its own backend
    name and input leaves (closures over loop variables would all time the last backend)."""
    calls = []

    def attention(self, q, k, v, rpb, name):
        calls.append((name, q))
        return (q * k).sum() + v.sum()

    monkeypatch.setattr(bench.BenchProblem, "attention", attention)
    p = bench.BenchProblem("tiny", 1, 1, 4, (4,), (3,))
    q, k, v = (torch.randn(1, 4, 1, 4) for _ in range(3))
    d_out = torch.ones(()) if backward else None
    made = {name: bench._backend_call(p, name, q, k, v, None, d_out) for name in ("fused", "flex")}
    for name in ("fused", "flex"):
        made[name][1]()
    assert [name for name, _ in calls] == ["fused", "flex"]
    if backward:  # its own leaves, which need gradients, not the shared inputs
        assert all(t is not q and t.requires_grad and t.is_leaf for _, t in calls)
        assert calls[0][1] is not calls[1][1]
    else:
        assert all(t is q for _, t in calls)


def test_portable_backend_keeps_the_hopper_kernels_off_through_the_backward(monkeypatch):
    """``fused-portable`` times the fused backend with the Hopper kernels off: in its forward and in its backward,
    which autograd runs after the forward call has returned."""
    from ops.fused import hopper

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", hopper.ENABLED))
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", hopper.ENABLED))
            return grad

    monkeypatch.setattr(bench.BenchProblem, "attention", lambda self, q, k, v, rpb, name: Probe.apply(q) * k + v)
    monkeypatch.setattr(hopper, "ENABLED", True)
    p = bench.BenchProblem("tiny", 1, 1, 4, (4,), (3,))
    q, k, v = (torch.randn(1, 4, 1, 4) for _ in range(3))
    for name in (bench.PORTABLE, "fused"):
        seen.clear()
        bench._backend_call(p, name, q, k, v, None, torch.ones(1, 4, 1, 4))[1]()
        assert seen == [("forward", name == "fused"), ("backward", name == "fused")]
    assert hopper.ENABLED


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("backward", [False, True])
def test_run_problem_on_the_cpu_with_alternating_rounds(monkeypatch, backward):
    """The whole per-problem path on the CPU (stand-in timer): SDPA and each backend in alternating rounds, medians
    in the rows, speedups and E against SDPA's median, per-round times kept, a backend that fails reported."""
    import argparse

    clock = iter(range(1, 1000))
    timed = []

    def fake_bench(fn, warmup, rep):
        fn()
        timed.append(fn)
        return float(next(clock))

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "_bench", fake_bench)
    p = bench.BenchProblem("tiny", 1, 2, 8, (6, 6), (3, 3))
    args = argparse.Namespace(rounds=3, warmup=1, rep=1, check=0)
    ceilings = {"matmul_bf16_TFLOPs": 1.0, "copy_GBps": 1.0}
    rows = bench.run_problem(p, ["naive", "gemm", "nonexistent"], backward, torch.float32, ceilings, args,
                             lambda msg: None)
    by = {row.backend: row for row in rows}
    # clock values 1..9 over the rounds (sdpa, naive, gemm), (naive, gemm, sdpa), (gemm, sdpa, naive)
    assert by["sdpa"].extra["round_ms"] == [1.0, 6.0, 8.0] and by["naive"].extra["round_ms"] == [2.0, 4.0, 9.0]
    assert by["gemm"].extra["round_ms"] == [3.0, 5.0, 7.0] and len(timed) == 9
    assert by["sdpa"].ms == 6.0 and by["naive"].ms == 4.0 and by["gemm"].ms == 5.0
    assert by["gemm"].speedup_vs_sdpa == pytest.approx(6.0 / 5.0)
    w, n = 9, 36
    assert by["gemm"].efficiency == pytest.approx(6.0 / 5.0 * w / n)
    assert by["nonexistent"].ms is None and by["nonexistent"].note.startswith("failed")


def test_kernel_floor_bytes_count_each_tensor_once():
    """The per-kernel floors of the NAT-Tiny stage problems: T = one [B, N, H, D] tensor, L = one float32 per
    query row; the dRPB kernel reads the batch-summed float32 window-layout dS (49 slots per token and head) once."""
    problems = {p.name: p for p in bench.standard_problems()}
    p = problems["nat-tiny-3"]
    rows = 128 * 14 * 14 * 8
    t, lse, ds = rows * 32 * 2, rows * 4, 14 * 14 * 8 * 49 * 4
    floors = bench.kernel_floor_bytes(p, 2)
    assert floors == {"na_fwd_kernel": 4 * t,
                      "na_bwd_dq_kernel": 6 * t + 2 * lse, "na_bwd_dkdv_kernel": 6 * t + 2 * lse,
                      "na_drpb_window_kernel": ds, "na_bias_tiles_kernel": 0, "na_bias_tiles_inverse_kernel": 0,
                      "na_drpb_tiles_kernel": 0}
    no_rpb = bench.kernel_floor_bytes(problems["nat-s3"], 2)
    assert no_rpb["na_drpb_window_kernel"] == 0 and no_rpb["na_bwd_dq_kernel"] == 6 * t + 2 * lse


def test_backward_timing_returns_gradients_without_accumulating():
    """The timed forward + backward computes every input's gradient with autograd.grad, so no gradient
    accumulation kernel (absent from a training step with zeroed grads) is timed with it."""
    p = bench.BenchProblem("tiny-rpb", 1, 2, 16, (6, 6), (3, 3), rpb=True)
    q, k, v, rpb = p.random_inputs(torch.device("cpu"), torch.float32, torch.Generator().manual_seed(0))
    calls = []
    real = torch.autograd.grad
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.autograd, "grad", lambda out, inputs, grad: calls.append(len(inputs)) or real(out, inputs,
                                                                                                        grad))
        _, fn = bench._backend_call(p, "naive", q, k, v, rpb, torch.randn(q.shape))
        fn()
    assert calls == [4]


def test_main_counts_problems_as_it_goes(monkeypatch, capsys):
    """Each problem's line says how far the run is; the GPU parts are stood in for."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "measure_ceilings", lambda device: {"copy_GBps": 1.0})
    ran = []
    monkeypatch.setattr(bench, "run_problem", lambda p, *args, **kwargs: ran.append(p.name) or [])
    bench.main(["--problems", "2d-flux,nat-s1", "--backends", "naive"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert ran == ["2d-flux", "nat-s1"]
    assert [line.split(" B=")[0] for line in lines] == ["[1/2] 2d-flux:", "[2/2] nat-s1:"]


def test_the_stage_problems_cover_every_na_layer_of_nat_tiny_dinat_tiny_and_nat_small():
    """Every NA layer of the three models at 224 px (its heads, head dim, map, window and the dilation it runs with)
    is one of the bench's stage problems, with RPB as the models train."""
    import timm

    import namodels  # noqa: F401  (registers the models)
    from namodels.models.layers import fit_window

    problems = {(p.heads, p.dim, p.spatial, p.kernel_size, p.dilation): p for p in bench.standard_problems() if p.rpb}
    for name in ("nat_tiny", "dinat_tiny", "nat_small"):
        model = timm.create_model(name)
        for i, stage in enumerate(model.levels):
            side = 56 // 2 ** i
            for block in stage.blocks:
                attn = block.attn
                dilation, _ = fit_window((side, side), attn.kernel_size, attn.dilation, attn.dilation_mode)
                key = (attn.num_heads, attn.head_dim, (side, side), tuple(attn.kernel_size), tuple(dilation))
                assert key in problems, (name, i, key)
                assert problems[key].batch == 128


def test_jvp_mode_times_forward_mode_of_every_backend_and_of_sdpa(monkeypatch):
    """``--jvp``: each backend's timed call is torch.func.jvp in every input (q, k, v, rpb), giving the same tangent
    on every backend; SDPA's baseline is its dense jvp; the rows say ``jvp`` and count 3x the forward's FLOPs."""
    import argparse

    results = {}

    def fake_bench(fn, warmup, rep):
        results.setdefault(fn, fn())
        return 1.0

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "_bench", fake_bench)
    p = bench.BenchProblem("tiny", 1, 2, 8, (6, 6), (3, 3), rpb=True)
    args = argparse.Namespace(rounds=1, warmup=1, rep=1, check=0)
    ceilings = {"matmul_bf16_TFLOPs": 1.0, "copy_GBps": 1.0}
    rows = bench.run_problem(p, ["naive", "gemm"], False, torch.float32, ceilings, args, lambda msg: None, jvp=True)
    assert [(row.backend, row.mode) for row in rows] == [("sdpa", "jvp"), ("naive", "jvp"), ("gemm", "jvp")]
    tangents = [result[1] for result in results.values() if result is not None]
    assert len(tangents) == 2 and tangents[0].abs().max() > 0
    torch.testing.assert_close(tangents[0], tangents[1], rtol=1e-4, atol=1e-4)
    assert rows[1].tflops == pytest.approx(3.0 * 4 * 2 * 36 * 9 * 8 / 1.0 / 1e9)
