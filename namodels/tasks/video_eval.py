"""``eval.py task=video ckpt_path=<video checkpoint>``: scores a checkpoint of the video task.

The model, its data config and its objective come from the checkpoint's hyper-parameters.  The data is
the checkpoint's (the same held-out validation clips, from the training run's seed) unless ``data=``
names a video data set (a config with ``num_frames``), e.g. ``data=moving_digits data.num_frames=16`` to
roll out further than the training clips.  The scores are :class:`namodels.tasks.video.VideoTask`'s
validation metrics on those clips:

* next-frame objective: teacher-forced next-frame ``mse`` with ``copy_mse`` (copying the last frame) and
  their ``mse_ratio``, ``psnr`` and ``ssim`` (torchmetrics, data range 1); the multi-step rollout
  (``task.eval.context`` frames given, default the run's, the rest generated one by one from the model's
  own output): ``rollout_mse``, ``rollout_psnr``, ``rollout_ssim`` over all generated frames and
  ``rollout_mse_by_step`` (frame 1, 2, ... after the context);
* classification objective: ``top1`` (percent) and ``loss``.

Writes ``results.json`` (and a row of ``results.csv``) and ``predictions.png`` (true vs generated frames of
the first clips) into the run folder, ``logs/video/<task.eval.run_name>/version_N``.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os

import torch
from omegaconf import DictConfig

from .checkpoints import load_checkpoint_file
from .models import load_weights
from .options import plain

log = logging.getLogger(__name__)

COLUMNS = ("model", "objective", "data", "clips", "frames", "context", "mse", "copy_mse", "mse_ratio", "psnr",
           "ssim", "rollout_mse", "rollout_psnr", "rollout_ssim", "rollout_mse_by_step", "top1", "loss",
           "param_count", "checkpoint")


def load_video_checkpoint(path: str) -> tuple[dict, dict]:
    """(checkpoint, hyper-parameters) of a video-task checkpoint; anything else is a ``ValueError`` naming
    the evaluation that fits it."""
    if not os.path.isfile(path):
        raise ValueError(f"ckpt_path: {path!r} does not exist")
    checkpoint = load_checkpoint_file(path)
    hp = checkpoint.get("hyper_parameters") or {}
    if "objective" not in hp or "state_dict" not in checkpoint or not (hp.get("model") or {}).get("name"):
        raise ValueError(f"ckpt_path: {path!r} is not a checkpoint of the video task (train.py task=video, e.g. "
                         f"experiment=video_moving_digits); a classification checkpoint is evaluated by eval.py "
                         f"ckpt_path=... (task=accuracy)")
    return checkpoint, hp


def _data_config(cfg: DictConfig, hp: dict) -> tuple[dict, int]:
    """(data config, seed): ``data=`` when it is a video data set, else the checkpoint's with its seed."""
    given = plain(cfg.get("data")) or {}
    if given.get("num_frames") is not None:
        return dict(given), int(cfg.get("seed", 0))
    return dict(hp["data"]), int(hp.get("seed", cfg.get("seed", 0)))


def evaluate(cfg: DictConfig) -> dict:
    import namodels  # noqa: F401  registers the project's timm models

    from ..data.video import VideoDataModule
    from .runner import build, instantiate_group, route_lightning_logs, write_json
    from .run_dirs import assign_run_folder
    from .samples import SampleImages
    from .video import VideoTask

    assign_run_folder(cfg)  # a no-op under eval.py, which chose it already
    route_lightning_logs()
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    ckpt_path = cfg.get("ckpt_path")
    if not ckpt_path:
        raise ValueError("ckpt_path: eval.py task=video scores a checkpoint of the video task; give "
                         "ckpt_path=logs/video/<run>/version_N/checkpoints/<file>.ckpt")
    if cfg.get("weights", "auto") not in ("auto", "raw"):
        raise ValueError(f"weights: the video task keeps no EMA weights; use weights=auto or raw, got {cfg.weights!r}")
    path = os.path.expanduser(str(ckpt_path))
    checkpoint, hp = load_video_checkpoint(path)
    model_cfg = {**hp["model"], "pretrained": False, "pretrained_file": None}
    given = plain(cfg.get("model")) or {}
    if given.get("name") and given["name"] != model_cfg["name"]:
        raise ValueError(f"ckpt_path: {path!r} holds a {model_cfg['name']!r} model, not model.name={given['name']!r}")
    if given.get("backend") is not None:
        model_cfg["backend"] = given["backend"]
    data_cfg, seed = _data_config(cfg, hp)
    options = plain(cfg.task.get("eval")) or {}
    context = int(options.get("context") or hp["rollout"]["context"])
    module = VideoTask(model_cfg, data_cfg, objective=hp["objective"], loss=hp.get("loss", "mse"),
                       rollout=dict(enabled=True, context=context, by_step=True), seed=seed)
    prefix = "model."
    load_weights(module.model, {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)},
                 model_name=model_cfg["name"], source=f"ckpt_path {path}")
    datamodule = VideoDataModule(module.hparams.data, seed=seed)
    samples = SampleImages(dirpath=cfg.paths.output_dir, num_samples=4, tensorboard=False)
    trainer = build(cfg.trainer, logger=False, callbacks=instantiate_group(cfg.get("callbacks")) + [samples])
    metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]

    values = {k.split("/", 1)[1]: float(v) for k, v in metrics.items() if k.startswith("val/")}
    steps = sorted((int(k[len("rollout_mse_step"):]), v) for k, v in values.items() if k.startswith("rollout_mse_step"))
    data = module.hparams.data
    result = dict(
        model=model_cfg["name"], objective=hp["objective"], data=data.get("name") or data.get("source"),
        clips=len(datamodule.val_set), frames=int(data["num_frames"]), context=context,
        **{k: round(values[k], 6) for k in COLUMNS if k in values},  # in the table's column order
        param_count=round(sum(p.numel() for p in module.model.parameters()) / 1e6, 3), checkpoint=path,
    )
    if steps:
        result["rollout_mse_by_step"] = [round(v, 6) for _, v in steps]
    if samples.written:
        result["predictions"] = samples.written[0]
    if trainer.is_global_zero:
        stem = os.path.splitext(os.path.expanduser(str(cfg.get("results_file") or
                                                        os.path.join(cfg.paths.output_dir, "results"))))[0]
        write_json(result, stem + ".json")
        append_csv_row(stem + ".csv", result)
        print(json.dumps(result, indent=2), flush=True)
    return result


def append_csv_row(path: str, result: dict) -> None:
    """Adds a row to ``path`` (header ``COLUMNS``), rewriting the file through a temporary one beside it."""
    old = open(path).read() if os.path.isfile(path) else ""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(COLUMNS), extrasaction="ignore")
    if not old:
        writer.writeheader()
    row = {k: (" ".join(str(x) for x in v) if isinstance(v, list) else v) for k, v in result.items()}
    writer.writerow(row)
    partial = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.partial")
    with open(partial, "w", newline="") as f:
        f.write(old + buffer.getvalue())
    os.replace(partial, path)
