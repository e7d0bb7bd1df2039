"""Model throughput benchmark (namodels.benchmark): CPU, tiny models, 1-2 timed steps."""
from __future__ import annotations

import csv
import json
import os

import pytest
import timm
import torch
from torch import nn

import namodels  # noqa: F401  registers the models
import ops
from namodels.benchmark import report
from namodels.benchmark.flops import count_macs, na_macs
from namodels.benchmark.models import DenseSelfAttention, swap_dense_attention
from namodels.benchmark.throughput import (BenchOptions, main, measure_throughput, model_groups, model_spec,
                                           run_benchmarks)
from namodels.benchmark.timing import TimingSettings, is_oom, with_batch_decay
from dataclasses import replace

from namodels.models.nat import NAT
from ops.functional import make_params

FAST = TimingSettings(warmup=1, iters=1, min_iters=1, cap_s=30.0, warmup_cap_s=30.0)
TIMM_COLUMNS = ("model", "infer_samples_per_sec", "infer_step_time", "infer_batch_size", "infer_img_size",
                "infer_gmacs", "train_samples_per_sec", "train_step_time", "train_batch_size", "param_count")


def _one_stage_nat(**kwargs):
    """A NAT whose single stage is 7x7 at a 28x28 input: the 7x7 window covers the whole map."""
    torch.manual_seed(0)
    return NAT(embed_dim=32, depths=(2,), num_heads=(2,), kernel_size=7, num_classes=5, mlp_ratio=2.0,
               drop_path_rate=0.0, **kwargs).eval()


# ------------------------------------------------------------------------------------ dense swap


@pytest.mark.parametrize("dilations", [None, [[1, 2]]])  # dilation 2 is clamped to 1 on a 7x7 map
def test_dense_swap_equals_na_when_window_covers_map(dilations):
    model = _one_stage_nat(dilations=dilations)
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad(), ops.use_backend("naive"):
        expected = model(x)
    params = sum(p.numel() for p in model.parameters())
    assert swap_dense_attention(model, rpb="bias") == 2
    assert sum(isinstance(m, DenseSelfAttention) for m in model.modules()) == 2
    assert sum(p.numel() for p in model.parameters()) == params  # rpb kept (shared)
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_dense_swap_drop_rpb_equals_na_without_bias():
    model = _one_stage_nat()
    for name, p in model.named_parameters():
        if name.endswith("rpb"):
            nn.init.zeros_(p)
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad(), ops.use_backend("naive"):
        expected = model(x)
    swap_dense_attention(model)  # rpb='drop': plain SDPA
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_dense_swap_causal_3d_covering_window():
    torch.manual_seed(1)
    na = ops.NeighborhoodAttention3D(16, 2, kernel_size=(4, 3, 5), is_causal=(True, False, False))
    model = nn.Sequential(na).eval()
    x = torch.randn(2, 4, 3, 5, 16)
    with torch.no_grad():
        expected = model[0](x)  # NA, naive/gemm: automatic on CPU
    swap_dense_attention(model)
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_dense_swap_errors():
    with pytest.raises(ValueError, match="model"):
        swap_dense_attention(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="model"):
        swap_dense_attention(ops.NeighborhoodAttention2D(8, 2, 3))
    with pytest.raises(ValueError, match="rpb"):
        DenseSelfAttention(ops.NeighborhoodAttention2D(8, 2, 3), rpb="clamp")


# ------------------------------------------------------------------------------------------ MACs


