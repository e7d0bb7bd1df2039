"""eval.py defaults a new user meets: a bare throughput run on a CPU is small (the GPU plan stays as it was), its
folder is named after the task, and FID's dependency has an install extra that the docs name."""
import os
import time
import tomllib

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from namodels.benchmark.throughput import DEFAULT_MODELS
from namodels.tasks.throughput import apply_device_defaults, resolve_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compose_eval(*overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        return compose(config_name="eval", overrides=["task=throughput", *overrides])


def test_cpu_default_is_small_and_gpu_default_unchanged():
    cpu = compose_eval("task.device=cpu")
    filled = apply_device_defaults(cpu.task)
    assert filled == dict(models=["nat_mini", "dinat_mini"], backends=["gemm", "sdpa"], batch_size=2)
    assert cpu.task.precisions is None  # the benchmark's own CPU default (fp32)

    gpu = compose_eval("task.device=cuda")
    apply_device_defaults(gpu.task)
    assert list(gpu.task.models) == DEFAULT_MODELS  # what the GPU measured before
    assert gpu.task.backends is None and gpu.task.batch_size is None  # benchmark defaults: all backends, 128


def test_given_options_win_over_device_defaults():
    cfg = compose_eval("task.device=cpu", "task.models=[nat_tiny]", "task.batch_size=4")
    apply_device_defaults(cfg.task)
    assert list(cfg.task.models) == ["nat_tiny"] and cfg.task.batch_size == 4
    assert list(cfg.task.backends) == ["gemm", "sdpa"]


def test_unknown_device_default_key_is_named():
    cfg = compose_eval("task.device=cpu", "+task.device_defaults.cpu.modles=[nat_mini]")
    with pytest.raises(ValueError, match=r"task.device_defaults.cpu: unknown keys \['modles'\]"):
        apply_device_defaults(cfg.task)


def test_auto_device():
    assert resolve_device("cuda:1") == "cuda" and resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda")


def test_output_folder_is_named_after_the_task():
    for task in ("throughput", "ops"):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
            cfg = compose(config_name="eval", overrides=[f"task={task}"])
        assert OmegaConf.select(cfg, "paths.run_dir").endswith(f"logs/{task}/{task}")
    assert compose_eval("task=accuracy").run_name == "digits"  # data-set evaluations keep the data set's name


def test_fid_extra_installs_torch_fidelity_and_is_documented():
    extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    assert any(req.startswith("torch-fidelity") for req in extras["fid"])
    readme = open(os.path.join(ROOT, "README.md")).read()
    fid_part = readme[readme.index("FID needs"):][:200]
    assert "pip install -e '.[fid]'" in fid_part


@pytest.mark.slow
def test_bare_cpu_throughput_run_finishes_in_minutes(tmp_path):
    from namodels.tasks.runner import evaluate

    cfg = compose_eval("task.device=cpu", f"paths.root_dir={tmp_path}", "task.chart=false")
    started = time.time()
    rows = evaluate(cfg)
    assert time.time() - started < 300
    assert {(r["model"], r["backend"]) for r in rows} == {("nat_mini", "gemm"), ("nat_mini", "sdpa"),
                                                          ("dinat_mini", "gemm")}
    assert os.path.isfile(os.path.join(cfg.paths.output_dir, "throughput.csv"))


def test_cli_on_cpu_defaults_to_the_quick_rows(monkeypatch, tmp_path):
    """``python -m namodels.benchmark.throughput`` with no models on a CPU measures what ``eval.py task=throughput``
    does there (a couple of minutes), not the hour-long GPU list; the two defaults are one list."""
    from omegaconf import OmegaConf

    from namodels.benchmark import throughput

    seen = {}
    monkeypatch.setattr(throughput, "run_benchmarks", lambda options, out_dir, **kw: seen.update(options=options) or [])
    throughput.main(["--device", "cpu", "--out", str(tmp_path), "--no-progress"])
    options = seen["options"]
    assert (options.models, options.backends, options.batch_size) == (
        throughput.CPU_DEFAULTS["models"], throughput.CPU_DEFAULTS["backends"], throughput.CPU_DEFAULTS["batch_size"])
    task = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "configs", "task", "throughput.yaml"))
    assert OmegaConf.to_container(task.device_defaults.cpu) == throughput.CPU_DEFAULTS
