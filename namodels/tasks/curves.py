"""Training curves as a PNG in the run folder (``<output>/curves.png``).

:class:`TrainingCurves` is a Lightning callback that collects what the task already logs, independently
of the loggers: the training metrics logged per step (``train/loss``), recorded every ``log_every_n_steps``
optimizer steps, with epoch means over every step; the learning rate read from the optimizers; and every
validation metric (``val/*``, ``val_ema/*``) after each validation.  Per-step values stay on their device
between records (summed there for the epoch means): reading a GPU value makes the host wait for the GPU,
and a wait per step keeps it from queueing the next step meanwhile.  It redraws the figure after each
validation and at the end of training.  The collected series are part of the callback's checkpoint state,
so a resumed run plots from its first step.  Memory stays bounded: past ``max_points`` recorded steps the
per-step series keep every other point and record half as often from then on.
"""
from __future__ import annotations

import logging
import math
import os

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from ..utils.figures import new_figure, save_figure

log = logging.getLogger(__name__)

EXCLUDED_SUFFIXES = ("skipped_images",)


def _scalar(value) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


class TrainingCurves(Callback):
    """Writes ``dirpath/filename`` (PNG): loss, learning rate and validation metrics over optimizer steps.

    Args:
        dirpath: the run folder.
        filename: the image's name in it.
        title: shown above the panels (e.g. the run name).
        max_points: recorded steps kept per series before thinning (bounds memory and checkpoint size).
        every_validation: also redraw after each validation (else only at the end of training).
        every_n_steps: optimizer steps between two recorded points of the per-step series (None: the trainer's
            ``log_every_n_steps``); thinning doubles it.
    """

    def __init__(self, dirpath: str, filename: str = "curves.png", title: str = "", max_points: int = 2000,
                 every_validation: bool = True, every_n_steps: int | None = None):
        super().__init__()
        if max_points < 2:
            raise ValueError(f"max_points: at least 2, got {max_points}")
        if every_n_steps is not None and int(every_n_steps) < 1:
            raise ValueError(f"every_n_steps: must be >= 1 or None, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.dirpath, self.filename, self.title = dirpath, filename, str(title or "")
        self.max_points, self.every_validation = int(max_points), bool(every_validation)
        self.series: dict[str, list[list[float]]] = {}  # name -> [[step, value], ...]
        self.stride = 1          # record per-step series every `stride` x every_n_steps optimizer steps
        self.epochs_done = 0
        self._epoch_sums: dict[str, list] = {}  # name -> [sum, count] of this epoch's finite values (on their device)
        self._last_step = -1

    @property
    def path(self) -> str:
        return os.path.join(self.dirpath, self.filename)

    # ---- collection -----------------------------------------------------------------------------
    def _add(self, name: str, step: int, value: float) -> None:
        points = self.series.setdefault(name, [])
        if points and points[-1][0] == step:
            points[-1][1] = value  # one value per step (e.g. two validations at one step)
        else:
            points.append([step, value])

    def _record_every(self, trainer: pl.Trainer) -> int:
        return self.stride * int(self.every_n_steps or trainer.log_every_n_steps or 1)

    def _thin(self, trainer: pl.Trainer) -> None:
        """Per-step series keep the points on the new stride (every other one)."""
        self.stride *= 2
        every = self._record_every(trainer)
        for name, points in self.series.items():
            if _is_step_series(name):
                self.series[name] = [p for p in points if int(p[0]) % every == 0]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:  # gradient accumulation: no optimizer step since the last record
            return
        self._last_step = step
        values = {}
        for key, value in trainer.callback_metrics.items():
            if key.startswith("train/") and not key.endswith("_epoch") and not key.endswith(EXCLUDED_SUFFIXES):
                if isinstance(value, torch.Tensor) and value.numel() != 1:
                    continue
                name = key.removesuffix("_step")
                values[name] = value
                self._accumulate(name, value)
        if step % self._record_every(trainer):
            return
        for i, optimizer in enumerate(trainer.optimizers):
            lrs = [group["lr"] for group in optimizer.param_groups if "lr" in group]
            if lrs:  # the largest group learning rate: the base rate under layer decay's per-group scales
                values["lr" if len(trainer.optimizers) == 1 else f"lr/{i}"] = float(max(lrs))
        for name, value in values.items():
            number = _scalar(value)  # (the one host read of a logged GPU value, on recorded steps only)
            if number is not None:
                self._add(name, step, number)
        if max((len(p) for n, p in self.series.items() if _is_step_series(n)), default=0) > self.max_points:
            self._thin(trainer)

    def _accumulate(self, name: str, value) -> None:
        """Adds a finite value to this epoch's sum and count without reading it on the host."""
        acc = self._epoch_sums.setdefault(name, [0.0, 0])
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(()).double()
            finite = torch.isfinite(value)
            acc[0] = torch.where(finite, value, 0.0) + acc[0]
            acc[1] = finite.long() + acc[1]
        elif isinstance(value, (int, float)) and math.isfinite(value):
            acc[0] += float(value)
            acc[1] += 1

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module) -> None:
        self.epochs_done = trainer.current_epoch + 1
        for name, (total, count) in self._epoch_sums.items():
            total, count = _scalar(total), int(count)
            if count and total is not None:
                self._add(f"{name} (epoch mean)", trainer.global_step, total / count)
        self._epoch_sums = {}

    def on_validation_end(self, trainer: pl.Trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        for key, value in trainer.callback_metrics.items():
            if key.startswith(("val/", "val_ema/")) and not key.endswith(EXCLUDED_SUFFIXES):
                number = _scalar(value)
                if number is not None:
                    self._add(key, trainer.global_step, number)
        if self.every_validation:
            self.write(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module) -> None:
        self.write(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module, exception: BaseException) -> None:
        self.write(trainer)  # an interrupted run keeps the curves up to where it stopped

    # ---- checkpoint state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return dict(series={k: [list(p) for p in v] for k, v in self.series.items()}, stride=self.stride,
                    epochs_done=self.epochs_done)

    def load_state_dict(self, state_dict: dict) -> None:
        self.series = {k: [list(p) for p in v] for k, v in (state_dict.get("series") or {}).items()}
        self.stride = int(state_dict.get("stride", 1))
        self.epochs_done = int(state_dict.get("epochs_done", 0))

    # ---- drawing --------------------------------------------------------------------------------
    def write(self, trainer: pl.Trainer | None = None) -> str | None:
        """Draws the collected series into ``self.path`` (global rank 0 only); returns the path written."""
        if trainer is not None and not trainer.is_global_zero:
            return None
        if not self.series:
            return None
        steps = trainer.global_step if trainer is not None else None
        subtitle = (f"{self.epochs_done} epoch{'s' * (self.epochs_done != 1)}, {steps} optimizer steps"
                    if steps is not None else "")
        title = " - ".join(t for t in (self.title, subtitle) if t)
        try:
            return plot_curves(self.series, self.path, title=title)
        except Exception as err:  # noqa: BLE001  (a figure must never stop a training run)
            log.warning("training curves: could not write %s: %s", self.path, err)
            return None


