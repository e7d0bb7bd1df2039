"""An ImageNet recipe's short run on a CPU: float32 on trainer=cpu, no compilation off CUDA, a schedule that adapts
to one epoch, every Trainer argument settable as trainer.<name>, config errors as one line without a leftover run
folder, and loader workers capped at the CPU count."""
import inspect
import logging
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch import Trainer
from omegaconf import OmegaConf

import namodels  # noqa: F401
from namodels.data import ClassificationDataModule
from namodels.tasks.classification import ClassificationModule, schedule_epochs
from namodels.tasks.overrides import (config_error_key, reported_config_errors, trainer_value_errors,
                                      unknown_trainer_keys)
from namodels.tasks.run_dirs import assign_run_folder, discard_unused_folder
from namodels.tasks.runner import fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")

# The nat_mini_in1k recipe as it is, on a model and data small enough for seconds on a CPU.
SMALL_RECIPE = ["experiment=nat_mini_in1k", "trainer=cpu", "model.name=nat_digits", "data=synthetic",
                "data.img_size=32", "data.num_classes=10", "data.train_samples=16", "data.val_samples=8",
                "data.batch_size=8", "data.val_batch_size=8", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
                "threads=1", "logger=csv", "callbacks.progress_bar=null", "callbacks.model_summary=null",
                "callbacks.samples=null", "callbacks.curves=null", "export=false"]


def compose_cfg(name, overrides=()):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize("experiment", ["nat_mini_in1k", "dinat_large_384_in1k_ft"])
def test_trainer_cpu_runs_a_recipe_in_float32(experiment):
    """The recipes take their precision from the trainer group (ddp: bf16-mixed), so trainer=cpu's 32-true holds
    (a recipe's own trainer.precision was applied after the trainer group and kept bf16 autocast on the CPU)."""
    extra = ["model.pretrained_file=/weights/in22k.pth"]
    assert compose_cfg("train", [f"experiment={experiment}", *extra]).trainer.precision == "bf16-mixed"
    cpu = compose_cfg("train", [f"experiment={experiment}", "trainer=cpu", *extra]).trainer
    assert (cpu.accelerator, cpu.precision) == ("cpu", "32-true")
    assert cpu.gradient_clip_val == 5.0  # the rest of the recipe's trainer settings stay
    assert compose_cfg("train", [f"experiment={experiment}", "trainer=ddp_cpu", *extra]).trainer.precision == "32-true"


def test_model_compile_applies_on_cuda_only(monkeypatch, caplog):
    """model.compile (the recipes' reduce-overhead) compiles the model once the run's device is known: on CUDA;
    on a CPU the model stays eager, and one info line names model.compile."""
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    module = ClassificationModule(model=dict(name="nat_digits"), num_classes=10, compile="reduce-overhead")
    assert seen == [] and module.hparams.compile == "reduce-overhead"  # not at construction
    with caplog.at_level(logging.INFO, logger="namodels.tasks.classification"):
        assert module.compile_for(torch.device("cpu")) is False
    assert seen == []
    (line,) = [r.getMessage() for r in caplog.records if "model.compile" in r.getMessage()]
    assert line.startswith("model.compile=reduce-overhead is not applied on the cpu device")

    from namodels.speed import compile_options

    module = ClassificationModule(model=dict(name="nat_digits"), num_classes=10, compile="reduce-overhead")
    assert module.compile_for(torch.device("cuda", 0)) is True and module.compile_for("cuda") is False  # once
    assert seen == [dict(options=compile_options("reduce-overhead"))]
    eager = ClassificationModule(model=dict(name="nat_digits"), num_classes=10, compile=False)
    assert eager.compile_for("cuda") is False and len(seen) == 1