def test_count_macs_na_layer_is_exact():
    dim, heads, k, side = 32, 2, 5, 9
    na = ops.NeighborhoodAttention2D(dim, heads, k, rel_pos_bias=True, backend="naive")  # forced over
    macs = count_macs(nn.Sequential(na), torch.randn(1, side, side, dim))
    n = side * side
    assert macs["na_macs"] == heads * n * k * k * (2 * (dim // heads))
    assert macs["dense_macs"] == n * dim * 3 * dim + n * dim * dim  # qkv + proj
    assert na.backend == "naive"  # restored


def test_count_macs_causal_and_dense():
    params = make_params((4, 6), (3, 3), 1, 1, (True, False))
    # causal time axis of 4 with K=3: keys 1, 2, 3, 3 -> mean 2.25, times 3 on the other axis
    assert na_macs(params, 2, 4, 8, 8) == 2 * 4 * 24 * 2.25 * 3 * 16
    na = ops.NeighborhoodAttention2D(16, 2, 3)
    model = nn.Sequential(na)
    swap_dense_attention(model)
    macs = count_macs(model, torch.randn(1, 5, 5, 16))
    n = 25
    assert macs["na_macs"] == 0
    assert macs["dense_macs"] == n * 16 * 48 + n * 16 * 16 + 2 * n * n * 8 * 2  # SDPA over all 25 tokens


def test_nat_mini_gmacs_match_the_paper():
    """NAT-Mini at 224: 2.7 GFLOPs (multiply-accumulates) in the NAT paper; 20.0M parameters."""
    import timm

    model = timm.create_model("nat_mini")
    macs = count_macs(model, torch.randn(1, 3, 224, 224))
    assert abs(macs["macs"] / 1e9 - 2.7) < 0.05
    assert 0.1 < macs["na_macs"] / 1e9 < 0.2


# ------------------------------------------------------------------------------- OOM decay / timing


def _fake_oom(batch, limit):
    if batch > limit:
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch} GiB")


def test_batch_decay_steps_down_on_oom_only():
    tried = []

    def run(b):
        tried.append(b)
        _fake_oom(b, 40)
        return b

    assert with_batch_decay(run, 128) == (32, 32)
    assert tried == [128, 96, 64, 48, 32]
    with pytest.raises(torch.OutOfMemoryError):
        with_batch_decay(lambda b: _fake_oom(b, 0), 4)
    calls = []

    def broken(b):
        calls.append(b)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal"):
        with_batch_decay(broken, 64)
    assert calls == [64]  # not retried
    assert is_oom(RuntimeError("CUDA out of memory")) and not is_oom(ValueError("out of memory"))


class _Limited(nn.Module):
    """Raises a (fake) OOM above a batch size."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        _fake_oom(x.shape[0], self.limit)
        return self.fc(x)


def test_measure_throughput_decays_batch_on_oom():
    row = measure_throughput(lambda: _Limited(3), lambda b, d: torch.randn(b, 6, device=d), name="limited",
                             batch_size=8, precision="fp32", device="cpu", settings=FAST)
    assert row["infer_batch_size"] == 3 and row["train_batch_size"] == 3  # 8 -> 6 -> 4 -> 3
    assert row["status"] == "ok" and row["infer_samples_per_sec"] > 0 and row["train_samples_per_sec"] > 0
    assert row["param_count"] == 0.0 and row["infer_gmacs"] == round(6 * 3 / 1e9, 6)


def test_time_steps_respects_caps_and_iterations():
    from namodels.benchmark.timing import time_steps

    calls = []
    times = time_steps(lambda: calls.append(1), torch.device("cpu"), TimingSettings(warmup=2, iters=5))
    assert len(times) == 5 and len(calls) == 7 and all(t >= 0 for t in times)
    import time as _time

    slow = TimingSettings(warmup=3, iters=10, min_iters=2, cap_s=0.01, warmup_cap_s=0.01)
    calls.clear()
    times = time_steps(lambda: (calls.append(1), _time.sleep(0.02)), torch.device("cpu"), slow)
    assert len(times) == 2 and len(calls) == 3  # one warm-up (over its cap), min_iters timed
    with pytest.raises(ValueError, match="iters"):
        TimingSettings(iters=0)


def test_time_steps_without_warmup_times_the_first_call():
    from namodels.benchmark.timing import time_steps

    calls = []
    times = time_steps(lambda: calls.append(1), torch.device("cpu"), TimingSettings(warmup=0, iters=1))
    assert len(times) == 1 and len(calls) == 1
    with pytest.raises(ValueError, match="warmup"):
        TimingSettings(warmup=-1)



def test_time_steps_back_to_back_samples_give_time_per_step():
    """A sample of ``back_to_back`` steps runs them without a synchronisation between and reports the time per step:
    three 20 ms steps per sample read as about 20 ms, not 60; a zero count is refused by name."""
    from namodels.benchmark.timing import time_steps
    import time as _time

    calls = []
    settings = TimingSettings(warmup=1, iters=2, min_iters=2, back_to_back=3)
    times = time_steps(lambda: (calls.append(1), _time.sleep(0.02)), torch.device("cpu"), settings)
    assert len(times) == 2 and len(calls) == 1 + 2 * 3
    assert all(18.0 <= t < 40.0 for t in times)
    with pytest.raises(ValueError, match="back_to_back"):
        TimingSettings(back_to_back=0)



def test_back_to_back_defaults_per_device_and_overrides():
    """Timed samples are 5 back-to-back steps on CUDA and single steps on CPU unless ``--back-to-back`` (or the
    option) says otherwise, also where the timing settings are given."""
    from namodels.benchmark.throughput import BACK_TO_BACK, BenchOptions, _parser, options_from_args

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert BenchOptions().defaults_for(cuda).timing.back_to_back == BACK_TO_BACK
    assert BenchOptions().defaults_for(cpu).timing.back_to_back == 1
    assert BenchOptions(timing=FAST, back_to_back=3).defaults_for(cuda).timing.back_to_back == 3
    for argv, want in (([], BACK_TO_BACK), (["--back-to-back", "1"], 1), (["--iters", "2"], BACK_TO_BACK)):
        options = options_from_args(_parser().parse_args(["--out", "x", *argv]), cuda)
        assert options.defaults_for(cuda).timing.back_to_back == want


# ----------------------------------------------------------------------------------------- rows


def test_measure_row_nat_digits_and_backend_forcing():
    spec = model_spec("nat_digits", img_size=32)
    row = measure_throughput(spec.build, spec.make_input, name="nat_digits", backend="naive", precision="fp32",
                             batch_size=2, img_size=32, device="cpu", settings=FAST)
    for col in TIMM_COLUMNS + ("backend", "precision", "na_gmacs", "status"):
        assert col in row, col
    assert row["status"] == "ok" and row["backend"] == "naive"
    assert row["infer_samples_per_sec"] > 0 and row["train_step_time"] > 0 and row["infer_iters"] == 1
    assert row["param_count"] > 0 and row["infer_gmacs"] > row["na_gmacs"] > 0
    assert row["infer_img_size"] == 32 and row["infer_peak_mem_mib"] is None  # CPU: no CUDA memory stats
    # a backend that cannot serve the problem is reported for both phases, not raised ('count' only serves
    # FLOP counting)
    from namodels.benchmark.flops import COUNT_BACKEND

    bad = measure_throughput(spec.build, spec.make_input, name="nat_digits", backend=COUNT_BACKEND,
                             precision="fp32", batch_size=2, img_size=32, device="cpu", settings=FAST)
    assert bad["status"] == "error" and bad["infer_gmacs"] == row["infer_gmacs"]
    assert bad["infer_error"].startswith("ValueError: backend") and bad["train_error"] == bad["infer_error"]
    with pytest.raises(ValueError, match="precision"):
        measure_throughput(spec.build, spec.make_input, name="x", precision="fp8", device="cpu")
    with pytest.raises(ValueError, match="backend"):
        measure_throughput(spec.build, spec.make_input, name="x", backend="nope", device="cpu")


def test_channels_last_row():
    spec = model_spec("nat_digits", img_size=32)
    row = measure_throughput(spec.build, spec.make_input, name="nat_digits", backend="naive", precision="bf16",
                             batch_size=2, img_size=32, device="cpu", settings=FAST, channels_last=True,
                             train=False)
    assert row["status"] == "ok" and row["channels_last"] is True and row["infer_samples_per_sec"] > 0


def test_video_spec_runs():
    spec = model_spec("video_nat_nano", img_size=32, frames=2)
    row = measure_throughput(spec.build, spec.make_input, name=spec.name, backend="naive", precision="fp32",
                             batch_size=1, img_size=32, device="cpu", settings=FAST, train=False)
    assert row["status"] == "ok" and row["na_gmacs"] > 0


def test_stylenat_spec_runs():
    """Generator images/s; its constant input is a parameter fed straight into a stage (MAC counting must
    cope with that)."""
    spec = model_spec("stylenat_32")
    assert not spec.trainable
    row = measure_throughput(spec.build, spec.make_input, name=spec.name, backend="naive", precision="fp32",
                             batch_size=1, img_size=spec.img_size, device="cpu", settings=FAST, train=False)
    assert row["status"] == "ok" and row["infer_gmacs"] > row["na_gmacs"] > 0 and row["infer_img_size"] == 32


# ----------------------------------------------------------------------------------- plan / CLI


def test_core_imports_without_hydra():
    """The GPU machine has no hydra-core: the CLI's modules must not need it (nor omegaconf / Lightning)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules.update(hydra=None, omegaconf=None, lightning=None); "
            "import namodels.benchmark.throughput, namodels.benchmark.report")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_model_groups():
    assert model_groups(["a", "b", "/", "c"]) == [["a", "b"], ["c"]]
    assert model_groups(["a/c", "d"]) == [["a"], ["c", "d"]]
    assert model_groups(["/", "a", "/"]) == [["a"]]


