"""What train.py does with a composed config: pick the run's folder, instantiate the task's module and
data module, the trainer (with atomic, plain-data checkpoint IO), callbacks and loggers, fit, export,
report.  Task-agnostic: a new task (GAN, video) plugs in through ``configs/task/<name>.yaml``
(``module`` and ``datamodule`` to instantiate, ``stage: fit``).  Optional hooks used here: the
module's ``data_config`` (handed to ``datamodule.use_model_defaults``), ``export_weights(directory, source)``
and ``skipped_files`` (unreadable input files, reported in the summary); the data module's ``check_source()``
(paths checked before the model and trainer are built).
"""
from __future__ import annotations

import json
import logging
import os
import time
import warnings

import lightning.pytorch as pl
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.plugins.io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from .checkpoints import AtomicCheckpointIO, load_checkpoint_file
from .console import drop_lightning_tips
from .models import check_input_size
from .overrides import check_trainer_values
from .run_dirs import assign_run_folder

log = logging.getLogger(__name__)


def build(node, **kwargs):
    """``hydra.utils.instantiate`` that lets a config error (ValueError) through as itself, not wrapped."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError):
            raise cause from None
        raise


def check_stage(cfg: DictConfig, stage: str, script: str) -> None:
    got = cfg.task.get("stage")
    if got != stage and not (stage == "eval" and cfg.task.get("eval") is not None):  # fit tasks may carry an eval
        other = "eval.py" if got == "eval" else "train.py"
        raise ValueError(f"task: task={cfg.task.get('name')!r} is a {got!r} task (run it with {other}); "
                         f"{script} runs {stage!r} tasks")


def check_task_inputs(cfg: DictConfig) -> None:
    """A task lists, under ``requires``, the config keys it reads from the model and data groups.
    Fail early with the fix (a matching experiment) instead of deep in interpolation or instantiation,
    e.g. ``train.py task=gan`` alone keeps the default digits classifier and data."""
    required = cfg.task.get("requires") or []
    missing = [key for key in required if OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is None]
    if missing:
        hint = cfg.task.get("example")
        raise ValueError(
            f"task: task={cfg.task.get('name')!r} needs {', '.join(missing)}, which model="
            f"{OmegaConf.select(cfg, 'model.name', default='?')!r} / data={OmegaConf.select(cfg, 'data.name', default='?')!r}"
            f" do not define" + (f"; use a matching recipe, e.g. {hint}" if hint else ""))


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiates every entry of a dict-of-configs group (callbacks, logger); ``null`` entries are off."""
    if not group:
        return []
    return [build(c) for c in group.values() if c is not None and "_target_" in c]


def check_accelerator(trainer_cfg: DictConfig) -> None:
    """A GPU trainer (trainer=gpu / ddp / fsdp, the ImageNet recipes) on a machine without CUDA fails naming the
    override that runs it on the CPU, instead of Lightning's "No supported gpu backend found"."""
    accelerator = str(trainer_cfg.get("accelerator") or "auto")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.accelerator: {accelerator!r} needs a CUDA GPU and torch sees none "
                         "(torch.cuda.is_available() is False); run on a GPU machine, or add trainer=cpu "
                         "(trainer=ddp_cpu for DDP on CPU processes)")


def trainer_plugins(trainer_cfg: DictConfig) -> list:
    """The trainer config's plugins plus :class:`AtomicCheckpointIO`, unless it names a CheckpointIO."""
    plugins = [build(p) if isinstance(p, DictConfig) and "_target_" in p else p
               for p in (trainer_cfg.get("plugins") or [])]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())
    return plugins


