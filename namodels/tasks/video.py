"""Video task: next-frame prediction (teacher forcing) or clip classification with the causal video NAT.

* ``objective='next_frame'``: the model sees the whole clip at once (causal attention) and output
  ``t`` is trained to be frame ``t + 1`` (teacher forcing), loss MSE or L1.  Validation reports the
  teacher-forced next-frame MSE, the MSE of copying the last frame (the trivial baseline) and their
  ratio, PSNR / SSIM (torchmetrics), and an autoregressive rollout: the first ``rollout.context``
  frames are streamed in (``model.rollout``, constant memory), the rest are generated from the
  model's own predictions and scored the same way (``val/rollout_*``).
* ``objective='classification'``: cross-entropy on the clip logits, top-1 accuracy (percent).

Optimizer: timm ``create_optimizer_v2`` (AdamW, no weight decay on norms/biases/``pos_embed``);
schedule: timm cosine with warmup, counted in optimizer steps (``trainer.max_steps`` or
``max_epochs``), stepped every update.
"""
from __future__ import annotations

import contextlib
import logging
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torchmetrics import MeanSquaredError
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

import ops

from ..data.video import check_data_config
from ..speed import CallingThreadBackward, optimizer_kwargs
from ..utils.checks import check_choice, check_range
from ..utils.distributed import SYNCED
from .clipping import clip_gradients
from .metrics import RunningMean, TopKAccuracy
from .options import merged_options, plain
from .models import create_model, export_weights

log = logging.getLogger(__name__)

OBJECTIVES = ("next_frame", "classification")
LOSSES = ("mse", "l1")
DEFAULT_OPTIMIZER = dict(name="adamw", lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999), eps=1e-8)
DEFAULT_SCHEDULER = dict(warmup_steps=100, warmup_lr=1e-6, min_lr=1e-5)
DEFAULT_ROLLOUT = dict(enabled=True, context=4, by_step=False)