def test_cli_writes_every_output_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    args = ["--models", "nat_digits", "/", "test_resnet", "--backends", "naive", "sdpa", "--precisions", "fp32",
            "--batch", "2", "--img-size", "32", "--warmup", "1", "--iters", "1", "--out", out]
    rows = main(args)
    keys = {(r["model"], r["backend"]) for r in rows}
    assert keys == {("nat_digits", "naive"), ("nat_digits", "sdpa"), ("test_resnet", "-")}
    assert all(r["status"] == "ok" for r in rows)
    for name in ("throughput.csv", "throughput.json", "throughput.md", "throughput.png", "rows.jsonl"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "throughput.csv")) as f:
        table = list(csv.DictReader(f))
    assert set(TIMM_COLUMNS + ("backend", "precision")) <= set(table[0]) and len(table) == 3
    with open(os.path.join(out, "throughput.json")) as f:
        data = json.load(f)
    assert data["meta"]["torch"] == torch.__version__ and len(data["rows"]) == 3 and len(data["targets"]) == 4
    with open(os.path.join(out, "throughput.md")) as f:
        assert "| nat_digits | sdpa | fp32 |" in f.read()
    before = {report.row_key(r): r["infer_step_time"] for r in rows}
    again = main(args + ["--resume"])  # everything done: nothing re-measured
    assert {report.row_key(r): r["infer_step_time"] for r in again} == before



