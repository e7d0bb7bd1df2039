"""eval.py tasks (``configs/task/<name>.yaml`` with ``stage: eval`` and ``run: {_target_: ..., _partial_: true}``).

``accuracy``: top-1 / top-5 / loss of a training checkpoint (raw or EMA weights) or of timm weights
(``model.pretrained=true`` or ``model.pretrained_file=...``) on the ``data`` validation split.  Results
are written as JSON and CSV with timm ``validate.py``'s columns (top1, top1_err, top5, top5_err,
param_count [M], img_size, crop_pct, interpolation) plus loss, weights and checkpoint.
"""
from __future__ import annotations

import csv
import json
import logging
import os

import torch
from omegaconf import DictConfig, OmegaConf

from ..utils.checks import check_choice
from .checkpoints import load_checkpoint_file
from .run_dirs import assign_run_folder
from .runner import build, check_accelerator, instantiate_group, route_lightning_logs
from .models import check_input_size, check_model_name, file_metadata, load_weights, META_MODEL

log = logging.getLogger(__name__)

COLUMNS = ("model", "top1", "top1_err", "top5", "top5_err", "param_count", "img_size", "crop_pct",
           "interpolation", "loss", "weights", "checkpoint", "num_images")


def _plain(cfg):
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg or {})


def _monitored_weights(checkpoint: dict) -> str:
    """'ema' if the run's ModelCheckpoint selected on EMA metrics, else 'raw'."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if "ModelCheckpoint" in str(key) and str(state.get("monitor") or "").startswith("val_ema"):
            return "ema"
    return "raw"


def load_checkpoint_model(path: str, model_cfg: dict, weights: str, num_classes: int):
    """(model config, state dict, weights used) from a Lightning checkpoint of the classification task."""
    if not os.path.isfile(path):
        raise ValueError(f"ckpt_path: {path!r} does not exist")
    checkpoint = load_checkpoint_file(path)
    hp = checkpoint.get("hyper_parameters") or {}
    if "objective" in hp:  # VideoTask's hyper-parameters: no classifier of data.num_classes to load into
        raise ValueError(f"ckpt_path: {path!r} is a checkpoint of the video task ({hp['objective']} objective); "
                         f"evaluate it with: python eval.py task=video ckpt_path={path}")
    saved = dict(hp.get("model") or {})
    if "name" not in saved or "state_dict" not in checkpoint:
        raise ValueError(f"ckpt_path: {path!r} is not a classification checkpoint of train.py "
                         f"(keys: {sorted(checkpoint)[:8]})")
    if model_cfg.get("name") and model_cfg["name"] != saved["name"]:
        raise ValueError(f"ckpt_path: {path!r} holds a {saved['name']!r} model, not model.name={model_cfg['name']!r}")
    if hp.get("num_classes") not in (None, num_classes):
        raise ValueError(f"data.num_classes: the checkpoint's model has {hp['num_classes']} classes, the data "
                         f"config {num_classes}")
    state = checkpoint["state_dict"]
    if weights == "auto":
        weights = _monitored_weights(checkpoint)
    prefix = {"raw": "model.", "ema": "ema.module."}[weights]
    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not sub:
        raise ValueError(f"weights: {weights!r} requested but {path!r} has no {prefix}* weights "
                         f"(EMA was {'on' if any(k.startswith('ema.') for k in state) else 'off'} in training)")
    # our overrides (e.g. backend) on top of what the checkpoint was trained with; never re-download
    merged = {**saved, "pretrained": False, "pretrained_file": None,
              "kwargs": {**(saved.get("kwargs") or {}), **(model_cfg.get("kwargs") or {})}}
    if model_cfg.get("backend") is not None:
        merged["backend"] = model_cfg["backend"]
    return merged, sub, weights


def accuracy(cfg: DictConfig) -> dict:
    import namodels  # noqa: F401  registers the project's timm models

    from .classification import ClassificationModule

    assign_run_folder(cfg)  # this evaluation's own folder (a no-op under eval.py, which chose it already)
    route_lightning_logs()
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    model_cfg = _plain(cfg.model)
    data_cfg = _plain(cfg.data)
    weights = check_choice("weights", cfg.get("weights", "auto"), ("auto", "raw", "ema"))
    num_classes = int(data_cfg["num_classes"])
    ckpt_path = cfg.get("ckpt_path")
    state = None
    if ckpt_path:
        model_cfg, state, weights = load_checkpoint_model(os.path.expanduser(str(ckpt_path)), model_cfg, weights,
                                                          num_classes)
    else:
        file = model_cfg.get("pretrained_file")
        if not model_cfg.get("name") and file:
            model_cfg["name"] = file_metadata(os.path.expanduser(str(file))).get(META_MODEL)
        if not model_cfg.get("name"):
            raise ValueError("model.name: give a checkpoint (ckpt_path=...) or a model (model.name=... with "
                             "model.pretrained=true or model.pretrained_file=...)")
        check_model_name(model_cfg["name"])
        if not (model_cfg.get("pretrained") or file):
            raise ValueError("ckpt_path: nothing to evaluate; give ckpt_path=..., model.pretrained_file=... "
                             "or model.pretrained=true")
        weights = "pretrained"

    module = ClassificationModule(model=model_cfg, num_classes=num_classes)
    check_input_size(module.model, data_cfg.get("img_size"), model_cfg["name"])
    if state is not None:
        load_weights(module.model, state, model_name=model_cfg["name"], source=f"ckpt_path {ckpt_path}")
    datamodule = build(cfg.task.datamodule)
    datamodule.check_source()
    datamodule.use_model_defaults(module.data_config)
    check_accelerator(cfg.trainer)
    trainer = build(cfg.trainer, logger=False, callbacks=instantiate_group(cfg.get("callbacks")))
    metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    settings = datamodule.eval_settings()
    top1, top5 = float(metrics["val/top1"]), float(metrics["val/top5"])
    result = dict(
        model=model_cfg["name"], top1=round(top1, 4), top1_err=round(100 - top1, 4), top5=round(top5, 4),
        top5_err=round(100 - top5, 4), param_count=round(sum(p.numel() for p in module.model.parameters()) / 1e6, 2),
        img_size=settings["img_size"], crop_pct=settings["crop_pct"], interpolation=settings["interpolation"],
        loss=round(float(metrics["val/loss"]), 6), weights=weights, checkpoint=str(ckpt_path or model_cfg.get(
            "pretrained_file") or "timm"), num_images=len(datamodule.val_set),
    )
    if trainer.is_global_zero:
        write_results(result, cfg.get("results_file") or os.path.join(cfg.paths.output_dir, "results"))
        print(json.dumps(result, indent=2), flush=True)
    return result


def write_results(result: dict, stem: str) -> None:
    """``<stem>.json`` and ``<stem>.csv`` (one header row, one row per evaluation, appended)."""
    stem = os.path.splitext(os.path.expanduser(str(stem)))[0]
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    new = not os.path.isfile(stem + ".csv")
    with open(stem + ".csv", "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        if new:
            writer.writeheader()
        writer.writerow({k: result.get(k) for k in COLUMNS})
    log.info("results written to %s.json / .csv", stem)
