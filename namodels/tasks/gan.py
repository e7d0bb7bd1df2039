"""GAN training (StyleNAT recipe) as a Lightning module with manual optimization.

One training step = one discriminator step (+ lazy R1 every ``r1_interval`` D steps), one
generator step and one G-EMA update:

* losses: non-saturating logistic (``softplus``); optional balanced consistency regularisation
  (bCR: ``lambda * ||D(aug(x)) - D(x)||^2`` for real and fake, DiffAugment policy);
* lazy R1: ``gamma / 2 * E||grad_x D(x)||^2 * r1_interval`` on real images every
  ``r1_interval`` D steps, with the D optimizer's lr and betas adjusted by
  ``c = r1_interval / (r1_interval + 1)`` (``lr * c``, ``beta ** c``) so the regularised
  optimizer matches the unregularised one on average (StyleGAN2);
* G EMA with a half-life counted in images: decay per step ``0.5 ** (global_batch / (half_life_kimg
  * 1000))`` (= the release's ``0.5 ** (32 / 10000)`` at global batch 32), the half-life capped at
  ``ema_rampup`` x the images seen so far (StyleGAN2-ADA's ``ema_rampup``): a run shorter than a few
  half-lives would otherwise end with a G-EMA still close to its random initial weights;
* TTUR: G lr = D lr / 4 unless ``lr_g`` is given; optional linear lr decay over a kimg range;
* D gradient clipping (norm 5 in the release), optional G clipping;
* progress is counted in images seen (``kimg``), not ``global_step`` (which Lightning advances on
  every optimizer step in manual optimization).

Several devices: every backward pass trains one network (the other gets no gradients), so the task
turns on DDP's ``find_unused_parameters`` itself (:meth:`GANTask.setup`): ``trainer=ddp`` / ``ddp_cpu``
need no strategy override; checked with 2 CPU processes.

Checkpoints are Lightning checkpoints (resumable with ``ckpt_path``) that also carry the release's
layout at no extra size: ``state_dicts: {g, g_ema, d}`` and ``optim_dicts: {g_optim, d_optim}``
reference the same tensors (``torch.save`` stores shared storages once).
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Mapping

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from namodels.data.decoding import UnreadableFiles
from namodels.speed import CallingThreadBackward, optimizer_kwargs
from namodels.tasks.checkpoints import atomic_write
from namodels.tasks.clipping import clip_gradients
from namodels.utils.distributed import SYNCED
from namodels.tasks.generators import (DISPLAY_TILE, build_discriminator, build_generator, grid_image, load_generator,
                                       write_image)

log = logging.getLogger(__name__)

__all__ = [
    "GANTask",
    "d_logistic_loss",
    "g_nonsaturating_loss",
    "r1_penalty",
    "diff_augment",
    "ema_decay",
    "ema_half_life",
    "lazy_regularization_hparams",
    "load_generator",
    "build_generator",
]

# ---------------------------------------------------------------------------------------------
# Losses and schedules
# ---------------------------------------------------------------------------------------------


def d_logistic_loss(real_pred: torch.Tensor, fake_pred: torch.Tensor) -> torch.Tensor:
    """Discriminator logistic loss: ``softplus(-D(real)) + softplus(D(fake))`` (means)."""
    return F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()


def g_nonsaturating_loss(fake_pred: torch.Tensor) -> torch.Tensor:
    """Non-saturating generator loss ``softplus(-D(G(z)))``."""
    return F.softplus(-fake_pred).mean()


def r1_penalty(real_pred: torch.Tensor, real_img: torch.Tensor) -> torch.Tensor:
    """``E_x ||grad_x D(x)||^2`` (per-sample squared gradient norm, batch mean), differentiable."""
    (grad,) = torch.autograd.grad(real_pred.sum(), real_img, create_graph=True)
    return grad.pow(2).flatten(1).sum(1).mean()


def ema_decay(global_batch: int, half_life_kimg: float = 10.0) -> float:
    """Per-step EMA decay so the average's half-life is ``half_life_kimg`` thousand images."""
    if global_batch < 1 or half_life_kimg <= 0:
        raise ValueError(f"ema: need global_batch >= 1 and half_life_kimg > 0, got {global_batch}, {half_life_kimg}")
    return 0.5 ** (global_batch / (half_life_kimg * 1000.0))