def test_rounds_alternate_rows_and_report_medians(tmp_path):
    """``--rounds 3``: every row is measured once per round, the rows of a round one after another; rows.jsonl keeps
    each round's row, the tables one row per (model, backend, precision) with the median over the rounds, and a resumed
    run measures nothing again."""
    out = str(tmp_path / "run")
    args = ["--models", "nat_digits", "test_resnet", "--backends", "naive", "--precisions", "fp32", "--batch", "2",
            "--img-size", "32", "--warmup", "1", "--iters", "1", "--no-chart", "--rounds", "3", "--out", out]
    rows = main(args)
    with open(os.path.join(out, "rows.jsonl")) as f:
        measured = [json.loads(line) for line in f if line.strip()]
    assert [(r["model"], r["round"]) for r in measured] == [("nat_digits", 0), ("test_resnet", 0), ("nat_digits", 1),
                                                            ("test_resnet", 1), ("nat_digits", 2), ("test_resnet", 2)]
    assert len(rows) == 2 and all(r["rounds"] == 3 and "round" not in r for r in rows)
    for row in rows:
        per_round = [r for r in measured if r["model"] == row["model"]]
        for phase in ("infer", "train"):
            values = [r[f"{phase}_samples_per_sec"] for r in per_round]
            assert row[f"{phase}_samples_per_sec_rounds"] == values
            assert row[f"{phase}_samples_per_sec"] == sorted(values)[1]
            assert row[f"{phase}_step_time"] == sorted(r[f"{phase}_step_time"] for r in per_round)[1]
    with open(os.path.join(out, "throughput.json")) as f:
        assert len(json.load(f)["rows"]) == 2
    again = main(args + ["--resume"])
    assert [r["infer_samples_per_sec"] for r in again] == [r["infer_samples_per_sec"] for r in rows]
    with pytest.raises(ValueError, match="rounds"):
        run_benchmarks(BenchOptions(models=["nat_digits"], device="cpu", rounds=0), str(tmp_path / "bad"))



def test_merged_rounds_take_a_measured_round_as_their_base():
    """A row that failed in one round and was measured in the others reports the measured rounds' median and status."""
    from namodels.benchmark.report import merge_rounds

    def row(round_index, status, rate):
        return dict(model="m", backend="fused", precision="bf16", round=round_index, status=status,
                    infer_samples_per_sec=rate, infer_error=None if rate else "OOM")

    merged, = merge_rounds([row(0, "error", None), row(1, "ok", 10.0), row(2, "ok", 30.0)])
    assert merged["status"] == "ok" and merged["infer_error"] is None and merged["rounds"] == 3
    assert merged["infer_samples_per_sec"] == 20.0 and merged["infer_samples_per_sec_rounds"] == [10.0, 30.0]


