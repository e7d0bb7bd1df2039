"""Image classification as a LightningModule, built from timm parts (the NAT / DiNAT ImageNet recipe).

* model: any timm name (``namodels.tasks.models.create_model``); NA models get ``model.backend`` and
  every forward runs inside ``ops.use_backend(model.backend)``;
* loss: timm ``Mixup``/CutMix with ``SoftTargetCrossEntropy`` (label smoothing folded into the mixed
  targets), else cross-entropy with label smoothing;
* optimizer: timm ``create_optimizer_v2`` (no weight decay on norms, biases and what the model's
  ``no_weight_decay()`` names, e.g. relative positional biases; optional layer decay); the learning
  rate is ``optimizer.lr * global_batch / optimizer.lr_base_batch`` (linear scaling rule);
* schedule: timm cosine (or any ``create_scheduler_v2`` name) with warmup, updated every optimizer step;
* EMA of the weights (timm ``ModelEmaV3``), validated beside the raw model (``val/*`` and ``val_ema/*``);
* metrics: top-1 / top-5 (percent) and loss, as torchmetrics metrics that never wait for the GPU (``.metrics``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import random

import lightning.pytorch as pl
import numpy as np
import torch
from timm.data import Mixup, resolve_model_data_config
from timm.data.mixup import mixup_target
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch import nn
from torchmetrics import MetricCollection

import ops

from ..data.datamodule import epoch_seed
from ..data.decoding import UnreadableFiles
from ..speed import CallingThreadBackward, compile_mode, compile_options, optimizer_kwargs
from ..utils.checks import check_choice, check_range
from ..utils.distributed import SYNCED
from .clipping import clip_gradients
from .metrics import RunningMean, TopKAccuracy
from .models import create_model, export_weights
from .options import merged_options, plain

log = logging.getLogger(__name__)

DEFAULT_OPTIMIZER = dict(name="adamw", lr=1e-3, lr_base_batch=1024, lr_scaling="linear", weight_decay=0.05,
                         betas=(0.9, 0.999), eps=1e-8, momentum=0.9, layer_decay=None)
DEFAULT_SCHEDULER = dict(name="cosine", warmup_epochs=20, warmup_lr=1e-6, min_lr=5e-6, cooldown_epochs=0,
                         warmup_prefix=False)
DEFAULT_MIXUP = dict(mixup_alpha=0.0, cutmix_alpha=0.0, cutmix_minmax=None, prob=1.0, switch_prob=0.5,
                     mode="batch")
DEFAULT_EMA = dict(enabled=False, decay=0.9998, warmup=False)


def batch_size(batch) -> int:
    """Samples in a batch (for Lightning's ThroughputMonitor); 0 when every file of it was unreadable."""
    return 0 if batch is None or batch[0] is None else int(batch[0].shape[0])


def schedule_epochs(sched: dict, max_epochs) -> tuple[int, float, int]:
    """(schedule epochs, warm-up epochs, cooldown epochs) of the learning-rate schedule inside
    ``trainer.max_epochs``.

    A short run of a recipe (``trainer.max_epochs=1`` with the ImageNet recipe's 10 cooldown and 20 warm-up
    epochs) adapts, with a warning naming each key it shortens: cooldown epochs that leave no schedule epoch
    are cut to half the run (rounded down), then a warm-up that would fill the whole schedule is cut to half
    the schedule.
    """
    if max_epochs is None or max_epochs < 1:
        raise ValueError(f"trainer.max_epochs: the epoch-based schedule needs max_epochs >= 1, got {max_epochs}")
    cooldown = sched["cooldown_epochs"]
    if max_epochs - cooldown < 1:
        log.warning("task.module.scheduler.cooldown_epochs=%s does not fit trainer.max_epochs=%d: cooling down "
                    "for %d epochs instead (set task.module.scheduler.cooldown_epochs to choose)", cooldown,
                    max_epochs, max_epochs // 2)
        cooldown = max_epochs // 2
    epochs = max_epochs - cooldown
    warmup = sched["warmup_epochs"]
    if warmup >= epochs:
        log.warning("task.module.scheduler.warmup_epochs=%s does not fit a %d-epoch schedule "
                    "(trainer.max_epochs=%d): warming up for %.3g epochs instead (set "
                    "task.module.scheduler.warmup_epochs to choose)", warmup, epochs, max_epochs, epochs / 2)
        warmup = epochs / 2
    return epochs, warmup, cooldown


class ClassificationModule(CallingThreadBackward, pl.LightningModule):
    """Supervised image classification with any timm model (see the module docstring)."""

    def __init__(self, model: dict, num_classes: int, optimizer: dict | None = None,
                 scheduler: dict | None = None, mixup: dict | None = None, label_smoothing: float = 0.0,
                 ema: dict | None = None, compile: bool | str = False, seed: int = 0, data: dict | None = None):
        super().__init__()
        check_range("data.num_classes", num_classes, 1, integer=True)
        model_cfg = dict(plain(model))
        opt = merged_options("task.module.optimizer", DEFAULT_OPTIMIZER, optimizer)
        sched = merged_options("task.module.scheduler", DEFAULT_SCHEDULER, scheduler)
        mix = merged_options("task.module.mixup", DEFAULT_MIXUP, mixup)
        ema_cfg = merged_options("task.module.ema", DEFAULT_EMA, ema)
        self._check(opt, sched, mix, ema_cfg, label_smoothing)
        # Plain containers only: checkpoints stay loadable with torch.load(weights_only=True).
        self.save_hyperparameters(dict(
            model=model_cfg, num_classes=int(num_classes), optimizer=opt, scheduler=sched, mixup=mix,
            label_smoothing=float(label_smoothing), ema=ema_cfg, compile=compile_mode(compile) or False,
            seed=int(seed),
            data=plain(data),
        ))
        self.backend = model_cfg.get("backend")
        self.model = create_model(model_cfg, int(num_classes))
        self.data_config = resolve_model_data_config(self.model)
        self.ema = ModelEmaV3(self.model, decay=ema_cfg["decay"], use_warmup=ema_cfg["warmup"]) \
            if ema_cfg["enabled"] else None
        self._compile = compile_mode(compile)  # applied in setup, once the run's device is known

        self.mixup_fn = None
        if mix["mixup_alpha"] > 0 or mix["cutmix_alpha"] > 0 or mix["cutmix_minmax"] is not None:
            self.mixup_fn = Mixup(
                mixup_alpha=mix["mixup_alpha"], cutmix_alpha=mix["cutmix_alpha"], cutmix_minmax=mix["cutmix_minmax"],
                prob=mix["prob"], switch_prob=mix["switch_prob"], mode=mix["mode"],
                label_smoothing=label_smoothing, num_classes=int(num_classes),
            )
            self.train_loss = SoftTargetCrossEntropy()
        else:
            self.train_loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.eval_loss = nn.CrossEntropyLoss()
        # train/loss_epoch: the epoch's mean over every process (torchmetrics), synchronised once per epoch
        self.train_loss_mean = RunningMean()
        top5 = min(5, int(num_classes))
        self.val_metrics = nn.ModuleDict({
            prefix: MetricCollection({
                "top1": TopKAccuracy(1),
                "top5": TopKAccuracy(top5),
                "loss": RunningMean(),
            }) for prefix in (("val", "val_ema") if self.ema is not None else ("val",))
        })
        self._last_ema_step = None
        self.unreadable = UnreadableFiles()

    @staticmethod
    def _check(opt, sched, mix, ema, label_smoothing):
        p = "task.module"
        check_range(f"{p}.optimizer.lr", opt["lr"], 0, low_open=True)
        check_range(f"{p}.optimizer.lr_base_batch", opt["lr_base_batch"], 1, integer=True)
        check_choice(f"{p}.optimizer.lr_scaling", opt["lr_scaling"], ("linear", "none"))
        check_range(f"{p}.optimizer.weight_decay", opt["weight_decay"], 0)
        check_range(f"{p}.optimizer.layer_decay", opt["layer_decay"], 0, 1, low_open=True, allow_none=True)
        check_range(f"{p}.scheduler.warmup_epochs", sched["warmup_epochs"], 0)
        check_range(f"{p}.scheduler.cooldown_epochs", sched["cooldown_epochs"], 0, integer=True)
        check_range(f"{p}.scheduler.warmup_lr", sched["warmup_lr"], 0)
        check_range(f"{p}.scheduler.min_lr", sched["min_lr"], 0)
        for key in ("mixup_alpha", "cutmix_alpha"):
            check_range(f"{p}.mixup.{key}", mix[key], 0)
        for key in ("prob", "switch_prob"):
            check_range(f"{p}.mixup.{key}", mix[key], 0, 1)
        check_choice(f"{p}.mixup.mode", mix["mode"], ("batch", "pair", "elem"))
        check_range(f"{p}.label_smoothing", label_smoothing, 0, 1, high_open=True)
        check_range(f"{p}.ema.decay", ema["decay"], 0, 1, low_open=True, high_open=True)

    def setup(self, stage: str) -> None:
        from lightning.pytorch.strategies import FSDPStrategy

        if self.ema is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            raise ValueError("task.module.ema.enabled: the weight EMA is not supported with trainer=fsdp "
                             "(it would be sharded with the model); use trainer=ddp or disable the EMA")
        self.compile_for(self.trainer.strategy.root_device)

    def compile_for(self, device: torch.device) -> bool:
        """Compiles the model in place (parameter names and checkpoints unchanged) in ``model.compile``'s mode
        when the run trains on a CUDA device; returns whether it did.  Called by ``setup``, once.

        On any other device the model runs eagerly and one log line names ``model.compile``: the recipes'
        ``reduce-overhead`` replays CUDA graphs, which need a GPU, and on a CPU the NA models do not compile
        (the gemm backend's dispatch breaks the graph at every NA call, the blocks recompile with dynamic shapes
        and inductor fails on their symbolic strides: ``cannot determine truth value of Relational``)."""
        mode, self._compile = self._compile, None
        if not mode:
            return False
        if torch.device(device).type != "cuda":
            log.info("model.compile=%s is not applied on the %s device: the model runs eagerly (compiling pays "
                     "on CUDA only)", mode, torch.device(device).type)
            return False
        self.model.compile(options=compile_options(mode))
        return True

    # ---- forward -------------------------------------------------------------------------------
    def _backend(self):
        return ops.use_backend(self.backend) if self.backend is not None else contextlib.nullcontext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._backend():
            return self.model(x)

    def forward_ema(self, x: torch.Tensor) -> torch.Tensor:
        with self._backend():
            return self.ema.module(x)

    # ---- training ------------------------------------------------------------------------------
    def on_train_epoch_start(self) -> None:
        # Main-process randomness (mixup, drop path, in-process augmentation) restarts from a seed fixed by
        # (seed, epoch, rank): a run resumed at an epoch boundary continues exactly like an uninterrupted one.
        seed = epoch_seed(self.hparams.seed, self.current_epoch) + self.global_rank
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        torch.manual_seed(seed)

    def on_train_start(self) -> None:
        self._last_ema_step = self.global_step

    def training_step(self, batch, batch_idx):
        images, targets, skipped = batch
        self._note_unreadable(skipped, "train")
        if images is None:  # every image of the batch was unreadable
            return None
        if self.mixup_fn is not None:
            images, targets = self._mix(images, targets)
        loss = self.train_loss(self(images), targets)
        self.train_loss_mean.update(loss.detach(), weight=images.shape[0])
        self.log("train/loss_step", loss, on_step=True, on_epoch=False, batch_size=images.shape[0])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # Update the EMA once per optimizer step (not per micro-batch under gradient accumulation).
        if self.ema is not None and self.global_step != self._last_ema_step:
            self.ema.update(self.model, step=self.global_step)
            self._last_ema_step = self.global_step

    def _mix(self, images: torch.Tensor, targets: torch.Tensor):
        """timm's batch mixup pairs sample i with sample B-1-i and needs an even batch: an odd batch (a
        skipped file, a short last batch) drops its last sample, and a single image keeps its own
        (label-smoothed, one-hot) target unmixed."""
        if images.shape[0] == 1:
            return images, mixup_target(targets, self.hparams.num_classes, lam=1.0,
                                        smoothing=self.hparams.label_smoothing)
        if images.shape[0] % 2:
            images, targets = images[:-1], targets[:-1]
        return self.mixup_fn(images, targets)

    @property
    def skipped_files(self) -> set[str]:
        """Every unreadable file met so far (train and validation)."""
        return self.unreadable.all()

    def _note_unreadable(self, paths, split: str) -> None:
        new = self.unreadable.add(split, paths)
        if new:
            log.warning("%s: skipped %d unreadable file(s) (%d so far): %s", split, len(new),
                        self.unreadable.count(split), ", ".join(new[:5]))

    def _log_unreadable(self, split: str) -> None:
        """``<split>/skipped_images``: how many distinct files of the split were unreadable so far."""
        self.unreadable.merge_across_processes()
        self.log(f"{split}/skipped_images", float(self.unreadable.count(split)), batch_size=1, **SYNCED)

    def on_train_epoch_end(self) -> None:
        if self.trainer.num_training_batches:  # the same on every process, so all compute (a collective) and log
            self.log("train/loss_epoch", self.train_loss_mean.compute(), **SYNCED)
        self.train_loss_mean.reset()
        self._log_unreadable("train")

    # ---- validation ----------------------------------------------------------------------------
    def validation_step(self, batch, batch_idx):
        images, targets, skipped = batch
        self._note_unreadable(skipped, "val")
        if images is None:
            return
        logits = self(images)
        self._update_metrics("val", logits, targets)
        if self.ema is not None:
            self._update_metrics("val_ema", self.forward_ema(images), targets)
        return logits  # callbacks (sample images) read the predictions from here instead of a second forward

    def _update_metrics(self, prefix, logits, targets):
        metrics = self.val_metrics[prefix]
        logits = logits.float()
        metrics["top1"].update(logits, targets)
        metrics["top5"].update(logits, targets)
        metrics["loss"].update(self.eval_loss(logits, targets), weight=targets.shape[0])

    def on_validation_epoch_end(self) -> None:
        self._log_unreadable("val")
        for prefix, metrics in self.val_metrics.items():
            values = metrics.compute()  # synchronised across processes by torchmetrics
            metrics.reset()
            self.log(f"{prefix}/top1", values["top1"] * 100, prog_bar=prefix == "val", **SYNCED)
            self.log(f"{prefix}/top5", values["top5"] * 100, **SYNCED)
            self.log(f"{prefix}/loss", values["loss"], **SYNCED)

    @torch.no_grad()
    def sample_figures(self, batch, outputs=None, max_images: int = 16) -> dict:
        """``{"predictions": figure}``: the batch's first images titled predicted / true label (raw weights),
        for :class:`namodels.tasks.samples.SampleImages` (TensorBoard, end-of-training PNG).  ``outputs``:
        the logits ``validation_step`` returned for the batch (else the model runs on the images)."""
        from .samples import labelled_grid

        images, targets = batch[0], batch[1]
        if images is None:
            return {}
        images, targets = images[:max_images], targets[:max_images]
        if isinstance(outputs, torch.Tensor):
            predicted = outputs[:max_images].argmax(-1).cpu()
        else:
            was_training = self.training
            self.eval()
            try:
                predicted = self(images.to(self.device)).argmax(-1).cpu()
            finally:
                self.train(was_training)
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if hasattr(datamodule, "eval_settings"):  # undo the normalisation the batch got after its transfer
            settings = datamodule.eval_settings()
            mean = torch.tensor(settings["mean"]).view(-1, 1, 1)
            std = torch.tensor(settings["std"]).view(-1, 1, 1)
            images = images.float().cpu() * std + mean
        else:  # unknown normalisation: stretch each image to [0, 1]
            low = images.amin(dim=(1, 2, 3), keepdim=True)
            images = (images - low) / (images.amax(dim=(1, 2, 3), keepdim=True) - low).clamp_min(1e-6)
        names = getattr(getattr(datamodule, "val_set", None), "classes", None)
        if names and max(len(str(n)) for n in names) > 12:  # long names would overlap: indices instead
            names = None
        return {"predictions": labelled_grid(images.cpu(), predicted.tolist(), targets.tolist(), names)}

    # ---- optimisation --------------------------------------------------------------------------
    def global_batch_size(self) -> int:
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "batch_size"):
            raise ValueError("the classification task needs a data module with a batch_size")
        return dm.batch_size * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def configure_optimizers(self):
        opt, sched = self.hparams.optimizer, self.hparams.scheduler
        global_batch = self.global_batch_size()
        lr = opt["lr"] * global_batch / opt["lr_base_batch"] if opt["lr_scaling"] == "linear" else opt["lr"]
        kwargs = dict(betas=tuple(opt["betas"]), eps=opt["eps"]) if "adam" in opt["name"].lower() else {}
        if opt["name"].lower() in ("sgd", "momentum", "nesterov"):
            kwargs = dict(momentum=opt["momentum"])
        optimizer = create_optimizer_v2(self.model, opt=opt["name"], lr=lr, weight_decay=opt["weight_decay"],
                                        layer_decay=opt["layer_decay"], **kwargs,
                                        **optimizer_kwargs(opt["name"], self.device))
        max_epochs = self.trainer.max_epochs
        epochs, warmup, cooldown = schedule_epochs(sched, max_epochs)
        updates_per_epoch = max(1, int(self.trainer.estimated_stepping_batches) // max_epochs)
        scheduler, _ = create_scheduler_v2(
            optimizer, sched=sched["name"], num_epochs=epochs, warmup_epochs=warmup,
            warmup_lr=sched["warmup_lr"], min_lr=sched["min_lr"], warmup_prefix=sched["warmup_prefix"],
            step_on_epochs=False, updates_per_epoch=updates_per_epoch,
        )
        log.info("lr %.3g (%s x global batch %d / %d), %d updates/epoch, %d schedule epochs + %d cooldown",
                 lr, opt["lr"], global_batch, opt["lr_base_batch"], updates_per_epoch, epochs, cooldown)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # the fused AdamW unscales inside its step, which Lightning's mixed precision refuses to clip for
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        # timm schedulers are stepped with the number of optimizer updates so far (per-iteration schedule)
        scheduler.step_update(num_updates=self.global_step)

    # ---- checkpoints and export ----------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["unreadable_files"] = self.unreadable.state()  # plain lists: a resumed run keeps counting

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.unreadable.load_state(checkpoint.get("unreadable_files"))
        saved = (checkpoint.get("hyper_parameters") or {})
        saved_model = (saved.get("model") or {}).get("name")
        ours = self.hparams.model.get("name")
        if saved_model is not None and saved_model != ours:
            raise ValueError(f"ckpt_path: the checkpoint was trained with model {saved_model!r} "
                             f"({saved.get('num_classes')} classes); this run builds {ours!r}")
        if saved.get("num_classes") not in (None, self.hparams.num_classes):
            raise ValueError(f"ckpt_path: the checkpoint has {saved['num_classes']} classes; this run has "
                             f"data.num_classes={self.hparams.num_classes}")
        state = checkpoint.get("state_dict", {})
        if self.ema is not None and not any(k.startswith("ema.") for k in state):
            log.warning("checkpoint has no EMA weights: the EMA starts from the checkpoint's model weights")
            state.update({"ema.module." + k[len("model."):]: v for k, v in list(state.items())
                          if k.startswith("model.")})

    def export_weights(self, directory: str, source: str = "") -> list[str]:
        """Writes ``<model>.safetensors`` (and ``<model>_ema.safetensors``) loadable by timm.create_model."""
        name = self.hparams.model["name"]
        stem = os.path.join(directory, name.replace("/", "_"))
        paths = [export_weights(self.model.state_dict(), stem + ".safetensors", model_name=name,
                                num_classes=self.hparams.num_classes, source=source)]
        if self.ema is not None:
            paths.append(export_weights(self.ema.module.state_dict(), stem + "_ema.safetensors", model_name=name,
                                        num_classes=self.hparams.num_classes, source=source + " (EMA)"))
        return paths