def test_recipe_smoke_run_on_a_cpu_needs_no_extra_keys(tmp_path, monkeypatch, caplog):
    """The nat_mini_in1k recipe (compile reduce-overhead, 20 warm-up + 10 cooldown epochs, 6 loader workers,
    bf16) runs one epoch on a CPU with trainer=cpu alone: eager, float32, the schedule shortened with a warning per
    key, the workers capped at the CPU count."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(kw))
    cfg = compose_cfg("train", SMALL_RECIPE + [f"paths.root_dir={tmp_path}"])
    assert cfg.model.compile == "reduce-overhead" and cfg.task.module.scheduler.cooldown_epochs == 10
    with caplog.at_level(logging.INFO):
        summary = fit(cfg)
    assert summary["global_step"] == 2 and summary["epochs"] == 1 and compiled == []
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "model.compile=reduce-overhead is not applied on the cpu device" in messages
    assert "task.module.scheduler.cooldown_epochs=10 does not fit trainer.max_epochs=1: cooling down for 0" in messages
    assert "task.module.scheduler.warmup_epochs=20 does not fit" in messages
    assert "1 schedule epochs + 0 cooldown" in messages
    assert "Automatic Mixed Precision" not in messages


def test_cooldown_longer_than_the_run_is_shortened(caplog):
    sched = dict(warmup_epochs=20, cooldown_epochs=10)
    with caplog.at_level(logging.WARNING, logger="namodels.tasks.classification"):
        assert schedule_epochs(sched, 1) == (1, 0.5, 0)
        assert schedule_epochs(sched, 5) == (3, 1.5, 2)
    assert sum("cooldown_epochs=10 does not fit" in r.getMessage() for r in caplog.records) == 2
    caplog.clear()
    assert schedule_epochs(dict(warmup_epochs=20, cooldown_epochs=10), 310) == (300, 20, 10)  # the recipe's own
    assert schedule_epochs(dict(warmup_epochs=0, cooldown_epochs=2), 3) == (1, 0, 2)
    assert not caplog.records


def test_every_trainer_argument_is_settable_without_plus():
    """configs/trainer/default.yaml lists every lightning.Trainer argument but the two the callbacks and logger
    groups build, with Lightning's defaults where it does not choose otherwise: trainer.max_steps=50 composes
    (it was "Key 'max_steps' is not in struct"), under every trainer config."""
    arguments = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    listed = OmegaConf.load(os.path.join(CONFIGS, "trainer", "default.yaml"))
    assert set(listed) - {"_target_"} == arguments - {"callbacks", "logger"}
    chosen = {"default_root_dir", "devices", "precision", "max_epochs", "num_sanity_val_steps", "log_every_n_steps",
              "enable_checkpointing", "enable_progress_bar", "enable_model_summary", "gradient_clip_algorithm",
              "deterministic"}  # the project's choices, commented in the file
    defaults = {name: p.default for name, p in inspect.signature(Trainer.__init__).parameters.items()}
    assert {k: listed[k] for k in listed if k not in chosen | {"_target_"} and listed[k] != defaults[k]} == {}
    for trainer in ("default", "cpu", "gpu", "ddp", "ddp_cpu", "fsdp"):
        cfg = compose_cfg("train", [f"trainer={trainer}", "trainer.max_steps=50", "trainer.max_time=00:00:10:00",
                                    "trainer.val_check_interval=0.5"])
        assert cfg.trainer.max_steps == 50 and trainer_value_errors(cfg.trainer) == []
    assert unknown_trainer_keys(["trainer.max_steps=50", "trainer.overfit_batches=2"]) == []
    (message,) = unknown_trainer_keys(["trainer.callbacks=[]"])
    assert message.startswith("trainer.callbacks: set by the callbacks group")


def test_trainer_max_steps_stops_the_run(tmp_path):
    cfg = compose_cfg("train", ["experiment=digits", "threads=1", "logger=csv", "callbacks.progress_bar=null",
                                "callbacks.model_summary=null", "callbacks.samples=null", "callbacks.curves=null",
                                "export=false", "data.batch_size=16", "trainer.limit_val_batches=1",
                                "trainer.max_steps=2", f"paths.root_dir={tmp_path}"])
    assert fit(cfg)["global_step"] == 2


def test_config_error_inside_fit_exits_with_its_line_and_removes_the_folder(tmp_path):
    """What train.py wraps its run in: a config error raised inside Lightning's fit (the batch larger than the
    training set) exits with "Error: <message>", and the run's fresh version_N, holding no output, is removed."""
    cfg = compose_cfg("train", SMALL_RECIPE + ["data.batch_size=32", f"paths.root_dir={tmp_path}"])
    folder = assign_run_folder(cfg)
    with pytest.raises(SystemExit) as exit_info, reported_config_errors(cfg):
        fit(cfg)
    assert str(exit_info.value) == ("Error: data.batch_size: 32 exceeds the 16 training images; lower "
                                    "data.batch_size (or raise data.train_samples)")
    assert not os.path.exists(folder)
    with pytest.raises(RuntimeError), reported_config_errors(cfg):  # any other error passes unchanged
        raise RuntimeError("a bug")