def _is_step_series(name: str) -> bool:
    return (name.startswith("train/") and not name.endswith("(epoch mean)")) or name.startswith("lr")


def metric_panels(names) -> dict[str, list[str]]:
    """Panel title -> series drawn in it: ``loss`` (training metrics and validation losses), ``learning
    rate``, then one panel per validation metric kind, the kind being the name's last ``_`` part, so that
    ``val/mse``, ``val/copy_mse`` and ``val/rollout_mse`` share axes, as do ``val/top1`` and ``val_ema/top1``."""
    panels: dict[str, list[str]] = {"loss": [], "learning rate": []}
    for name in names:
        if name.startswith("train/") or name.split("/", 1)[-1] == "loss":
            panels["loss"].append(name)
        elif name.startswith("lr"):
            panels["learning rate"].append(name)
        else:
            kind = name.split("/", 1)[-1].rsplit("_", 1)[-1]
            panels.setdefault(kind, []).append(name)
    return {title: members for title, members in panels.items() if members}


def smoothed(values: np.ndarray) -> np.ndarray:
    """Debiased exponential moving average over about a twentieth of the points (as TensorBoard smooths)."""
    weight = 1.0 - min(1.0, 20.0 / max(len(values), 1))
    out, avg = np.empty(len(values)), 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1.0 - weight) * v
        out[i] = avg / (1.0 - weight ** (i + 1)) if weight > 0 else v
    return out


def plot_curves(series: dict[str, list], path: str, title: str = "") -> str:
    """Writes :func:`draw_curves` to ``path`` (PNG, atomically); returns the path."""
    return save_figure(draw_curves(series, title), path)


def draw_curves(series: dict[str, list], title: str = ""):
    """One panel per :func:`metric_panels` group, x = optimizer step; a panel whose values span 30x or
    more gets a log scale.  Per-step training metrics are drawn faint with their smoothed curve on top;
    the learning rate as it is; per-epoch and validation series as lines with markers.  Returns the figure."""
    panels = metric_panels(series)
    cols = 2 if len(panels) <= 4 else 3
    rows = math.ceil(len(panels) / cols)
    fig = new_figure(5.0 * cols, 3.4 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (panel, names) in zip(axes, panels.items()):
        values = []
        for i, name in enumerate(names):
            points = np.asarray(series[name], dtype=float).reshape(-1, 2)
            x, y = points[:, 0], points[:, 1]
            color = f"C{i}"
            if name.startswith("train/") and _is_step_series(name) and len(x) > 20:  # noisy: smoothed
                ax.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(x, smoothed(y), color=color, linewidth=1.5, label=f"{name} (smoothed)")
            else:
                ax.plot(x, y, color=color, linewidth=1.5, marker="o" if len(x) <= 60 else None, markersize=3,
                        label=name)
            values.extend(y)
        if values and min(values) > 0 and max(values) / min(values) >= 30:
            ax.set_yscale("log")
        unit = " (%)" if panel.startswith("top") else ""
        ax.set_title(panel + unit, fontsize=10)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig
