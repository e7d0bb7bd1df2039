"""Gradient clipping that also works with fused Adam / AdamW under mixed precision.

The recipes clip gradients (``trainer.gradient_clip_val``) and train with the fused AdamW on CUDA
(``namodels.speed.optimizer_kwargs``).  Lightning's mixed-precision plugin refuses to clip for any optimizer that
unscales gradients inside its own step, as the fused ones do for ``GradScaler``, although under ``bf16-mixed``
there is no scaler and nothing to unscale.  The tasks' ``configure_gradient_clipping`` calls ``clip_gradients``:

* an optimizer that does not unscale itself goes through Lightning's own ``clip_gradients``;
* a fused one is clipped by the precision plugin's base implementation (``clip_grad_norm_`` / ``clip_grad_value_``
  over the optimizer's parameters), after ``GradScaler.unscale_`` where there is a scaler (``16-mixed``): the
  scaler's step then hands the fused kernel gradients already unscaled, with the inf check of the unscale.
"""
from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer


def unscales_in_step(optimizer: Optimizer) -> bool:
    """The optimizer takes GradScaler's scale into its own step (torch's fused Adam, AdamW, SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def clip_gradients(module: pl.LightningModule, optimizer: Optimizer, value: float | None,
                   algorithm: str | GradClipAlgorithmType | None) -> None:
    """What ``LightningModule.configure_gradient_clipping`` does by default, for every optimizer (see the module
    docstring).  ``value`` / ``algorithm``: the trainer's ``gradient_clip_val`` / ``gradient_clip_algorithm``."""
    if not value:
        return
    if not unscales_in_step(optimizer):
        module.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
        return
    plugin = module.trainer.precision_plugin
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        scaler.unscale_(optimizer)
    Precision.clip_gradients(plugin, optimizer, value, GradClipAlgorithmType(algorithm or "norm"))