def ema_half_life(half_life_kimg: float, kimg_seen: float, rampup: float | None = None) -> float:
    """The EMA half-life for a step taken after ``kimg_seen`` thousand images: ``half_life_kimg``, capped at
    ``rampup * kimg_seen`` when ``rampup`` is given (StyleGAN2-ADA's ``ema_rampup``, 0.05 there), so that the
    average spans at most that share of the training so far.  0 means no averaging yet (decay 0)."""
    if rampup is not None and rampup < 0:
        raise ValueError(f"ema_rampup: expected >= 0 or None, got {rampup}")
    if rampup:
        return min(half_life_kimg, rampup * kimg_seen)
    return half_life_kimg


def lazy_regularization_hparams(lr: float, betas, interval: int | None):
    """Adam lr and betas for an optimizer that also takes a regularisation step every ``interval``
    steps: ``lr * c`` and ``beta ** c`` with ``c = interval / (interval + 1)``."""
    if not interval:
        return lr, tuple(betas)
    c = interval / (interval + 1)
    return lr * c, tuple(b**c for b in betas)


# ---------------------------------------------------------------------------------------------
# DiffAugment (for bCR): differentiable, per-sample random flip / translation / colour / cutout
# ---------------------------------------------------------------------------------------------


def _flip(x):
    mask = torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5
    return torch.where(mask, x.flip(-1), x)


def _brightness(x):
    return x + (torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype, device=x.device) - 0.5)


def _saturation(x):
    mean = x.mean(dim=1, keepdim=True)
    return (x - mean) * (torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype, device=x.device) * 2) + mean


def _contrast(x):
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return (x - mean) * (torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype, device=x.device) + 0.5) + mean


def _translation(x, ratio: float = 0.125):
    """Shifts each sample by up to ``ratio`` of its size, filling with zeros."""
    b, _, h, w = x.shape
    sy, sx = int(h * ratio + 0.5), int(w * ratio + 0.5)
    dy = torch.randint(-sy, sy + 1, (b, 1, 1), device=x.device)
    dx = torch.randint(-sx, sx + 1, (b, 1, 1), device=x.device)
    rows = torch.arange(h, device=x.device)[None, :, None] + dy + 1  # index into the 1-padded image
    cols = torch.arange(w, device=x.device)[None, None, :] + dx + 1
    rows, cols = rows.clamp(0, h + 1), cols.clamp(0, w + 1)
    padded = F.pad(x, (1, 1, 1, 1))
    batch = torch.arange(b, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows.expand(b, h, w), cols.expand(b, h, w)].permute(0, 3, 1, 2)


def _cutout(x, ratio: float = 0.5):
    """Zeros one random square of ``ratio`` x the size per sample (may extend past the border)."""
    b, _, h, w = x.shape
    ch, cw = int(h * ratio + 0.5), int(w * ratio + 0.5)
    cy = torch.randint(0, h + (1 - ch % 2), (b, 1, 1), device=x.device)
    cx = torch.randint(0, w + (1 - cw % 2), (b, 1, 1), device=x.device)
    top, left = cy - ch // 2, cx - cw // 2
    rows = torch.arange(h, device=x.device)[None, :, None]
    cols = torch.arange(w, device=x.device)[None, None, :]
    inside = (rows >= top) & (rows < top + ch) & (cols >= left) & (cols < left + cw)
    return x * (~inside).unsqueeze(1).to(x.dtype)


_AUGMENTS = {
    "flip": [_flip],
    "translation": [_translation],
    "color": [_brightness, _saturation, _contrast],
    "cutout": [_cutout],
}


def diff_augment(x: torch.Tensor, policy: str = "flip,translation,color,cutout") -> torch.Tensor:
    """Differentiable augmentation (DiffAugment policies ``flip``, ``translation``, ``color``,
    ``cutout``, comma separated) applied with independent randomness per sample."""
    for name in [p.strip() for p in policy.split(",") if p.strip()]:
        if name not in _AUGMENTS:
            raise ValueError(f"diffaug_policy: unknown augmentation {name!r}; choose from {sorted(_AUGMENTS)}")
        for fn in _AUGMENTS[name]:
            x = fn(x)
    return x.contiguous()