def test_deadline_records_rows_as_not_run(tmp_path):
    options = BenchOptions(models=["nat_digits"], backends=["naive"], precisions=["fp32"], batch_size=2,
                           img_size=32, device="cpu", timing=FAST, deadline_s=1e-3, min_row_s=1e9, chart=False)
    rows = run_benchmarks(options, str(tmp_path))
    assert [(r["status"], r["infer_error"]) for r in rows] == [("skipped", "not run: time budget spent")]


def test_report_targets_and_chart(tmp_path):
    def row(model, backend, infer, train=None):
        return dict(model=model, backend=backend, precision="bf16", infer_samples_per_sec=infer,
                    train_samples_per_sec=train)

    rows = [row("nat_mini", "naive", 100.0, 10.0), row("nat_tiny", "fused", 900.0, 1200.0),
            row("dinat_tiny", "fused", 1100.0), row("swin_tiny_patch4_window7_224", "-", 1000.0, 1000.0)]
    values = [(c["target"].split(" >=")[0], c["value"], c["met"]) for c in report.target_checks(rows)]
    assert values == [("nat_tiny fused inference", 0.9, False), ("nat_tiny fused training", 1.2, True),
                      ("dinat_tiny fused inference", 1.1, True), ("dinat_tiny fused training", None, None)]
    assert report.plot(rows, str(tmp_path / "c.png")) and os.path.getsize(tmp_path / "c.png") > 1000
    assert report.plot([], str(tmp_path / "none.png")) is None


def test_report_marks_host_bound_steps():
    """The table shows GPU time beside wall time and names a step whose wall time passes 1.1x its GPU time."""
    base = dict(model="nat_tiny", backend="fused", precision="bf16", compile="reduce-overhead")
    host_bound = dict(base, train_step_time=120.0, train_gpu_ms=60.0, infer_step_time=20.0, infer_gpu_ms=19.5)
    table = report.markdown_table([host_bound])
    assert "| reduce-overhead |" in table and "120.00 (60.00)" in table
    assert "train host-bound (2.00x GPU time)" in table and "infer host-bound" not in table


def test_cpu_table_has_no_gpu_columns_or_targets(tmp_path):
    """Rows measured on a CPU have no GPU time: the table is headed "infer ms" / "train ms" without "(GPU)" or
    empty brackets, and the GPU speed targets (none of which a CPU run measures) are left out of the Markdown;
    rows with GPU times keep both."""
    cpu = dict(model="nat_digits", backend="naive", precision="fp32", infer_step_time=3.0, train_step_time=9.0,
               infer_gpu_ms=None, train_gpu_ms=None)
    table = report.markdown_table([cpu])
    assert "| infer ms | train img/s | train ms |" in table and "GPU" not in table
    assert "| 3.00 |" in table and "| 9.00 |" in table and report.targets_markdown([cpu]) == ""
    paths = report.write_tables([cpu], str(tmp_path))
    text = open(paths["md"]).read()
    assert "not measured" not in text and "| target |" not in text
    assert len(json.load(open(paths["json"]))["targets"]) == 4  # the JSON keeps every target, as null
    gpu = dict(cpu, backend="fused", precision="bf16", infer_gpu_ms=2.5, train_gpu_ms=8.0)
    assert "infer ms (GPU)" in report.markdown_table([gpu]) and "3.00 (2.50)" in report.markdown_table([gpu])
    assert "| target | measured | met |" in report.targets_markdown([gpu])


def test_compile_modes_and_optimizer_choice():
    from namodels.speed import compile_mode, compile_options, optimizer_kwargs

    assert [compile_mode(v) for v in (False, None, "none", True, "reduce-overhead")] == \
        [None, None, None, "default", "reduce-overhead"]
    with pytest.raises(ValueError, match="compile"):
        compile_mode("fast")
    # a mode spelled out as its options, plus the project's (torch.compile takes one or the other)
    assert compile_options("reduce-overhead") == {"triton.cudagraphs": True, "combo_kernels": True,
                                                  "combo_kernels_pointwise_only": True}
    assert compile_options("default") == {"combo_kernels": True, "combo_kernels_pointwise_only": True}
    assert optimizer_kwargs("adamw", torch.device("cuda")) == {"fused": True}
    assert optimizer_kwargs("adamw", torch.device("cpu")) == {} == optimizer_kwargs("sgd", torch.device("cuda"))


