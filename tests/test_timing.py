"""``ops.timing``: the one step timer of the model benchmark, the generator's throughput and ``ops.gemm.bench``."""
import os

import pytest
import torch

import ops.timing
from ops.gemm import bench as gemm_bench


def test_benchmarks_share_one_timer():
    import namodels.benchmark.throughput as throughput
    import namodels.benchmark.timing as timing

    for name in ("TimingSettings", "time_steps", "synchronize", "median_ms"):
        shared = getattr(ops.timing, name)
        assert getattr(timing, name) is shared, name
    assert throughput.time_steps is ops.timing.time_steps
    assert gemm_bench.time_steps is ops.timing.time_steps is timing.time_steps
    assert gemm_bench.TimingSettings is timing.TimingSettings


def test_time_steps_accepts_a_device_name():
    calls = []
    times = ops.timing.time_steps(lambda: calls.append(1), "cpu", ops.timing.TimingSettings(warmup=1, iters=2))
    assert len(calls) == 3 and len(times) == 2 and all(t >= 0 for t in times)
    assert ops.timing.median_ms([3.0, 1.0, 2.0]) == 2.0


def _spy(monkeypatch, order):
    real = ops.timing.time_steps

    def spy(step, device, settings):
        order.append((getattr(step, "args", (None, None))[1], torch.device(device).type,
                      settings.warmup, settings.iters))
        return real(step, "cpu", settings) if torch.device(device).type == "cpu" else [1.5]

    monkeypatch.setattr(gemm_bench, "time_steps", spy)


def test_gemm_bench_cpu_alternates_backends_one_timed_call_each(monkeypatch, capsys):
    order = []
    _spy(monkeypatch, order)
    monkeypatch.setattr(gemm_bench, "CPU_PROBLEM", (1, 1, 8, (6, 6), (3, 3), 1))
    result = gemm_bench.bench_cpu(repeats=3)
    assert order == [("gemm", "cpu", 0, 1), ("naive", "cpu", 0, 1)] * 3
    assert result["gemm_ms"] > 0 and result["naive_ms"] > 0
    assert result["speedup"] == pytest.approx(result["naive_ms"] / result["gemm_ms"])
    assert result["max_abs_diff"] < 1e-5
    assert "speedup gemm over naive" in capsys.readouterr().out


def test_gemm_bench_single_cuda_call_uses_the_step_timer(monkeypatch):
    order = []
    _spy(monkeypatch, order)
    assert gemm_bench._time_cuda(lambda: None, single=True) == 1.5
    assert order == [(None, "cuda", 0, 1)]


def test_cuda_profile_detaches_cupti_unless_told_otherwise(monkeypatch):
    """A profile that left CUPTI attached would slow every kernel launch timed after it (the benchmark profiles each
    row's GPU time between rows); a value the user set is kept."""
    from ops.timing import cuda_profile

    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    cuda_profile()
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    cuda_profile()
    assert os.environ["TEARDOWN_CUPTI"] == "0"