# ---------------------------------------------------------------------------------------------
# DDP
# ---------------------------------------------------------------------------------------------


def find_unused_parameters(strategy: DDPStrategy) -> None:
    """Makes ``strategy`` wrap the module in DDP with ``find_unused_parameters=True`` (called before it wraps).

    Each backward pass of a GAN step trains one network: the D and R1 passes give G's parameters no
    gradients, the G pass D's (toggled off).  Without unused-parameter detection DDP's reducer waits for
    those gradients and the next backward fails ("Expected to have finished reduction in the prior
    iteration").  With it, DDP walks the loss's graph after each backward, marks the idle network's
    parameters ready and leaves their gradients untouched; that walk is small next to the passes.  It is
    the setting Lightning names for modules like this one.  ``no_sync`` would not do: it skips the
    reduction of the network being trained as well, which then needs hand-written all-reduces."""
    kwargs = strategy._ddp_kwargs  # DDPStrategy(**kwargs) keeps DistributedDataParallel's arguments here
    if not kwargs.get("find_unused_parameters"):
        kwargs["find_unused_parameters"] = True
        rank_zero_info("GAN task: DDP find_unused_parameters=True (each backward pass trains G or D, not both)")


# ---------------------------------------------------------------------------------------------
# Lightning module
# ---------------------------------------------------------------------------------------------