def _frames(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, C, H, W] -> [B*T, C, H, W]`` in float32 (what the image metrics take)."""
    return x.flatten(0, 1).float()


class VideoTask(CallingThreadBackward, pl.LightningModule):
    """See the module docstring.

    Args:
        model: a ``model`` config (``name``, ``backend``, ``kwargs``, ...; see ``tasks/models.py``);
            ``in_chans`` and ``img_size`` default to the data's.
        data: the ``data`` config (channels, img_size, num_frames, num_classes).
        objective: 'next_frame' or 'classification'.
        loss: 'mse' or 'l1' (next-frame objective).
        optimizer, scheduler: overrides of ``DEFAULT_OPTIMIZER`` / ``DEFAULT_SCHEDULER``.
        rollout: ``enabled``, ``context`` (frames given before generating the rest of the clip) and
            ``by_step`` (also the rollout MSE of each generated frame, ``val/rollout_mse_step<k>``).
    """

    def __init__(self, model: dict, data: dict, objective: str = "next_frame", loss: str = "mse",
                 optimizer: dict | None = None, scheduler: dict | None = None, rollout: dict | None = None,
                 seed: int = 0):
        super().__init__()
        model_cfg, data_cfg = dict(plain(model)), check_data_config(plain(data))
        check_choice("task.module.objective", objective, OBJECTIVES)
        check_choice("task.module.loss", loss, LOSSES)
        opt = merged_options("task.module.optimizer", DEFAULT_OPTIMIZER, optimizer)
        sched = merged_options("task.module.scheduler", DEFAULT_SCHEDULER, scheduler)
        roll = merged_options("task.module.rollout", DEFAULT_ROLLOUT, rollout)
        check_range("task.module.optimizer.lr", opt["lr"], 0, low_open=True)
        check_range("task.module.optimizer.weight_decay", opt["weight_decay"], 0)
        check_range("task.module.scheduler.warmup_steps", sched["warmup_steps"], 0, integer=True)
        check_range("task.module.rollout.context", roll["context"], 1, data_cfg["num_frames"] - 1, integer=True)
        num_classes = int(data_cfg["num_classes"]) if objective == "classification" else 0
        if objective == "classification":
            check_range("data.num_classes", num_classes, 1, integer=True)
        self.save_hyperparameters(dict(model=model_cfg, data=data_cfg, objective=objective, loss=loss,
                                       optimizer=opt, scheduler=sched, rollout=roll, seed=int(seed)))
        kwargs = dict(model_cfg.get("kwargs") or {})
        kwargs.setdefault("in_chans", data_cfg["channels"])
        kwargs.setdefault("img_size", data_cfg["img_size"])
        self.backend = model_cfg.get("backend")
        self.model = create_model({**model_cfg, "kwargs": kwargs}, num_classes)
        if not hasattr(self.model, "init_stream"):
            raise ValueError(f"model.name: {model_cfg.get('name')!r} is not a streaming video model (video_nat_*)")
        self.num_classes = num_classes
        # train/loss_epoch: the epoch's mean over every process (torchmetrics), synchronised once per epoch
        self.train_loss_mean = RunningMean()
        if objective == "next_frame":
            self.val_metrics = torch.nn.ModuleDict({
                "mse": MeanSquaredError(), "copy_mse": MeanSquaredError(),
                "psnr": PeakSignalNoiseRatio(data_range=1.0), "ssim": StructuralSimilarityIndexMeasure(data_range=1.0),
                "rollout_mse": MeanSquaredError(), "rollout_psnr": PeakSignalNoiseRatio(data_range=1.0),
                "rollout_ssim": StructuralSimilarityIndexMeasure(data_range=1.0),
            })
            if roll["enabled"] and roll["by_step"]:  # error growth over the generated frames (eval.py task=video)
                for k in range(1, data_cfg["num_frames"] - roll["context"] + 1):
                    self.val_metrics[f"rollout_mse_step{k}"] = MeanSquaredError()
        else:
            self.val_metrics = torch.nn.ModuleDict({
                "top1": TopKAccuracy(1), "loss": RunningMean(),
            })

    # ---- forward ---------------------------------------------------------------------------------
    def _backend(self):
        return ops.use_backend(self.backend) if self.backend is not None else contextlib.nullcontext()

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        with self._backend():
            return self.model(clips)

    def frame_loss(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred = pred.float()
        return F.mse_loss(pred, target) if self.hparams.loss == "mse" else F.l1_loss(pred, target)

    # ---- training ----------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        clips, labels = batch
        if self.hparams.objective == "next_frame":
            with self._backend():
                pred = self.model.predict_next_frames(clips)
            loss = self.frame_loss(pred[:, :-1], clips[:, 1:])  # teacher forcing: output t -> frame t + 1
        else:
            with self._backend():
                logits = self.model.classify(clips)
            loss = F.cross_entropy(logits.float(), labels)
        self.train_loss_mean.update(loss.detach(), weight=clips.shape[0])
        self.log("train/loss_step", loss, on_step=True, on_epoch=False, batch_size=clips.shape[0])
        return loss

    def on_train_epoch_end(self) -> None:
        if self.trainer.num_training_batches:  # the same on every process, so all compute (a collective) and log
            self.log("train/loss_epoch", self.train_loss_mean.compute(), **SYNCED)
        self.train_loss_mean.reset()

    # ---- validation --------------------------------------------------------------------------------
    def validation_step(self, batch, batch_idx):
        clips, labels = batch
        m = self.val_metrics
        if self.hparams.objective == "classification":
            with self._backend():
                logits = self.model.classify(clips).float()
            m["top1"].update(logits, labels)
            m["loss"].update(F.cross_entropy(logits, labels), weight=labels.shape[0])
            return
        with self._backend():
            pred = self.model.predict_next_frames(clips)[:, :-1].float().contiguous()
        target = clips[:, 1:].float().contiguous()
        m["mse"].update(pred, target)
        m["copy_mse"].update(clips[:, :-1].float().contiguous(), target)
        m["psnr"].update(_frames(pred.clamp(0, 1)), _frames(target))
        m["ssim"].update(_frames(pred.clamp(0, 1)), _frames(target))
        if self.hparams.rollout["enabled"]:
            context = self.hparams.rollout["context"]
            with self._backend():
                generated = self.model.rollout(clips[:, :context], clips.shape[1] - context).float().contiguous()
            future = clips[:, context:].float().contiguous()
            m["rollout_mse"].update(generated, future)
            m["rollout_psnr"].update(_frames(generated.clamp(0, 1)), _frames(future))
            m["rollout_ssim"].update(_frames(generated.clamp(0, 1)), _frames(future))
            for k in range(1, generated.shape[1] + 1):
                if f"rollout_mse_step{k}" in m:
                    m[f"rollout_mse_step{k}"].update(generated[:, k - 1].contiguous(), future[:, k - 1].contiguous())

    def on_validation_epoch_end(self) -> None:
        values = {}
        for name, metric in self.val_metrics.items():
            if metric.update_count == 0:  # e.g. rollout disabled
                continue
            values[name] = metric.compute()
            metric.reset()
        if self.hparams.objective == "classification":
            self.log("val/top1", values["top1"] * 100, prog_bar=True, **SYNCED)
            self.log("val/loss", values["loss"], **SYNCED)
            return
        values["mse_ratio"] = values["mse"] / values["copy_mse"].clamp_min(1e-12)
        for name, value in values.items():
            self.log(f"val/{name}", value, prog_bar=name in ("mse", "mse_ratio"), **SYNCED)

    @torch.no_grad()
    def sample_figures(self, batch, outputs=None, max_clips: int = 4) -> dict:
        """``{"predictions": figure}``: for the batch's first clips, the true frames beside the frames the
        model generates from the first ``rollout.context`` of them (:func:`namodels.tasks.samples.frame_strip`;
        for :class:`namodels.tasks.samples.SampleImages` and ``eval.py task=video``).  Next-frame objective only."""
        from .samples import frame_strip

        if self.hparams.objective != "next_frame":
            return {}
        clips = batch[0][:max_clips]
        context = min(self.hparams.rollout["context"], clips.shape[1] - 1)
        was_training = self.training
        self.eval()
        try:
            with self._backend():
                generated = self.model.rollout(clips[:, :context].to(self.device), clips.shape[1] - context)
        finally:
            self.train(was_training)
        title = f"{self.hparams.model['name']}: {context} frames given, {clips.shape[1] - context} generated"
        return {"predictions": frame_strip(clips.float().cpu(), generated.float().clamp(0, 1).cpu(), context, title)}

    # ---- optimisation ------------------------------------------------------------------------------
    def configure_optimizers(self):
        opt, sched = self.hparams.optimizer, self.hparams.scheduler
        kwargs = dict(betas=tuple(opt["betas"]), eps=opt["eps"]) if "adam" in opt["name"].lower() else {}
        optimizer = create_optimizer_v2(self.model, opt=opt["name"], lr=opt["lr"], weight_decay=opt["weight_decay"],
                                        **kwargs, **optimizer_kwargs(opt["name"], self.device))
        total = int(self.trainer.estimated_stepping_batches)
        if total < 1 or total == float("inf"):
            raise ValueError("trainer.max_steps: the step-based schedule needs trainer.max_steps or max_epochs")
        warmup = min(sched["warmup_steps"], max(total - 1, 0))
        scheduler = CosineLRScheduler(optimizer, t_initial=total, lr_min=sched["min_lr"], warmup_t=warmup,
                                      warmup_lr_init=sched["warmup_lr"], t_in_epochs=False)
        log.info("video task: lr %.3g, %d optimizer steps (%d warmup)", opt["lr"], total, warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # the fused AdamW unscales inside its step, which Lightning's mixed precision refuses to clip for
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        scheduler.step_update(num_updates=self.global_step)

    # ---- checkpoints and export --------------------------------------------------------------------
    def export_weights(self, directory: str, source: str = "") -> list[str]:
        """Writes ``<model>.safetensors``, loadable with ``timm.create_model(name, pretrained=True,
        pretrained_cfg_overlay=dict(file=path), in_chans=..., img_size=...)``."""
        name = self.hparams.model["name"]
        path = os.path.join(directory, name.replace("/", "_") + ".safetensors")
        return [export_weights(self.model.state_dict(), path, model_name=name, num_classes=self.num_classes,
                               source=source)]
