"""What a run prints: Lightning's console without its advertisements, empty FLOP counts and negative epoch
totals, so the lines that matter (data, learning rate, metrics, the run folder) stand out.

* :func:`drop_lightning_tips`: a logging filter for Lightning's "💡 Tip: ... litlogger / litmodels" lines;
* :class:`ModelSummary`: ``RichModelSummary`` without the FLOPs column and total when nothing was counted
  (Lightning counts FLOPs only for a module with an ``example_input_array``, and prints 0 otherwise);
* :class:`ProgressBar`: ``RichProgressBar`` that shows "Epoch N" on step-bounded runs (``max_epochs=-1``), where
  Lightning's "Epoch N/max_epochs - 1" reads "Epoch 0/-2", shows the step loss read only every few batches, and
  ends its total where the run ends when the module bounds the run itself (the GAN task's ``max_kimg``).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar

# Loggers behind Lightning's rank_zero_info, which prints the tips.
LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
ADVERTISEMENTS = ("💡 Tip:", "litlogger", "litmodels")


class _DropAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(marker in message for marker in ADVERTISEMENTS)


def drop_lightning_tips() -> None:
    """Installs the filter once per logger; other Lightning messages pass unchanged."""
    for name in LIGHTNING_INFO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdvertisements) for f in logger.filters):
            logger.addFilter(_DropAdvertisements())


class ModelSummary(RichModelSummary):
    """``RichModelSummary`` (same arguments); FLOPs are shown only when Lightning counted some."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int = 0,
                  **summarize_kwargs: Any) -> None:
        if total_flops:
            RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                       total_training_modes, total_flops, **summarize_kwargs)
            return
        from lightning.pytorch.utilities.model_summary.model_summary import (get_formatted_model_size,
                                                                             get_human_readable_count)
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            right = name in ("Params", "Params per Device", "In sizes", "Out sizes")
            table.add_column(name, justify="right" if right else "left", style="dim" if name == " " else None,
                             no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        totals = Table.grid(expand=True)
        totals.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            totals.add_row(f"[bold]{label}[/]: {value}")
        console.print(totals)


class ProgressBar(RichProgressBar):
    """``RichProgressBar`` (same arguments) whose description leaves out the epoch total when the run is bounded
    by steps or time instead of epochs, and which never makes a training step wait for the GPU.

    Lightning's bar shows metrics logged with ``prog_bar=True``, which Lightning turns into numbers after every
    batch: with a metric that lives on the GPU (the step loss) each step waits for the GPU there, and a wait per
    step keeps the host from queueing the next step meanwhile.  The tasks therefore log the step loss without
    ``prog_bar``; this bar shows ``step_metrics`` (logged values, by name) beside Lightning's, and reads them only
    every ``metrics_every_n_batches`` training batches (None: the trainer's ``log_every_n_steps``, when the loggers
    read them anyway) and at the end of an epoch.

    A module that stops the run itself (the GAN task stops at ``max_kimg``, which Lightning does not know) may
    define ``train_batches_left()``: the training batches still to come, or None.  The bar's total is then the
    epoch's batches or the run's end, whichever comes first (Lightning's total would be the whole epoch, and the bar
    would stop part-way, e.g. at 250/1250)."""

    def __init__(self, *args: Any, metrics_every_n_batches: int | None = None,
                 step_metrics: Sequence[str] = ("train/loss_step",), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if metrics_every_n_batches is not None and int(metrics_every_n_batches) < 1:
            raise ValueError(f"metrics_every_n_batches: must be >= 1 or None, got {metrics_every_n_batches!r}")
        if isinstance(step_metrics, str):
            raise ValueError(f"step_metrics: expected a list of metric names, got the string {step_metrics!r}")
        self.metrics_every_n_batches = metrics_every_n_batches
        self.step_metrics = tuple(step_metrics)
        self._epoch_batches_done = 0  # this epoch's training batches finished when the bar's total is set

    @property
    def total_train_batches(self) -> int | float:
        total = super().total_train_batches
        left = getattr(self.trainer.lightning_module, "train_batches_left", None)
        left = left() if callable(left) else None
        if left is None:
            return total
        return min(total, self._epoch_batches_done + left)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._epoch_batches_done = 0
        super().on_train_epoch_start(trainer, pl_module)

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        logged = trainer.callback_metrics
        for name in self.step_metrics:
            if name in logged and name not in items:
                value = logged[name]
                items[name] = value.item() if isinstance(value, torch.Tensor) else value
        return items

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._epoch_batches_done = batch_idx + 1  # (a run resumed mid-epoch sets its total at its first batch)
        every = int(self.metrics_every_n_batches or trainer.log_every_n_steps or 1)
        if (batch_idx + 1) % every == 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        # the position only, as Lightning's hook does before it reads the metrics
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, batch_idx + 1)
        self.refresh()

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        if len(self.validation_description) > len(description):  # equal widths keep the bars from jumping
            description = f"{description:{len(self.validation_description)}}"
        return description