def test_compiled_row_records_its_mode(tmp_path):
    """``--compile MODE`` reaches torch.compile (as that mode's options plus the project's) and the row; CPU rows
    have no GPU time."""
    seen = []
    real_compile = torch.compile

    def spy(model, **kwargs):
        seen.append(kwargs)
        return real_compile(model, backend="eager")

    import namodels.benchmark.throughput as throughput
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(throughput.torch, "compile", spy)
        row = throughput.measure_throughput(lambda: timm.create_model("nat_digits", backend="naive"),
                                            lambda b, d: torch.randn(b, 3, 32, 32, device=d), name="nat_digits",
                                            backend="naive", precision="fp32", batch_size=2, device="cpu",
                                            settings=FAST, compile="max-autotune", count_flops=False)
    assert len(seen) == 1 and "mode" not in seen[0] and row["compile"] == "max-autotune" and row["status"] == "ok"
    assert seen[0]["options"]["max_autotune"] and seen[0]["options"]["triton.cudagraphs"]
    assert seen[0]["options"]["combo_kernels"]
    assert row["infer_gpu_ms"] is None and row["train_gpu_ms"] is None


def test_hydra_task_config_maps_to_options():
    hydra = pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    from namodels.benchmark.task import options_from_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with initialize_config_dir(config_dir=os.path.join(root, "configs"), version_base="1.3"):
        cfg = compose("eval", overrides=["task=throughput", "task.batch_size=4", "task.backends=[naive,sdpa]",
                                         "task.timing={warmup:1,iters:2,min_iters:1,cap_s:1,warmup_cap_s:1}"])
    assert cfg.task.stage == "eval" and cfg.task.run._target_ == "namodels.tasks.throughput.run"
    options = options_from_config(cfg.task)
    assert options.batch_size == 4 and options.backends == ["naive", "sdpa"] and options.timing.iters == 2
    assert model_groups(options.models)[0][:3] == ["nat_mini", "dinat_mini", "nat_tiny"]
    assert hydra is not None


class _CrashesInTraining(nn.Module):
    """NA model whose backward 'kills the CUDA context' (what an illegal memory access does)."""

    def __init__(self):
        super().__init__()
        self.na = ops.NeighborhoodAttention2D(8, 2, 3)

    def forward(self, x):
        if self.training:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.na(x)


def test_lost_cuda_context_keeps_the_row_and_restarts(tmp_path, monkeypatch):
    from namodels.benchmark import throughput as tp

    state = {"dead": False}

    def context_ok(device):
        return not state["dead"]

    def crash_spec(name, img_size=224, frames=8):
        def build():
            model = _CrashesInTraining()
            original = model.forward

            def forward(x):
                try:
                    return original(x)
                except RuntimeError:
                    state["dead"] = True
                    raise

            model.forward = forward
            return model

        return tp.ModelSpec(name, build, lambda b, d: (torch.randn(b, 5, 5, 8, device=d),), img_size=5)

    monkeypatch.setattr(tp, "cuda_context_ok", context_ok)
    monkeypatch.setattr(tp, "model_spec", crash_spec)
    restarts = []

    class Restarted(Exception):
        pass

    def restart():
        restarts.append(tp.report.read_rows(str(tmp_path / "rows.jsonl")))
        raise Restarted

    options = BenchOptions(models=["a", "b"], backends=["naive", "gemm"], precisions=["fp32"], batch_size=2,
                           device="cpu", timing=FAST, chart=False)
    with pytest.raises(Restarted):
        run_benchmarks(options, str(tmp_path), restart=restart)
    (row,) = restarts[0]  # written before the restart, with the inference numbers
    assert row["crash"] == "train" and row["cuda_ok"] is False and row["infer_samples_per_sec"] > 0
    assert "illegal memory access" in row["train_error"] and row["status"] == "partial"
    # each restarted process (resume) goes on; a backend whose training killed the context is not trained again
    for _ in range(4):
        state["dead"] = False
        try:
            rows = run_benchmarks(replace(options, resume=True), str(tmp_path), restart=restart)
            break
        except Restarted:
            continue
    assert len(restarts) == 2  # a/naive, then a/gemm (a new backend) crashed
    by_key = {(r["model"], r["backend"]): r for r in rows}
    for backend in ("naive", "gemm"):
        row = by_key[("b", backend)]
        assert row["train_error"].startswith(f"not run: {backend} train killed the CUDA context earlier (a fp32)")
        assert row["infer_samples_per_sec"] > 0 and row.get("cuda_ok", True)