def resolve_ckpt_path(ckpt_path, callbacks) -> str | None:
    """``null`` (fresh run), ``last`` (this run folder's last.ckpt, see ``run_dirs``) or a path; a missing
    file is an error."""
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path == "last":
        dirs = [cb.dirpath for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        candidates = [os.path.join(d, "last.ckpt") for d in dirs]
        found = [c for c in candidates if os.path.isfile(c)]
        if not found:
            raise ValueError(f"ckpt_path=last: no last.ckpt in {dirs or 'any checkpoint folder'}; run without "
                             "ckpt_path first (same run_name) or give a checkpoint file")
        return found[0]
    path = os.path.expanduser(str(ckpt_path))
    if not os.path.isfile(path):
        raise ValueError(f"ckpt_path: {path!r} does not exist")
    return path


def route_lightning_logs() -> None:
    """Lightning's advertisement tips are dropped; under Hydra (root logger configured) Lightning's own console
    handler would print every line twice."""
    drop_lightning_tips()
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers = [h for h in logger.handlers if isinstance(h, logging.FileHandler)
                           or not isinstance(h, logging.StreamHandler)]
        logger.propagate = True
    warnings.filterwarnings("ignore", message=".*define a `flops_per_batch` attribute.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")


def _number(value):
    return float(value.item()) if isinstance(value, torch.Tensor) else value


def short_run_hint(trainer_cfg) -> str | None:
    """The line that tells a short run how to shorten its validation too: a whole number of training batches with
    validation left whole (a smoke run's ``trainer.limit_train_batches=2`` still validates every image)."""
    train = trainer_cfg.get("limit_train_batches")
    val = trainer_cfg.get("limit_val_batches", 1.0)
    if isinstance(train, int) and not isinstance(train, bool) and val in (None, 1.0) and not isinstance(val, int):
        return (f"trainer.limit_train_batches={train} shortens training only: every validation pass still runs "
                f"the whole validation split; add trainer.limit_val_batches={train} for a short run")
    return None


def fit(cfg: DictConfig) -> dict:
    """Runs a ``stage: fit`` task; returns the summary that is printed and written to summary.json."""
    import namodels  # noqa: F401  registers the project's timm models

    check_stage(cfg, "fit", "train.py")
    check_task_inputs(cfg)
    check_trainer_values(cfg.trainer)  # resolved values of the wrong type fail here, naming their key
    assign_run_folder(cfg)
    route_lightning_logs()
    started = time.time()
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build(cfg.task.datamodule)
    if hasattr(datamodule, "check_source"):  # a wrong data path fails before the model and trainer are built
        datamodule.check_source()
    check_accelerator(cfg.trainer)
    module = build(cfg.task.module)
    check_input_size(getattr(module, "model", None), OmegaConf.select(cfg, "data.img_size", default=None),
                     OmegaConf.select(cfg, "model.name", default=None))
    if hasattr(datamodule, "use_model_defaults") and hasattr(module, "data_config"):
        datamodule.use_model_defaults(module.data_config)
    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"))
    trainer: pl.Trainer = build(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                                plugins=trainer_plugins(cfg.trainer))
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), callbacks)
    if trainer.is_global_zero:
        log.info("output: %s", cfg.paths.output_dir)
        hint = short_run_hint(cfg.trainer)
        if hint:
            log.info(hint)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)

    summary = dict(
        task=cfg.task.name, model=cfg.model.get("name"), data=cfg.data.get("name"), epochs=trainer.current_epoch,
        global_step=trainer.global_step, seconds=round(time.time() - started, 1),
        metrics={k: _number(v) for k, v in sorted(trainer.callback_metrics.items())},
        skipped_images=len(getattr(module, "skipped_files", ())),
        skipped_files=sorted(getattr(module, "skipped_files", ())),
    )
    best_cb = next((cb for cb in trainer.checkpoint_callbacks if cb.monitor), None)
    last_cb = next((cb for cb in trainer.checkpoint_callbacks if not cb.monitor), None)
    if best_cb is not None:
        summary.update(best_checkpoint=best_cb.best_model_path or None, monitor=best_cb.monitor,
                       best_score=_number(best_cb.best_model_score))
    if last_cb is not None:
        summary.update(last_checkpoint=last_cb.best_model_path or last_cb.last_model_path or None)
    if trainer.is_global_zero:
        best = summary.get("best_checkpoint") or summary.get("last_checkpoint")
        if cfg.get("export") and best and hasattr(module, "export_weights"):
            module.load_state_dict(load_checkpoint_file(best)["state_dict"])
            summary["exported"] = module.export_weights(os.path.join(cfg.paths.output_dir, "export"), source=best)
        write_json(summary, os.path.join(cfg.paths.output_dir, "summary.json"))
        print_summary(summary)
    return summary


def evaluate(cfg: DictConfig):
    """What eval.py does: checks the task is an eval task, picks the run's folder, runs the task (a fit
    task's evaluation is its ``eval.run``, e.g. ``eval.py task=video``)."""
    check_stage(cfg, "eval", "eval.py")
    check_trainer_values(cfg.trainer)
    assign_run_folder(cfg)
    run = cfg.task.run if cfg.task.get("stage") == "eval" else cfg.task.eval.run
    return instantiate(run)(cfg)


def write_json(data: dict, path: str) -> None:
    """Writes ``path`` whole or not at all (temporary file beside it, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(partial, path)


def _format_metric(name: str, value: float) -> str:
    """Accuracy-like metrics (``top1``, ``top5``, ...) are percentages; losses and errors are not."""
    return f"{value:.2f}%" if "/top" in name else f"{value:.4g}"


def print_summary(summary: dict) -> None:
    metrics = summary["metrics"]
    lines = [f"finished {summary['task']} of {summary['model']} on {summary['data']}: "
             f"{summary['epochs']} epochs, {summary['global_step']} steps, {summary['seconds']} s"]
    shown = (k for k in metrics if k.startswith(("val/", "val_ema/")) and not k.endswith("/skipped_images"))
    for key in sorted(shown):
        lines.append(f"  final {key:<13} {_format_metric(key, metrics[key])}")
    if summary.get("best_score") is not None:
        monitor = summary["monitor"]
        lines.append(f"  best {monitor} {_format_metric(monitor, summary['best_score'])}  "
                     f"checkpoint: {summary['best_checkpoint']}")
    if summary.get("last_checkpoint"):
        lines.append(f"  last checkpoint: {summary['last_checkpoint']}")
    for path in summary.get("exported", []):
        lines.append(f"  exported weights: {path}")
    if summary.get("skipped_images"):
        lines.append(f"  unreadable images skipped: {summary['skipped_images']} files (listed in summary.json)")
    print("\n".join(lines), flush=True)


def config_to_plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
