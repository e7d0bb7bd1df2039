"""train.py / eval.py: config composition of every experiment, a fast dev run per task, mixup + EMA +
checkpoints + export + eval round trip, exact resumption after a kill, DDP on CPU, clear errors."""
import csv
import glob
import json
import os
import signal
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import timm
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_method
from omegaconf import OmegaConf

import namodels  # noqa: F401
from namodels.tasks.classification import ClassificationModule
from namodels.tasks.evaluate import COLUMNS
from namodels.tasks.models import create_model
from namodels.tasks.overrides import trainer_value_errors
from namodels.tasks.runner import check_stage, check_task_inputs, evaluate, fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")

# A few small batches of digits, one CPU thread, no progress bar: seconds per epoch.
FAST = ["threads=1", "logger=csv", "callbacks.progress_bar=null", "callbacks.model_summary=null",
        "data.batch_size=16", "data.val_batch_size=64", "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=2", "trainer.max_epochs=2", "trainer.log_every_n_steps=1",
        "task.module.scheduler.warmup_epochs=0"]
# Fit tasks need a small model and data to dev-run; a task added to configs/task/ adds its overrides here.
DEV_OVERRIDES = {"classification": ["experiment=digits"], "gan": ["experiment=stylenat_skimage"],
                 "video": ["experiment=video_moving_digits"]}


def compose_cfg(name, overrides=()):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def _names(group):
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(CONFIGS, group, "*.yaml")))


def _experiments_of(task):
    return [name for name in _names("experiment")
            if f"override /task: {task}" in open(os.path.join(CONFIGS, "experiment", name + ".yaml")).read()]


def _targets(node):
    if isinstance(node, dict):
        if "_target_" in node:
            yield node["_target_"], node.get("_partial_", False)
        for value in node.values():
            yield from _targets(value)
    elif isinstance(node, list):
        for value in node:
            yield from _targets(value)


def _check_targets(plain):
    for target, _ in _targets(plain):
        assert callable(get_method(target)), target  # classes and functions (factories, partials)


@pytest.mark.parametrize("experiment", _names("experiment"))
def test_every_experiment_composes(experiment):
    cfg = compose_cfg("train", [f"experiment={experiment}"])
    if OmegaConf.is_missing(cfg.model, "pretrained_file"):  # fine-tuning recipes require weights
        cfg = compose_cfg("train", [f"experiment={experiment}", "model.pretrained_file=/weights/in22k.pth"])
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # every key resolves
    _check_targets(plain)
    assert trainer_value_errors(cfg.trainer) == []  # of the types the Trainer's arguments declare
    assert plain["task"]["stage"] == "fit"
    if plain["task"]["name"] != "classification":
        return  # other tasks' experiments: composition and targets only (their own tests go further)
    assert plain["task"]["module"]["model"]["name"] == plain["model"]["name"]
    assert timm.is_model(plain["model"]["name"]), plain["model"]["name"]
    # the architecture builds (on the meta device: no memory, no init cost)
    model_cfg = dict(plain["model"], pretrained=False, pretrained_file=None)
    with torch.device("meta"):
        model = create_model(model_cfg, plain["data"]["num_classes"])
    assert sum(p.numel() for p in model.parameters()) > 0
    if experiment.endswith("_in1k"):  # the published recipe
        opt, sched = plain["task"]["module"]["optimizer"], plain["task"]["module"]["scheduler"]
        assert (opt["name"], opt["lr"], opt["lr_base_batch"], opt["weight_decay"]) == ("adamw", 1e-3, 1024, 0.05)
        assert (sched["warmup_epochs"], sched["warmup_lr"], sched["min_lr"]) == (20, 1e-6, 5e-6)
        assert plain["trainer"]["max_epochs"] - sched["cooldown_epochs"] == 300
        assert plain["trainer"]["gradient_clip_val"] == 5.0 and plain["trainer"]["precision"] == "bf16-mixed"
        mix = plain["task"]["module"]["mixup"]
        assert (mix["mixup_alpha"], mix["cutmix_alpha"], plain["task"]["module"]["label_smoothing"]) == (0.8, 1.0, 0.1)
        aug = plain["data"]["augment"]
        assert (aug["auto_augment"], aug["re_prob"]) == ("rand-m9-mstd0.5-inc1", 0.25)