@pytest.mark.parametrize("keep_gc", [False, True])
def test_timed_steps_pause_the_garbage_collector(keep_gc):
    """Timed steps run with the collector off (as timeit does) unless keep_gc; it is on again after."""
    import gc

    from namodels.benchmark.timing import TimingSettings, time_steps

    seen = []
    settings = TimingSettings(warmup=1, iters=3, min_iters=3, keep_gc=keep_gc)
    times = time_steps(lambda: seen.append(gc.isenabled()), torch.device("cpu"), settings)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert seen[0] is True  # the warm-up step runs as usual
    assert seen[1:] == [keep_gc] * 3
    assert gc.isenabled()


def _compose_ops(overrides):
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with initialize_config_dir(config_dir=os.path.join(root, "configs"), version_base="1.3"):
        return compose("eval", overrides=["task=ops", "paths.output_dir=/tmp/opsbench", *overrides],
                       return_hydra_config=False)


def test_ops_task_maps_to_the_op_benchmark_flags(capsys):
    """``eval.py task=ops`` passes its settings to ``ops.bench`` as that tool's own flags, which its parser accepts."""
    from namodels.tasks.op_bench import argv_from_config

    cfg = _compose_ops(["task.problems=[2d-flux,nat-s1]", "task.backward=true", "task.autotune=true",
                        "task.check=8", "task.rep=20", "task.rounds=3", "task.backends=[fused,flex]",
                        "task.custom=['mine:2,8,64,64x64,13x13,1,1,0']"])
    assert cfg.task.stage == "eval" and cfg.task.run._target_ == "namodels.tasks.op_bench.run"
    argv = argv_from_config(cfg.task)
    assert argv[:4] == ["--problems", "2d-flux,nat-s1", "--backends", "fused,flex"]
    assert "--backward" in argv and "--autotune" in argv
    assert argv[argv.index("--custom") + 1] == "mine:2,8,64,64x64,13x13,1,1,0"
    assert argv[argv.index("--out") + 1] == "/tmp/opsbench/ops"
    assert argv[argv.index("--check") + 1] == "8" and argv[argv.index("--rep") + 1] == "20"
    assert argv[argv.index("--rounds") + 1] == "3"
    default = argv_from_config(_compose_ops([]).task)
    assert default[:4] == ["--problems", "all", "--backends", "fused,flex,naive"] and "--backward" not in default
    if not torch.cuda.is_available():  # ops.bench parses its flags first, then stops for want of a GPU
        from ops import bench

        for args in (argv, default):
            with pytest.raises(SystemExit):
                bench.main(args)
            err = capsys.readouterr().err
            assert "needs a CUDA device" in err and "unrecognized" not in err and "invalid" not in err


def test_ops_task_without_a_gpu_says_so(monkeypatch):
    from namodels.tasks import op_bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="task=ops.*CUDA"):
        op_bench.run(_compose_ops([]))


def test_progress_bar_counts_every_row(tmp_path, monkeypatch):
    import namodels.benchmark.throughput as throughput

    bars = []

    class Recording(throughput.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.shown = not self.disable  # (closing a bar disables it)
            bars.append(self)

    monkeypatch.setattr(throughput, "tqdm", Recording)
    options = BenchOptions(models=["nat_digits", "/", "test_resnet"], backends=["naive", "sdpa"], precisions=["fp32"],
                           batch_size=2, img_size=32, device="cpu", timing=FAST, chart=False)
    rows = run_benchmarks(options, str(tmp_path / "a"), progress=True)
    # planned 2 models x 2 backends; test_resnet has no NA layer, so it runs once: 3 rows
    assert len(rows) == 3 and (bars[0].n, bars[0].total) == (3, 3) and bars[0].shown
    run_benchmarks(replace(options, resume=True), str(tmp_path / "a"), progress=True)  # rows done already count
    assert (bars[1].n, bars[1].total) == (3, 3)
    run_benchmarks(replace(options, resume=True), str(tmp_path / "a"))
    assert not bars[2].shown                                             # not a terminal: no bar by default