def test_train_py_config_error_is_one_line_and_leaves_no_run_folder(tmp_path):
    """train.py end to end: "Error: <message>" as the last line, exit status 1, no traceback, no run folder."""
    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "train.py", *SMALL_RECIPE, "data.batch_size=32", f"paths.log_dir={logs}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: data.batch_size: 32 exceeds the 16 training images; lower data.batch_size "
        "(or raise data.train_samples)"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    run_dir = logs / "classification" / "nat_digits-synthetic"
    assert not run_dir.exists() or os.listdir(run_dir) == []


def test_config_error_key_and_folder_removal(tmp_path):
    cfg = compose_cfg("train", [f"paths.root_dir={tmp_path}"])
    assert config_error_key(ValueError("data.batch_size: 9 exceeds the 8 training images"), cfg) == "data.batch_size"
    assert config_error_key(ValueError("ckpt_path=last: no last.ckpt in ..."), cfg) == "ckpt_path=last"
    assert config_error_key(ValueError("x: empty batch"), cfg) is None  # not a config key: a traceback
    assert config_error_key(ValueError("too many values to unpack"), cfg) is None
    assert config_error_key(TypeError("data.batch_size: x"), cfg) is None
    folder = assign_run_folder(cfg)
    os.makedirs(os.path.join(folder, ".hydra"))
    assert discard_unused_folder(cfg) and not os.path.exists(folder)
    used = compose_cfg("train", [f"paths.root_dir={tmp_path}"])
    folder = assign_run_folder(used)
    os.makedirs(os.path.join(folder, "checkpoints"))  # a run's output: kept
    assert not discard_unused_folder(used) and os.path.isdir(folder)
    pinned = compose_cfg("train", [f"paths.root_dir={tmp_path}", "run_version=mine"])
    folder = assign_run_folder(pinned)  # not created as a fresh version_N: kept
    assert not discard_unused_folder(pinned) and os.path.isdir(folder)


def test_loader_workers_capped_at_the_cpu_count(caplog):
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cfg = dict(name="synthetic", format="synthetic", root=None, num_classes=10, img_size=16, batch_size=2,
               val_batch_size=2, num_workers=cpus + 6, train_samples=4, val_samples=2)
    dm = ClassificationDataModule(cfg)
    with caplog.at_level(logging.INFO, logger="namodels.data.datamodule"):
        loaders = [dm.train_dataloader(), dm.val_dataloader()]
    assert [loader.num_workers for loader in loaders] == [cpus, cpus]
    lines = [r.getMessage() for r in caplog.records if "num_workers" in r.getMessage()]
    assert lines == [f"data.num_workers={cpus + 6}: {cpus} loader workers instead, one per CPU of this machine"]
    dm = ClassificationDataModule(dict(cfg, num_workers=1))
    assert dm.train_dataloader().num_workers == 1


def test_a_run_limited_in_training_batches_is_told_to_limit_validation_too():
    from namodels.tasks.runner import short_run_hint

    hint = short_run_hint({"limit_train_batches": 2})
    assert "trainer.limit_val_batches=2" in hint
    assert short_run_hint({"limit_train_batches": 2, "limit_val_batches": 1.0}) == hint
    assert short_run_hint({"limit_train_batches": 2, "limit_val_batches": 1}) is None
    assert short_run_hint({"limit_train_batches": 2, "limit_val_batches": 0}) is None
    assert short_run_hint({"limit_train_batches": 0.5}) is None
    assert short_run_hint({}) is None