# The published stochastic-depth rate (and input size) of each NAT-family ImageNet recipe: the experiments
# name only the variant (model=nat model.name=...), the rest comes from the timm registry.
PUBLISHED = {
    "nat_mini_in1k": 0.2, "nat_tiny_in1k": 0.2, "nat_small_in1k": 0.3, "nat_base_in1k": 0.5,
    "nat_mini_synthetic": 0.2,
    "dinat_mini_in1k": 0.2, "dinat_tiny_in1k": 0.2, "dinat_small_in1k": 0.3, "dinat_base_in1k": 0.5,
    "dinat_large_in1k_ft": 0.35, "dinat_large_384_in1k_ft": 0.35, "dinat_large_384_11x11_in1k_ft": 0.35,
    "dinat_s_tiny_in1k": 0.2, "dinat_s_small_in1k": 0.3, "dinat_s_base_in1k": 0.5,
    "dinat_s_large_in1k_ft": 0.35, "dinat_s_large_384_in1k_ft": 0.35,
}


def test_nat_family_experiments_are_listed():
    family = [e for e in _names("experiment")
              if "override /model: nat\n" in open(os.path.join(CONFIGS, "experiment", e + ".yaml")).read()]
    assert sorted(family) == sorted(PUBLISHED)


@pytest.mark.parametrize("experiment", sorted(PUBLISHED))
def test_nat_family_experiment_takes_the_variants_published_settings(experiment):
    from timm.data import resolve_model_data_config
    from timm.layers import DropPath

    cfg = compose_cfg("train", [f"experiment={experiment}", "model.pretrained_file=/weights/in22k.pth"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["model"]["drop_path_rate"] is None and plain["model"]["compile"] == "reduce-overhead"
    assert plain["task"]["module"]["compile"] == plain["model"]["compile"]
    with torch.device("meta"):
        model = create_model(dict(plain["model"], pretrained=False, pretrained_file=None), 1000)
    rates = [m.drop_prob for m in model.modules() if isinstance(m, DropPath)]
    assert max(rates) == pytest.approx(PUBLISHED[experiment])  # linear from 0: the last block has the rate
    defaults = resolve_model_data_config(model)
    assert plain["data"]["img_size"] == defaults["input_size"][-1]
    assert plain["data"].get("eval", {}).get("crop_pct") is None  # the eval crop follows the variant's pretrained_cfg
    assert defaults["crop_pct"] == (1.0 if defaults["input_size"][-1] == 384 else 0.875)


@pytest.mark.parametrize("name", ["nat_tiny", "dinat_large_384", "dinat_s_small"])
def test_one_model_config_for_the_nat_family(name):
    cfg = compose_cfg("train", ["model=nat", f"model.name={name}", "model.compile=default"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["run_name"] == f"{name}-digits" and plain["task"]["module"]["compile"] == "default"
    assert set(plain["model"]) == set(compose_cfg("train", ["model=timm", "model.name=x"]).model)
    with torch.device("meta"):
        model = create_model(dict(plain["model"], compile=False), 10)
    assert type(model).__module__.startswith("namodels.models.")


@pytest.mark.parametrize("trainer", _names("trainer"))
def test_trainer_configs_compose(trainer):
    cfg = compose_cfg("train", [f"trainer={trainer}"])
    _check_targets(OmegaConf.to_container(cfg, resolve=True))
    assert trainer_value_errors(cfg.trainer) == []


@pytest.mark.parametrize("task", _names("task"))
def test_task_configs_compose_with_their_script(task):
    stage = OmegaConf.load(os.path.join(CONFIGS, "task", task + ".yaml")).get("stage")
    assert stage in ("fit", "eval"), f"configs/task/{task}.yaml needs stage: fit or eval"
    overrides = [f"task={task}"]
    if stage == "fit":  # a fit task composes with its model and data: use an experiment of that task
        overrides = DEV_OVERRIDES.get(task) or [f"experiment={e}" for e in _experiments_of(task)[:1]] or overrides
    cfg = compose_cfg("train" if stage == "fit" else "eval", overrides + [f"task={task}"])
    _check_targets(OmegaConf.to_container(cfg, resolve=True))
    check_stage(cfg, stage, "x")
    check_task_inputs(cfg)  # the task's own recipe provides what it requires
    if stage == "fit" and cfg.task.get("eval") is not None:  # a fit task with its own evaluation (eval.py task=video)
        eval_cfg = compose_cfg("eval", [f"task={task}"])
        _check_targets(OmegaConf.to_container(eval_cfg, resolve=True))
        check_stage(eval_cfg, "eval", "x")
        return
    with pytest.raises(ValueError, match="task: task=.* is a .* task"):
        check_stage(cfg, "eval" if stage == "fit" else "fit", "x")


@pytest.mark.parametrize("task, recipe", [("gan", "stylenat_skimage"), ("video", "video_moving_digits")])
def test_task_without_its_recipe_names_the_fix(task, recipe):
    """`train.py task=gan` alone keeps the default digits model and data: a clear error, not a deep
    interpolation failure."""
    cfg = compose_cfg("train", [f"task={task}"])
    with pytest.raises(ValueError, match=f"task: task='{task}' needs .*experiment={recipe}"):
        check_task_inputs(cfg)


@pytest.mark.parametrize("task", [t for t in _names("task")
                                  if OmegaConf.load(os.path.join(CONFIGS, "task", t + ".yaml")).get("stage") == "fit"])
def test_fast_dev_run_per_task(task, tmp_path):
    if task not in DEV_OVERRIDES:
        pytest.skip(f"no dev-run overrides for task {task!r} in DEV_OVERRIDES")
    extra = FAST if task == "classification" else []
    cfg = compose_cfg("train", DEV_OVERRIDES[task] + extra + [
        "threads=1", "logger=csv", f"task={task}", f"paths.root_dir={tmp_path}", "trainer.fast_dev_run=true"])
    summary = fit(cfg)
    assert summary["task"] == task and summary["global_step"] >= 1  # (a GAN step counts G and D updates)
    if task == "classification":
        assert summary["global_step"] == 1 and 0 <= summary["metrics"]["val/top1"] <= 100


def _train(tmp_path, *extra):
    cfg = compose_cfg("train", ["experiment=digits"] + FAST + [f"paths.root_dir={tmp_path}", *extra])
    return cfg, fit(cfg)


@pytest.fixture(scope="module")
def trained_with_mixup_and_ema(tmp_path_factory):
    """One small run with mixup/cutmix, EMA (selected on EMA top-1), checkpoints and export."""
    root = tmp_path_factory.mktemp("mixup_ema")
    cfg, summary = _train(root, "task.module.mixup.mixup_alpha=0.8", "task.module.mixup.cutmix_alpha=1.0",
                          "task.module.ema.enabled=true", "task.module.ema.decay=0.5",
                          "callbacks.model_checkpoint.monitor=val_ema/top1", "trainer.max_epochs=1")
    return root, cfg, summary


def test_mixup_ema_run_checkpoints_and_exports(trained_with_mixup_and_ema):
    root, cfg, summary = trained_with_mixup_and_ema
    metrics = summary["metrics"]
    for key in ("val/top1", "val/top5", "val/loss", "val_ema/top1", "val_ema/top5", "train/loss_epoch"):
        assert key in metrics, key
    assert summary["monitor"] == "val_ema/top1" and summary["best_score"] == metrics["val_ema/top1"]
    # checkpoints hold plain containers only
    ckpt = torch.load(summary["best_checkpoint"], map_location="cpu", weights_only=True)
    last = torch.load(summary["last_checkpoint"], map_location="cpu", weights_only=True)
    assert isinstance(ckpt["hyper_parameters"]["model"], dict) and ckpt["hyper_parameters"]["model"]["name"] == "nat_digits"
    state = ckpt["state_dict"]
    raw = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    ema = {k[len("ema.module."):]: v for k, v in state.items() if k.startswith("ema.module.")}
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[k], ema[k]) for k in raw)
    assert last["epoch"] == 0 and last["global_step"] == 3
    # the learning rate was scaled by the global batch: 4e-3 * 16 / 64
    assert last["optimizer_states"][0]["param_groups"][0]["initial_lr"] == pytest.approx(1e-3)
    # exported weights load through timm's pretrained path and reproduce the checkpoint's model
    raw_file, ema_file = summary["exported"]
    x = torch.randn(3, 3, 32, 32)
    for file, weights in ((raw_file, raw), (ema_file, ema)):
        model = timm.create_model("nat_digits", pretrained=True, pretrained_cfg_overlay=dict(file=file)).eval()
        reference = timm.create_model("nat_digits").eval()
        reference.load_state_dict(weights)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    assert os.path.isfile(os.path.join(cfg.paths.output_dir, "summary.json"))
    assert glob.glob(os.path.join(cfg.paths.output_dir, "csv", "*", "metrics.csv"))


def _eval(root, *extra):
    cfg = compose_cfg("eval", [f"paths.root_dir={root}", "threads=1", "data.val_batch_size=64",
                               "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false", *extra])
    return cfg, evaluate(cfg)


def test_eval_reproduces_training_accuracy(trained_with_mixup_and_ema):
    root, _, summary = trained_with_mixup_and_ema
    ckpt, metrics = summary["best_checkpoint"], summary["metrics"]
    stem = os.path.join(root, "all_results")  # a shared results_file gathers one CSV row per evaluation
    cfg, auto = _eval(root, f"ckpt_path={ckpt}", f"results_file={stem}")  # auto: the EMA weights selected on
    assert auto["weights"] == "ema" and auto["top1"] == pytest.approx(metrics["val_ema/top1"], abs=1e-4)
    assert auto["top5"] == pytest.approx(metrics["val_ema/top5"], abs=1e-4)
    _, raw = _eval(root, f"ckpt_path={ckpt}", "weights=raw", f"results_file={stem}")
    assert raw["top1"] == pytest.approx(metrics["val/top1"], abs=1e-4)
    assert raw["top1_err"] == pytest.approx(100 - raw["top1"])
    exported_cfg, exported = _eval(root, f"model.pretrained_file={summary['exported'][0]}", f"results_file={stem}")
    assert exported["model"] == "nat_digits" and exported["top1"] == raw["top1"] and exported["weights"] == "pretrained"
    # timm validate-style files
    assert json.load(open(stem + ".json"))["top1"] == exported["top1"]
    rows = list(csv.DictReader(open(stem + ".csv")))
    assert tuple(rows[0]) == COLUMNS and len(rows) == 3
    # without results_file, every evaluation writes into a folder of its own
    _, again = _eval(root, f"ckpt_path={ckpt}", "weights=raw")
    own = glob.glob(os.path.join(root, "logs", "accuracy", "digits", "version_*", "results.json"))
    assert len(own) == 1 and json.load(open(own[0]))["top1"] == again["top1"]
    assert rows[0]["img_size"] == "32" and rows[0]["interpolation"] == "bilinear" and float(rows[0]["param_count"]) > 0


def test_checkpoint_of_another_model_is_named(trained_with_mixup_and_ema, tmp_path):
    _, _, summary = trained_with_mixup_and_ema
    ckpt = summary["best_checkpoint"]
    with pytest.raises(ValueError, match="holds a 'nat_digits' model, not model.name='nat_mini'"):
        _eval(tmp_path, f"ckpt_path={ckpt}", "model.name=nat_mini")
    with pytest.raises(ValueError, match="ckpt_path: the checkpoint was trained with model 'nat_digits'.*'resnet10t'"):
        _train(tmp_path, "model=timm", "model.name=resnet10t", f"ckpt_path={ckpt}")
    with pytest.raises(ValueError, match="holds weights of 'nat_digits', not of model.name='resnet10t'"):
        create_model(dict(name="resnet10t", pretrained_file=summary["exported"][0]), 10)
    with pytest.raises(ValueError, match="ckpt_path=last: no last.ckpt"):
        _train(tmp_path, "ckpt_path=last")


class KillAt(pl.Callback):
    """Test-only: SIGKILLs its own process at (epoch, batch), as a crash or preemption would."""

    def __init__(self, epoch: int, batch: int):
        self.epoch, self.batch = epoch, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


# mixup, EMA and drop path: every piece of state and randomness a resumed run must restore
RESUME = ["trainer.max_epochs=3", "task.module.mixup.mixup_alpha=0.8", "task.module.mixup.cutmix_alpha=1.0",
          "task.module.ema.enabled=true", "task.module.ema.decay=0.9", "model.drop_path_rate=0.1",
          "task.module.scheduler.warmup_epochs=1", "export=false"]


def test_killed_and_resumed_run_matches_uninterrupted(tmp_path):
    _, straight = _train(tmp_path / "straight", *RESUME)

    killed_root = tmp_path / "killed"
    cmd = [sys.executable, "train.py", "experiment=digits", *FAST, *RESUME, f"paths.root_dir={killed_root}",
           "+callbacks.kill._target_=tests.test_train.KillAt", "+callbacks.kill.epoch=2", "+callbacks.kill.batch=1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = glob.glob(str(killed_root / "**" / "last.ckpt"), recursive=True)
    assert len(last) == 1 and torch.load(last[0], weights_only=True)["epoch"] == 1

    _, resumed = _train(killed_root, *RESUME, "ckpt_path=last")
    assert resumed["global_step"] == straight["global_step"] == 9
    for key in ("val/top1", "val/loss", "val_ema/top1", "val_ema/loss", "train/loss_epoch"):
        assert resumed["metrics"][key] == straight["metrics"][key], key
    a = torch.load(straight["last_checkpoint"], weights_only=True)
    b = torch.load(resumed["last_checkpoint"], weights_only=True)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    assert a["optimizer_states"][0]["param_groups"][0]["lr"] == b["optimizer_states"][0]["param_groups"][0]["lr"]


def test_resume_with_default_callbacks_logs_throughput_at_any_log_interval(tmp_path):
    """ckpt_path=last with the default callbacks (throughput monitor included) and a log interval that does not
    divide the epoch (3 batches, every 2 steps): Lightning logs the rates at global steps 4 and 6 of the resumed
    run, 1 and 3 batches after its restart, so the monitor must read its clock on those batches too."""
    _train(tmp_path, "trainer.max_epochs=1", "trainer.log_every_n_steps=2", "export=false")
    cfg, resumed = _train(tmp_path, "trainer.max_epochs=2", "trainer.log_every_n_steps=2", "export=false",
                          "ckpt_path=last")
    assert resumed["global_step"] == 6
    rows = [row for path in glob.glob(os.path.join(cfg.paths.output_dir, "csv", "*", "metrics.csv"))
            for row in csv.DictReader(open(path)) if row.get("train/samples")]
    assert sorted(int(row["step"]) for row in rows) == [1, 3, 5]  # (Lightning writes step - 1) both runs' readings
    assert [float(row["train/batches"]) for row in rows if int(row["step"]) >= 3] == [1, 3]  # since the restart


def test_ddp_on_cpu_with_two_processes(tmp_path):
    cmd = [sys.executable, "train.py", "experiment=digits", *FAST, "trainer=ddp_cpu", "trainer.max_epochs=1",
           f"paths.root_dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (out_dir,) = glob.glob(str(tmp_path / "logs" / "classification" / "*" / "*"))  # one folder for both processes
    assert os.path.basename(out_dir) == "version_0"
    summary = json.load(open(os.path.join(out_dir, "summary.json")))
    assert summary["global_step"] == 3 and "val/top1" in summary["metrics"]
    log_text = proc.stdout + proc.stderr + open(os.path.join(out_dir, "train.log")).read()
    assert "global batch 32" in log_text  # 16 per process x 2 processes scales the learning rate
    # Lightning warns about every epoch-level value logged without sync_dist; the task's are synchronised
    assert "sync_dist" not in log_text, [line for line in log_text.splitlines() if "sync_dist" in line]
    ckpt = torch.load(summary["last_checkpoint"], weights_only=True)
    assert ckpt["optimizer_states"][0]["param_groups"][0]["initial_lr"] == pytest.approx(4e-3 * 32 / 64)


def test_gan_trains_under_ddp_on_cpu_without_strategy_override(tmp_path):
    """Each backward pass of a GAN step leaves one network without gradients: the task turns on DDP's
    unused-parameter detection itself, so plain trainer=ddp_cpu trains (D, R1 and G passes, two batches)."""
    cmd = [sys.executable, "train.py", "experiment=stylenat_skimage", "trainer=ddp_cpu", "data.batch_size=4",
           "task.module.max_kimg=0.016", "threads=1", "logger=csv", "callbacks.progress_bar=null", "export=false",
           f"paths.root_dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "find_unused_parameters=True" in proc.stdout + proc.stderr
    (out_dir,) = glob.glob(str(tmp_path / "logs" / "gan" / "*" / "*"))
    summary = json.load(open(os.path.join(out_dir, "summary.json")))
    ckpt = torch.load(summary["last_checkpoint"], weights_only=True)
    assert ckpt["kimg"] == pytest.approx(0.016)  # 2 batches x 4 images x 2 processes


@pytest.mark.parametrize("override, match", [
    ("task.module.optimizer.lr=-1", "task.module.optimizer.lr: must be > 0"),
    ("task.module.label_smoothing=1.0", "task.module.label_smoothing: must be < 1"),
    ("task.module.mixup.prob=1.5", "task.module.mixup.prob: must be <= 1"),
    ("task.module.ema.decay=1.0", "task.module.ema.decay: must be < 1"),
    ("+task.module.optimizer.lrr=1", r"task.module.optimizer: unknown keys \['lrr'\]"),
    ("model.drop_path_rate=1.5", r"model.drop_path_rate: must be in \[0, 1\)"),
    ("model.name=nat_minii", "model.name: 'nat_minii' is not a timm model name"),
    ("data.batch_size=0", "data.batch_size: must be >= 1"),
    ("task.module.scheduler.cooldown_epochs=-1", "task.module.scheduler.cooldown_epochs: must be >= 0"),
])
def test_out_of_range_config_values(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        _train(tmp_path, override, "trainer.max_epochs=2")


def test_trainer_value_of_the_wrong_type_names_its_key(tmp_path, monkeypatch):
    """An interpolation resolving to a string where the Trainer takes an integer fails naming the key, before
    the data and model are built (the Trainer accepted it and the run failed later with a TypeError)."""
    monkeypatch.setenv("TEST_TRAINER_EPOCHS", "/home/someone")
    with pytest.raises(ValueError, match=r"^trainer.max_epochs: expected an integer or null, got '/home/someone'"):
        _train(tmp_path, "trainer.max_epochs=${oc.env:TEST_TRAINER_EPOCHS}")
    with pytest.raises(ValueError, match=r"trainer.precision: expected .*'bf16-mixed'.*, got 'bf17'"):
        _eval(tmp_path, "trainer.precision=bf17")


def test_module_lr_scaling_and_weight_decay_groups():
    module = ClassificationModule(model=dict(name="nat_digits"), num_classes=10,
                                  optimizer=dict(lr=1e-3, lr_base_batch=1024, layer_decay=0.8))
    from timm.optim import create_optimizer_v2

    opt = create_optimizer_v2(module.model, opt="adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.8)
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    for name, p in module.model.named_parameters():
        if name.endswith(".rpb") or p.ndim <= 1:
            assert id(p) in no_decay, name
        else:
            assert id(p) not in no_decay, name
    assert len({g.get("lr_scale") for g in opt.param_groups}) > 2  # layer decay gives per-depth scales


@pytest.mark.parametrize("setting,mode", [("false", None), ("default", "default"), ("reduce-overhead", "reduce-overhead")])
def test_model_compile_switch_reaches_the_module(setting, mode, monkeypatch):
    """``model.compile=<mode>`` is the one switch: the task's module compiles its model in place with that mode's
    options plus the project's inductor options (the benchmark's), once the run's device is a CUDA one."""
    from namodels.speed import compile_options

    cfg = compose_cfg("train", [f"model.compile={setting}"])
    module_cfg = OmegaConf.to_container(cfg.task.module, resolve=True)
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    module = ClassificationModule(**{k: v for k, v in module_cfg.items() if not k.startswith("_")})
    module.compile_for(torch.device("cuda", 0))
    assert seen == ([dict(options=compile_options(mode))] if mode else [])
    assert module.hparams.compile == (mode or False)
    with pytest.raises(ValueError, match="compile"):
        ClassificationModule(**{**{k: v for k, v in module_cfg.items() if not k.startswith("_")}, "compile": "fastest"})



def test_image_size_below_the_model_minimum_names_data_img_size(tmp_path, trained_with_mixup_and_ema):
    """nat_digits' windows need 21 px inputs: a smaller data.img_size fails naming the key and the minimum, in
    train.py before data is loaded, and in eval.py."""
    with pytest.raises(ValueError, match=r"data.img_size: 16 px is below 21 px, the smallest input nat_digits"):
        _train(tmp_path, "data.img_size=16")
    _train(tmp_path, "data.img_size=21", "trainer.max_epochs=1", "trainer.limit_train_batches=1",
           "trainer.limit_val_batches=1", "export=false")
    ckpt = trained_with_mixup_and_ema[2]["best_checkpoint"]
    with pytest.raises(ValueError, match=r"data.img_size: 20 px is below 21 px"):
        _eval(tmp_path, f"ckpt_path={ckpt}", "data.img_size=20")


def test_recipe_checks_the_data_path_before_the_gpu_trainer(tmp_path):
    cfg = compose_cfg("train", ["experiment=nat_mini_in1k", f"data.root={tmp_path / 'missing'}",
                                f"paths.root_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"data.root: dataset root .*missing' does not exist"):
        fit(cfg)
    (tmp_path / "imagenet" / "train" / "n01").mkdir(parents=True)
    cfg = compose_cfg("train", ["experiment=nat_mini_in1k", f"data.root={tmp_path / 'imagenet'}",
                                f"paths.root_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"data.root: split folder .*val' does not exist"):
        fit(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_trainer_without_a_gpu_names_trainer_cpu(tmp_path):
    for split in ("train", "val"):
        (tmp_path / "imagenet" / split / "n01").mkdir(parents=True)
    cfg = compose_cfg("train", ["experiment=nat_mini_in1k", f"data.root={tmp_path / 'imagenet'}",
                                f"paths.root_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"trainer.accelerator: 'gpu' needs a CUDA GPU.*add trainer=cpu"):
        fit(cfg)


def test_misspelled_trainer_key_suggests_the_argument():
    from namodels.tasks.overrides import unknown_trainer_keys

    assert unknown_trainer_keys(["trainer.max_epochs=3", "trainer.strategy.static_graph=true", "trainer=gpu",
                                 "data.img_size=32", "-m", "+trainer.deterministic=true"]) == []
    (message,) = unknown_trainer_keys(["trainer.max_epoch=3"])
    assert message.startswith("trainer.max_epoch: not an argument of lightning.pytorch.Trainer; "
                              "did you mean trainer.max_epochs")
    assert "trainer.devices" in unknown_trainer_keys(["+trainer.devcies=2"])[0]
    proc = subprocess.run([sys.executable, "train.py", "trainer.max_epoch=3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "did you mean trainer.max_epochs" in proc.stderr, proc.stderr[-2000:]


def test_ddp_trainer_on_one_device_runs_without_the_ddp_wrapper(monkeypatch):
    """trainer=ddp (the GPU recipes) starts DDP only where there is more than one process to run."""
    from lightning.pytorch.strategies import DDPStrategy
    from namodels.utils.distributed import ddp_strategy, process_count

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert process_count(-1) == 1 and process_count("auto") == 1 and process_count(-1, num_nodes=2) == 2
    assert process_count("0,1") == 2 and process_count([3]) == 1 and process_count("4") == 4
    cfg = compose_cfg("train", ["experiment=nat_tiny_in1k"])
    assert get_method(cfg.trainer.strategy._target_) is ddp_strategy
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.trainer.strategy, resolve=True).items() if k != "_target_"}
    assert kwargs["devices"] == -1 and kwargs["num_nodes"] == 1
    assert ddp_strategy(**kwargs) == "auto"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    strategy = ddp_strategy(**kwargs)
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs == dict(
        find_unused_parameters=False, gradient_as_bucket_view=True, static_graph=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun / SLURM started the processes
    assert isinstance(ddp_strategy(**kwargs), DDPStrategy)
