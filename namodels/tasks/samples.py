"""Sample images of a task's predictions: in TensorBoard at each validation, as PNGs in the run folder at
the end of training.

A task module opts in with ``sample_figures(batch, outputs) -> {name: matplotlib Figure}``, drawn from
(the first items of) a validation batch and what its ``validation_step`` returned for it (``None``: the
module runs its model with the current weights): the classification task a grid of images titled
with predicted / true labels, the video task its predicted-vs-true frame strip.  :class:`SampleImages`
calls it on the first validation batch, logs the figures to every active TensorBoard logger
(``val/<name>`` images at the global step) and, when training ends, writes them as
``dirpath/<name>.png`` from the same batch with the final weights.  The drawing helpers below make those
figures from image tensors (``torchvision.utils.make_grid`` on an Agg canvas).  In a validation run
(``trainer.validate``, e.g. ``eval.py task=video``) the files are written from the first batch at once.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torchvision.utils import make_grid

from ..utils.figures import figure_to_array, new_figure, save_figure

log = logging.getLogger(__name__)


def first_items(batch, count: int):
    """A CPU copy of the first ``count`` items of every tensor in a (nested) batch; other values as they are."""
    return apply_to_collection(batch, torch.Tensor, lambda t: t[:count].detach().cpu().clone())


class SampleImages(Callback):
    """See the module docstring.

    Args:
        dirpath: where the end-of-training PNGs go (the run folder); ``None``: no files.
        num_samples: items of the first validation batch kept for the figures.
        tensorboard: log the figures to the TensorBoard loggers at each validation.
    """

    def __init__(self, dirpath: str | None = None, num_samples: int = 16, tensorboard: bool = True):
        super().__init__()
        if num_samples < 1:
            raise ValueError(f"num_samples: at least 1, got {num_samples}")
        self.dirpath, self.num_samples, self.tensorboard = dirpath, int(num_samples), bool(tensorboard)
        self.batch = self.outputs = None
        self.batch_step = -1      # the global step at which `outputs` were computed
        self.written: list[str] = []

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx,
                                dataloader_idx: int = 0) -> None:
        if batch_idx or dataloader_idx or trainer.sanity_checking or not hasattr(pl_module, "sample_figures"):
            return
        self.batch, self.outputs = first_items(batch, self.num_samples), first_items(outputs, self.num_samples)
        self.batch_step = trainer.global_step
        if trainer.state.fn == TrainerFn.VALIDATING:  # a validation run (eval.py): the files now
            self._save(trainer, pl_module.sample_figures(self.batch, self.outputs))
            return
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)] if self.tensorboard else []
        if not loggers:
            return
        # every process draws (a module that runs its model needs every process of a sharded strategy); rank 0 logs
        figures = pl_module.sample_figures(self.batch, self.outputs)
        if not trainer.is_global_zero:
            return
        for name, fig in figures.items():
            image = figure_to_array(fig)
            for logger in loggers:
                logger.experiment.add_image(f"val/{name}", image, trainer.global_step, dataformats="HWC")

    def on_train_end(self, trainer: pl.Trainer, pl_module) -> None:
        if self.batch is None or self.dirpath is None or not hasattr(pl_module, "sample_figures"):
            return
        # the last validation's outputs if it saw the final weights, else the module computes them again
        outputs = self.outputs if self.batch_step == trainer.global_step else None
        self._save(trainer, pl_module.sample_figures(self.batch, outputs))

    def _save(self, trainer: pl.Trainer, figures: dict) -> None:
        if not trainer.is_global_zero or self.dirpath is None:
            return
        for name, fig in figures.items():
            path = os.path.join(self.dirpath, f"{name}.png")
            try:
                self.written.append(save_figure(fig, path))
            except OSError as err:  # a figure must never fail a finished run
                log.warning("sample images: could not write %s: %s", path, err)


# ------------------------------------------------------------------------------------------ drawing


def labelled_grid(images: torch.Tensor, predicted: Sequence[int], true: Sequence[int],
                  class_names: Sequence[str] | None = None, columns: int | None = None):
    """Images ``[N, C, H, W]`` in [0, 1], each titled ``predicted / true`` (green when they agree, red
    when not).  Returns the figure."""
    count = images.shape[0]
    columns = columns or min(8, math.ceil(math.sqrt(count)))
    rows = math.ceil(count / columns)
    fig = new_figure(1.3 * columns + 0.2, 1.45 * rows + 0.5)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()

    def name(index: int) -> str:
        index = int(index)
        return str(class_names[index]) if class_names is not None and 0 <= index < len(class_names) else str(index)

    for i, ax in enumerate(axes):
        ax.set_axis_off()
        if i >= count:
            continue
        image = images[i].float().clamp(0, 1)
        image = image.expand(3, -1, -1) if image.shape[0] == 1 else image[:3]
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        ok = int(predicted[i]) == int(true[i])
        ax.set_title(f"{name(predicted[i])} / {name(true[i])}", fontsize=8, color="tab:green" if ok else "tab:red")
    correct = sum(int(p) == int(t) for p, t in zip(predicted, true))
    fig.suptitle(f"predicted / true label ({correct} of {count} right)", fontsize=9)
    return fig


def frame_strip(true: torch.Tensor, predicted: torch.Tensor, context: int, title: str = ""):
    """Predicted-vs-true frames of clips ``true [N, T, C, H, W]`` (values in [0, 1]) and ``predicted
    [N, T - context, C, H, W]`` (the frames generated after ``context`` given ones): per clip a row of the
    true clip and below it the same context followed by the prediction, a line marking where the
    prediction starts.  Returns the figure."""
    n, frames, _, height, width = true.shape
    if predicted.shape[1] != frames - context:
        raise ValueError(f"predicted: {frames - context} frames expected after {context} context frames of "
                         f"{frames}, got {predicted.shape[1]}")
    rows = []
    for i in range(n):
        rows.append(true[i])
        rows.append(torch.cat([true[i, :context], predicted[i].to(true.dtype)], dim=0))
    pad = 2
    grid = make_grid(torch.cat(rows).float().clamp(0, 1), nrow=frames, padding=pad, pad_value=1.0)
    fig = new_figure(max(4.0, 0.55 * frames + 1.6), 0.55 * 2 * n + 0.9)
    ax = fig.add_subplot()
    ax.imshow(grid.permute(1, 2, 0).numpy(), interpolation="nearest")
    step_x, step_y = width + pad, height + pad
    ax.axvline(pad / 2 + context * step_x, color="tab:red", linewidth=1.5)
    ax.set_xticks([pad + t * step_x + width / 2 for t in range(frames)], [str(t) for t in range(frames)], fontsize=7)
    ax.set_yticks([pad + r * step_y + height / 2 for r in range(2 * n)],
                  [label for i in range(n) for label in (f"clip {i} true", f"clip {i} predicted")], fontsize=7)
    ax.set_xlabel(f"frame (first {context}: given context; after the red line: predicted from them)", fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if title:
        ax.set_title(title, fontsize=9)
    return fig