class GANTask(CallingThreadBackward, L.LightningModule):
    """StyleNAT GAN training.

    Args:
        generator / discriminator: keyword arguments of :class:`StyleNATGenerator` /
            :class:`StyleNATDiscriminator` (stored in the checkpoint's hyper-parameters).
        lr_d: discriminator lr (2e-4); lr_g: generator lr (default ``lr_d / 4`` with ``ttur``,
            else ``lr_d``).
        betas: Adam betas (0, 0.99).
        r1_gamma, r1_interval: R1 weight (10) and lazy interval in D steps (16; 0/None = off).
        ema_half_life_kimg: G EMA half-life in thousands of images (10).
        ema_rampup: cap the half-life at this share of the images seen so far (0.05, StyleGAN2-ADA's value; None =
            off, as the StyleNAT release): a short run ends with a G-EMA that follows the generator instead of one
            still near its initial weights; a long run is affected only over its first ``ema_half_life_kimg /
            ema_rampup`` kimg (200 at the defaults).
        bcr, bcr_real, bcr_fake, diffaug_policy: balanced consistency regularisation.
        d_clip, g_clip: gradient-norm clipping (5.0 for D in the release; None = off).
        style_mixing_prob: probability of mixing two latents in a G forward (0 in the release).
        lr_decay_start_kimg, lr_decay_end_kimg: linear lr decay to 0 over this kimg range (off when None).
        max_kimg: stop once this many thousand images were seen (Lightning's ``max_steps`` counts
            every optimizer step, 2-3 per batch here; use this instead).
        sample_every_n_steps, sample_grid, sample_seed: a grid of ``sample_grid`` G-EMA samples (fixed
            seeds) every n training steps (batches): a PNG under the log dir's ``samples/`` and, with a
            TensorBoard logger, the image ``samples/g_ema`` at that step.
        sample_min_tile: samples of smaller models are shown enlarged to at least this many pixels
            (whole factor, nearest: every generated pixel kept; 0 = as generated).
    """

    def __init__(self, generator: Mapping[str, Any] | None = None, discriminator: Mapping[str, Any] | None = None,
                 lr_d: float = 2e-4, lr_g: float | None = None, ttur: bool = True, betas=(0.0, 0.99),
                 r1_gamma: float = 10.0, r1_interval: int | None = 16, ema_half_life_kimg: float = 10.0,
                 ema_rampup: float | None = 0.05, bcr: bool = False, bcr_real: float = 10.0, bcr_fake: float = 10.0,
                 diffaug_policy: str = "flip,translation,color,cutout", d_clip: float | None = 5.0,
                 g_clip: float | None = None, style_mixing_prob: float = 0.0,
                 lr_decay_start_kimg: float | None = None, lr_decay_end_kimg: float | None = None,
                 max_kimg: float | None = None, sample_every_n_steps: int = 0, sample_grid: int = 16,
                 sample_seed: int = 0, sample_min_tile: int = DISPLAY_TILE):
        super().__init__()
        generator = dict(generator or {"size": 64})
        discriminator = dict(discriminator or {"size": generator.get("size", 64)})
        if generator.get("size", 256) != discriminator.get("size", 256):
            raise ValueError(f"discriminator: size {discriminator.get('size')} differs from the generator's "
                             f"{generator.get('size')}")
        if r1_interval is not None and r1_interval < 0:
            raise ValueError(f"r1_interval: expected >= 0 or None, got {r1_interval}")
        if ema_half_life_kimg <= 0:
            raise ValueError(f"ema_half_life_kimg: expected > 0, got {ema_half_life_kimg}")
        ema_half_life(ema_half_life_kimg, 0.0, ema_rampup)  # validates ema_rampup early
        if not 0 <= style_mixing_prob <= 1:
            raise ValueError(f"style_mixing_prob: expected a probability, got {style_mixing_prob}")
        if (lr_decay_start_kimg is None) != (lr_decay_end_kimg is None) or (
                lr_decay_start_kimg is not None and lr_decay_end_kimg <= lr_decay_start_kimg):
            raise ValueError("lr_decay_start_kimg: give both lr_decay_start_kimg < lr_decay_end_kimg, or neither")
        if bcr:
            diff_augment(torch.zeros(1, 3, 8, 8), diffaug_policy)  # validates the policy early
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = build_generator(generator)
        self.discriminator = build_discriminator(discriminator)
        # G EMA: timm's ModelEmaV3 (parameters and buffers, e.g. w_avg); decay set per step.
        self.ema = ModelEmaV3(self.generator, decay=0.999)
        self.ema.module.requires_grad_(False)
        self.lr_g = lr_g if lr_g is not None else (lr_d / 4 if ttur else lr_d)
        self.lr_d = lr_d
        # Progress counters live in buffers so they are checkpointed and restored with the weights; while training,
        # the host keeps its own copy (read from the buffers once, at the start) and writes it back every step, since
        # reading a GPU buffer on the host would wait for the GPU at every step.
        self.register_buffer("images_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("d_steps", torch.zeros((), dtype=torch.long))
        self._host_counters: dict[str, int] | None = None
        self._sampled_at: int | None = None  # d_steps of the last sample grid written
        self.unreadable = UnreadableFiles()

    def train(self, mode: bool = True):
        super().train(mode)
        self.ema.module.eval()  # the EMA copy is never trained (and must not update its w_avg)
        return self

    @property
    def g_ema(self) -> nn.Module:
        return self.ema.module

    def _counter(self, name: str) -> int:
        if self._host_counters is not None:
            return self._host_counters[name]
        return int(getattr(self, name))

    def _advance(self, name: str, by: int) -> None:
        self._host_counters[name] += by
        getattr(self, name).fill_(self._host_counters[name])  # a fill kernel: no host read, no copy

    def on_train_start(self) -> None:
        self._host_counters = {"images_seen": int(self.images_seen), "d_steps": int(self.d_steps)}

    def on_train_end(self) -> None:
        # the run's final grid, unless the last step wrote one already
        if self.hparams.sample_every_n_steps and self._sampled_at != self._counter("d_steps"):
            path = self.save_samples()
            if path:
                rank_zero_info(f"GAN task: final G-EMA samples at {self.kimg:.3f} kimg: {path}")
        self._host_counters = None

    def train_batches_left(self) -> int | None:
        """Training batches until ``max_kimg`` is reached (the progress bar's total), or None when the run has
        no kimg bound or the batch size is not known yet."""
        if self.hparams.max_kimg is None or self._trainer is None:
            return None
        batch = getattr(self.trainer.train_dataloader, "batch_size", None)
        if not batch:
            return None
        left = self.hparams.max_kimg * 1000 - self._counter("images_seen")
        return max(0, math.ceil(left / (batch * self.trainer.world_size) - 1e-9))

    @property
    def kimg(self) -> float:
        return self._counter("images_seen") / 1000.0

    # --- distributed -----------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        if isinstance(self.trainer.strategy, DDPStrategy):
            find_unused_parameters(self.trainer.strategy)

    # --- optimizers ------------------------------------------------------------------------

    def configure_optimizers(self):
        betas = tuple(self.hparams.betas)
        lr_d, betas_d = lazy_regularization_hparams(self.lr_d, betas, self.hparams.r1_interval)
        fastest = optimizer_kwargs("adam", self.device)  # fused on CUDA: one kernel, no host read of its step count
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.lr_g, betas=betas, **fastest)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr_d, betas=betas_d, **fastest)
        for opt in (opt_g, opt_d):
            for group in opt.param_groups:
                group["base_lr"] = group["lr"]
        return [opt_g, opt_d]

    def lr_factor(self) -> float:
        start, end = self.hparams.lr_decay_start_kimg, self.hparams.lr_decay_end_kimg
        if start is None:
            return 1.0
        return min(1.0, max(0.0, 1.0 - (self.kimg - start) / (end - start)))

    # --- training --------------------------------------------------------------------------

    def _latents(self, batch: int):
        style_dim = self.generator.style_dim
        z = torch.randn(batch, style_dim, device=self.device)
        if self.hparams.style_mixing_prob > 0 and torch.rand(()) < self.hparams.style_mixing_prob:
            return z, torch.randn(batch, style_dim, device=self.device)
        return z, None

    def _generate(self, batch: int):
        z, mix_z = self._latents(batch)
        return self.generator(z, mix_z=mix_z)

    def _clip(self, opt, value):
        clip_gradients(self, getattr(opt, "optimizer", opt), value, "norm")  # (fused Adam under mixed precision too)

    @property
    def skipped_files(self) -> set[str]:
        """The unreadable image files met so far (each replaced by a readable one in its batch)."""
        return self.unreadable.all()

    def on_train_epoch_end(self) -> None:
        self.unreadable.merge_across_processes()
        self.log("train/skipped_images", float(self.unreadable.count("train")), batch_size=1, **SYNCED)

    def training_step(self, batch, batch_idx):
        real = batch[0] if isinstance(batch, (list, tuple)) else batch
        if isinstance(batch, (list, tuple)) and len(batch) > 1:
            for path in self.unreadable.add("train", batch[1]):
                log.warning("skipped unreadable image %s", path)
        b = real.shape[0]
        opt_g, opt_d = self.optimizers()
        hp = self.hparams
        factor = self.lr_factor()
        for opt in (opt_g, opt_d):
            for group in opt.optimizer.param_groups if hasattr(opt, "optimizer") else opt.param_groups:
                group["lr"] = group["base_lr"] * factor

        # Discriminator step.
        self.toggle_optimizer(opt_d)
        with torch.no_grad():
            fake = self._generate(b)
        real_pred = self.discriminator(real)
        fake_pred = self.discriminator(fake)
        d_loss = d_logistic_loss(real_pred, fake_pred)
        logs = {"loss/d": d_loss.detach(), "d/real": real_pred.detach().mean(), "d/fake": fake_pred.detach().mean()}
        if hp.bcr:
            real_aug = self.discriminator(diff_augment(real, hp.diffaug_policy))
            fake_aug = self.discriminator(diff_augment(fake, hp.diffaug_policy))
            bcr = hp.bcr_real * F.mse_loss(real_aug, real_pred) + hp.bcr_fake * F.mse_loss(fake_aug, fake_pred)
            d_loss = d_loss + bcr
            logs["loss/bcr"] = bcr.detach()
        opt_d.zero_grad(set_to_none=True)
        self.manual_backward(d_loss)
        self._clip(opt_d, hp.d_clip)
        opt_d.step()

        # Lazy R1 on real images, every r1_interval D steps (including the first).
        if hp.r1_interval and hp.r1_gamma > 0 and self._counter("d_steps") % hp.r1_interval == 0:
            real_r = real.detach().requires_grad_(True)
            pred = self.discriminator(real_r)
            r1 = r1_penalty(pred, real_r)
            opt_d.zero_grad(set_to_none=True)
            # `0 * pred[0]` keeps every D output in the graph (DDP needs all parameters used).
            self.manual_backward(hp.r1_gamma / 2 * r1 * hp.r1_interval + 0 * pred[0].sum())
            opt_d.step()
            logs["loss/r1"] = r1.detach()
        self.untoggle_optimizer(opt_d)
        self._advance("d_steps", 1)

        # Generator step.
        self.toggle_optimizer(opt_g)
        g_loss = g_nonsaturating_loss(self.discriminator(self._generate(b)))
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(g_loss)
        self._clip(opt_g, hp.g_clip)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        logs["loss/g"] = g_loss.detach()

        global_batch = b * self.trainer.world_size
        half_life = ema_half_life(hp.ema_half_life_kimg, self.kimg, hp.get("ema_rampup"))
        self.ema.decay = ema_decay(global_batch, half_life) if half_life > 0 else 0.0
        self.ema.update(self.generator)
        self._advance("images_seen", global_batch)
        logs["kimg"] = torch.tensor(self.kimg)
        logs["lr/g"] = torch.tensor(opt_g.param_groups[0]["lr"])
        self.log_dict(logs, prog_bar=False, on_step=True, on_epoch=False, sync_dist=False)
        # shown by the progress bar every few batches (configs/callbacks/gan.yaml: step_metrics); prog_bar=True would
        # make Lightning read them after every batch
        self.log("g", logs["loss/g"], logger=False)
        self.log("d", logs["loss/d"], logger=False)
        if hp.sample_every_n_steps and self._counter("d_steps") % hp.sample_every_n_steps == 0:
            self.save_samples()
        if hp.max_kimg is not None and self.kimg >= hp.max_kimg:
            self.trainer.should_stop = True
        return d_loss.detach()

    # --- samples ---------------------------------------------------------------------------

    @torch.no_grad()
    def save_samples(self, path: str | None = None) -> str | None:
        """Writes a grid of G-EMA samples (fixed seeds) as PNG and logs it to every TensorBoard logger
        (``samples/g_ema``, at the training step); returns the path (rank 0 only)."""
        if self.trainer is not None and not self.trainer.is_global_zero:
            return None
        from lightning.pytorch.loggers import TensorBoardLogger

        n = self.hparams.sample_grid
        if path is None:
            root = self.trainer.default_root_dir if self.trainer is not None else "."
            path = os.path.join(root, "samples", f"kimg{self.kimg:09.3f}.png")
        imgs = self.g_ema.sample(n, seed=self.hparams.sample_seed, device=self.device)
        self._sampled_at = self._counter("d_steps")
        grid = grid_image(imgs.float(), nrow=int(math.ceil(math.sqrt(n))), min_tile=self.hparams.sample_min_tile)
        write_image(grid, path)
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                # the step of the losses logged with this batch: the batch's index
                logger.experiment.add_image("samples/g_ema", grid, self._counter("d_steps") - 1)
        return path

    # --- checkpoints -----------------------------------------------------------------------

    def export_weights(self, directory: str, source: str | None = None) -> list[str]:
        """train.py's export hook: ``g_ema.safetensors`` and ``g.safetensors`` with the generator
        configuration in the metadata (``load_generator`` reads them)."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        meta = {"generator": json.dumps(dict(self.hparams.generator)), "kimg": f"{self.kimg:.3f}",
                "source": str(source or "")}
        paths = []
        for name, module in (("g_ema", self.g_ema), ("g", self.generator)):
            path = os.path.join(directory, f"{name}.safetensors")
            with atomic_write(path) as partial:  # a reader never sees half a file; the umask's file mode
                save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, partial,
                          metadata=meta)
            paths.append(path)
        return paths

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The release's layout, referencing the same tensors as `state_dict` / `optimizer_states`.
        state = checkpoint.get("state_dict", {})

        def part(prefix):
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}

        checkpoint["state_dicts"] = {"g": part("generator."), "g_ema": part("ema.module."), "d": part("discriminator.")}
        optim = checkpoint.get("optimizer_states") or []
        if len(optim) == 2:
            checkpoint["optim_dicts"] = {"g_optim": optim[0], "d_optim": optim[1]}
        checkpoint["kimg"] = self.kimg
        checkpoint["unreadable_files"] = self.unreadable.state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.unreadable.load_state(checkpoint.get("unreadable_files"))

