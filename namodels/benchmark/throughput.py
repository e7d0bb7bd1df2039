"""Model throughput per NA kernel backend (no Hydra needed).

For each model x backend x precision: inference and training step (forward + backward + optimizer
step) samples/s, step time (median over timed samples, each ``BACK_TO_BACK`` steps run back to back as a training
loop runs them, CUDA events, after warm-up), peak memory,
parameters and GMACs per sample, on a fixed random input, with batch-size decay on OOM.  Columns
follow timm's ``benchmark.py`` plus ``backend`` and ``precision``.

    python -m namodels.benchmark.throughput --models nat_mini dinat_mini / nat_small \\
        --backends naive gemm fused flex sdpa --precisions bf16 fp32 --batch 128 --out results/

``/`` splits ``--models`` into priority groups: every precision of a group runs before the next group.
Backends: the NA backends of ``ops`` and ``sdpa`` (the same model with each NA layer replaced by dense
SDPA over all tokens, :mod:`namodels.benchmark.models`).  Models without NA (timm baselines such as
``swin_tiny_patch4_window7_224``, ``convnext_tiny``) run once per precision, backend ``-``.
Besides timm names: ``stylenat_256`` / ``stylenat_1024`` (generator, images/s, inference only) and the
``video_nat_*`` models (clips of ``--frames`` frames at ``--img-size``).

Other code measures its own models with :func:`measure_throughput` (a model factory and an input
factory).  Every row is appended to ``OUT/rows.jsonl`` as soon as it is measured and the tables are
rewritten, so a run stopped from outside keeps what it did.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import ops

from ..backend import set_backend
from ..speed import (COMPILE_MODES, calling_thread_backward, compile_mode, compile_options, compiled,
                     optimizer_kwargs)
from . import report
from .flops import count_macs
from .models import swap_dense_attention
from .timing import (PRECISIONS, TimingSettings, autocast, check_precision, cuda_context_ok, free_memory,
                     gpu_time_ms, median_ms, peak_memory, tf32_mode, time_steps, with_batch_decay)

log = logging.getLogger(__name__)

DENSE = "sdpa"
NO_BACKEND = report.NO_BACKEND
GROUP_SEPARATOR = "/"
DEFAULT_MODELS = ["nat_mini", "dinat_mini", "nat_tiny", "swin_tiny_patch4_window7_224", "convnext_tiny",
                  GROUP_SEPARATOR, "dinat_tiny", "nat_small", "dinat_small", "nat_base", "dinat_base", "dinat_large"]
# A run on a CPU with no models named measures these (a couple of minutes; the list above would take about an
# hour there); ``configs/task/throughput.yaml``'s ``device_defaults.cpu`` says the same for ``eval.py``.
CPU_DEFAULTS = {"models": ["nat_mini", "dinat_mini"], "backends": ["gemm", DENSE], "batch_size": 2}
# Steps per timed sample on CUDA, back to back as a training loop runs them: the host queues a step while the GPU
# finishes the previous one, which a synchronisation after every step would forbid (``TimingSettings.back_to_back``).
BACK_TO_BACK = 5
_RESTARTS_ENV, _DEADLINE_ENV = "NAMODELS_BENCH_RESTARTS", "NAMODELS_BENCH_DEADLINE"
MAX_RESTARTS = 8


# ---------------------------------------------------------------------------------------------- models


@dataclass
class ModelSpec:
    """How to build a model and its input.  ``build()`` runs under ``with torch.device(device)`` (so
    parameters are created on the GPU directly); ``make_input(batch_size, device)`` returns the tuple of
    positional inputs; ``loss(output)`` gives the scalar a training step minimises (default: cross-entropy
    on fixed random labels for ``[B, classes]`` outputs, else the mean square)."""

    name: str
    build: Callable[[], nn.Module]
    make_input: Callable[[int, torch.device], tuple]
    img_size: int | None = None
    trainable: bool = True
    loss: Callable[[torch.Tensor], torch.Tensor] | None = None


def fixed_randn(*shape, device, seed: int = 0) -> torch.Tensor:
    """The same random tensor for every call with the same arguments (never zeros)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device)


class DefaultLoss:
    """Cross-entropy against fixed random labels for logits ``[B, C]``, mean square otherwise."""

    def __init__(self):
        self._targets: dict = {}

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        if output.dim() == 2:
            key = (output.shape, output.device)
            if key not in self._targets:
                generator = torch.Generator().manual_seed(1)
                self._targets[key] = torch.randint(output.shape[1], (output.shape[0],),
                                                   generator=generator).to(output.device)
            return F.cross_entropy(output.float(), self._targets[key])
        return output.float().square().mean()


def _timm_factory(name: str, img_size: int | None):
    import timm

    def build():
        default = None
        try:
            default = timm.models.get_pretrained_cfg(name).input_size[-1]
        except Exception:  # noqa: BLE001  (no pretrained cfg: build as is)
            pass
        if img_size is not None and default is not None and img_size != default:
            try:  # models with size-dependent layers (Swin) take img_size; others (NAT, ConvNeXt) do not
                return timm.create_model(name, pretrained=False, img_size=img_size)
            except TypeError:
                pass
        return timm.create_model(name, pretrained=False)

    return build


def model_spec(name: str, img_size: int = 224, frames: int = 8) -> ModelSpec:
    """Spec for a timm model name (NAT/DiNAT/DiNAT_s, any timm baseline), ``stylenat_<size>`` or
    ``video_nat_*``."""
    import namodels  # noqa: F401  registers the project's models in timm

    if name.startswith("stylenat_"):
        size = int(name.split("_", 1)[1])
        from namodels.models.stylenat import StyleNATGenerator

        def build_g():
            return StyleNATGenerator(size)

        return ModelSpec(name, build_g, lambda b, d: (fixed_randn(b, 512, device=d),), img_size=size, trainable=False)
    if name.startswith("video_nat"):
        import timm

        chans = {}

        def build_video():
            model = timm.create_model(name, pretrained=False, img_size=img_size)
            chans["in_chans"] = model.in_chans
            return model

        def clip(b, d):
            return (fixed_randn(b, frames, chans.get("in_chans", 3), img_size, img_size, device=d),)

        return ModelSpec(name, build_video, clip, img_size=img_size)
    return ModelSpec(name, _timm_factory(name, img_size),
                     lambda b, d: (fixed_randn(b, 3, img_size, img_size, device=d),), img_size=img_size)


# ----------------------------------------------------------------------------------------- one row


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _is_unsupported_message(message: str) -> bool:
    """A backend that cannot serve the model's problems (``ops`` raises ``ValueError('backend: ...')``)."""
    return message.startswith("ValueError: backend:")


def _resolve_device(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _check_backend(backend: str | None) -> None:
    if backend in (None, NO_BACKEND, DENSE):
        return
    if backend not in ops.available_backends():
        raise ValueError(f"backend: unknown backend {backend!r}; choose one of "
                         f"{sorted(ops.available_backends()) + [DENSE]} or None")


def build_model(spec_build: Callable[[], nn.Module], device: torch.device, backend: str | None,
                channels_last: bool) -> nn.Module:
    try:  # parameters created on the device directly: large models initialise in a fraction of the time
        with torch.device(device):
            model = spec_build()
    except Exception:  # noqa: BLE001  (a constructor with host-only code, e.g. numpy on tensors): build on CPU
        if device.type == "cpu":
            raise
        model = spec_build()
    model = model.to(device)
    if backend == DENSE:
        swap_dense_attention(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def _as_inputs(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _inputs(make_input, batch: int, device: torch.device, channels_last: bool) -> tuple:
    xs = _as_inputs(make_input(batch, device))
    if channels_last:
        xs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in xs)
    return xs


def _infer_once(model, make_input, batch, device, precision, settings, channels_last):
    inputs = _inputs(make_input, batch, device, channels_last)
    model.eval()

    def step():
        with torch.no_grad(), autocast(precision, device):
            model(*inputs)

    with peak_memory(device) as mem:
        times = time_steps(step, device, settings)
    return {"times": times, "mem": mem["mib"], "gpu_ms": gpu_time_ms(step, device)}


def _train_once(model, make_input, batch, device, precision, settings, channels_last, loss_fn, opt, lr):
    from timm.optim import create_optimizer_v2

    inputs = _inputs(make_input, batch, device, channels_last)
    model.train()
    optimizer = create_optimizer_v2(model, opt=opt, lr=lr, weight_decay=0.05, **optimizer_kwargs(opt, device))
    scaler = torch.amp.GradScaler(device.type) if PRECISIONS[precision][0] == torch.float16 else None

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast(precision, device):
            loss = loss_fn(model(*inputs))
        with calling_thread_backward():  # as the training tasks run it, for every model alike
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    try:
        with peak_memory(device) as mem:
            times = time_steps(step, device, settings)
        gpu_ms = gpu_time_ms(step, device)
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
    return {"times": times, "mem": mem["mib"], "gpu_ms": gpu_ms}


def measure_throughput(
    model_factory: Callable[[], nn.Module],
    input_factory: Callable[[int, torch.device], object],
    *,
    name: str,
    backend: str | None = None,
    precision: str = "bf16",
    batch_size: int = 8,
    img_size=None,
    device=None,
    infer: bool = True,
    train: bool = True,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    settings: TimingSettings | None = None,
    channels_last: bool = False,
    compile: bool | str = False,
    opt: str = "adamw",
    lr: float = 1e-4,
    count_flops: bool = True,
    macs: dict | None = None,
) -> dict:
    """One result row (see ``report.COLUMNS``) for ``model_factory()`` fed ``input_factory(batch, device)``.

    ``backend``: an ``ops`` backend forced on every NA call of the model, ``'sdpa'`` (NA layers swapped
    for dense SDPA), or ``None`` / ``'-'`` (the model as built).  ``precision``: fp32 | tf32 | fp16 | bf16
    (16-bit: autocast, float32 weights).  ``compile``: False (eager), True (``torch.compile`` default
    mode) or a mode name (``COMPILE_MODES``).  The optimizer is ``opt`` from timm with
    ``optimizer_kwargs`` (fused AdamW on CUDA), the backward runs on the calling thread
    (``calling_thread_backward``), as in the training tasks.  Each phase also records its GPU time per step
    (``gpu_time_ms``).  Errors are caught and reported in ``infer_error`` /
    ``train_error`` (an OOM first retries with a smaller batch); the row's ``cuda_ok`` is False when the
    CUDA context did not survive.  ``macs`` (from :func:`namodels.benchmark.flops.count_macs` at batch 1)
    skips the FLOP count.
    """
    check_precision(precision)
    _check_backend(backend)
    mode = compile_mode(compile)
    device = _resolve_device(device)
    settings = settings or TimingSettings()
    loss_fn = loss_fn or DefaultLoss()
    na_backend = backend if backend not in (None, NO_BACKEND, DENSE) else None
    row: dict = dict(model=name, backend=backend or NO_BACKEND, precision=precision, infer_img_size=img_size,
                     train_img_size=img_size if train else None, channels_last=channels_last, compile=mode or False,
                     device=_device_name(device))
    model = build_model(model_factory, device, backend, channels_last)
    row["param_count"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    if count_flops and macs is None:
        macs = count_macs(model, _inputs(input_factory, 1, device, channels_last))
    if macs is not None:
        row["infer_gmacs"] = round(macs["macs"] / 1e9, 6)
        row["na_gmacs"] = round(macs["na_macs"] / 1e9, 6)
    runner = compiled(model, mode) if mode else model
    backend_ctx = set_backend(model, na_backend) if na_backend else contextlib.nullcontext()
    phases = [("infer", infer), ("train", train)]
    skip_reason = None
    with backend_ctx, tf32_mode(PRECISIONS[precision][1]):
        for phase, wanted in phases:
            if not wanted:
                continue
            if skip_reason:
                row[f"{phase}_error"] = skip_reason
                continue

            def run(b, phase=phase):
                if phase == "infer":
                    return _infer_once(runner, input_factory, b, device, precision, settings, channels_last)
                return _train_once(runner, input_factory, b, device, precision, settings, channels_last, loss_fn,
                                   opt, lr)

            try:
                result, used = with_batch_decay(run, batch_size)
            except Exception as err:  # noqa: BLE001  (a benchmark reports failures and goes on)
                row[f"{phase}_error"] = _short(err)
                log.warning("%s %s %s %s failed: %s", name, backend, precision, phase, row[f"{phase}_error"])
                del err
                if not cuda_context_ok(device):  # e.g. an illegal memory access: nothing more can run here
                    row.update(cuda_ok=False, crash=phase)
                    skip_reason = f"not run: CUDA context lost in {phase}"
                elif _is_unsupported_message(row[f"{phase}_error"]):
                    skip_reason = row[f"{phase}_error"]
                free_memory()
                continue
            step = median_ms(result["times"])
            row.update({
                f"{phase}_samples_per_sec": round(used * 1e3 / step, 2),
                f"{phase}_step_time": round(step, 3),
                f"{phase}_batch_size": used,
                f"{phase}_peak_mem_mib": None if result["mem"] is None else round(result["mem"], 1),
                f"{phase}_iters": len(result["times"]),
                f"{phase}_gpu_ms": None if result["gpu_ms"] is None else round(result["gpu_ms"], 3),
            })
            free_memory()
    del runner, model
    free_memory()
    errors = [row.get(f"{p}_error") for p, wanted in phases if wanted]
    row["status"] = "ok" if not any(errors) else ("error" if all(errors) else "partial")
    row.setdefault("cuda_ok", True)
    return row


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


# ------------------------------------------------------------------------------------------ a plan


@dataclass
class BenchOptions:
    """A whole run (what the CLI and ``eval.py task=throughput`` fill in)."""

    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    backends: list[str] | None = None        # None: naive gemm fused flex sdpa (CUDA) / naive gemm flex sdpa
    precisions: list[str] | None = None      # None: bf16 fp32 (CUDA) / fp32 (CPU)
    batch_size: int | None = None            # None: 128 (CUDA) / 8 (CPU)
    img_size: int = 224
    frames: int = 8
    infer: bool = True
    train: bool = True
    channels_last: bool = False
    compile: bool | str = False             # False, True (default mode) or a COMPILE_MODES name
    opt: str = "adamw"
    lr: float = 1e-4
    device: str = "auto"
    timing: TimingSettings | None = None     # None: device defaults (see defaults_for)
    back_to_back: int | None = None          # steps per timed sample; None: the timing's (5 on CUDA, 1 on CPU)
    rounds: int = 1                          # the whole plan this many times, rows alternating; medians reported
    deadline_s: float | None = None          # stop starting rows after this many seconds
    min_row_s: float = 5.0                   # rows are not started with less time than this left
    resume: bool = False                     # skip rows already in out_dir/rows.jsonl
    chart: bool = True
    skip_dense_for_dilated: bool = True      # dinat_X + sdpa == nat_X + sdpa (same dense model) when both run

    def defaults_for(self, device: torch.device) -> "BenchOptions":
        cuda = device.type == "cuda"
        return replace(
            self,
            backends=self.backends or (["naive", "gemm", "fused", "flex", DENSE] if cuda
                                       else ["naive", "gemm", "flex", DENSE]),
            precisions=self.precisions or (["bf16", "fp32"] if cuda else ["fp32"]),
            batch_size=self.batch_size or (128 if cuda else 8),
            timing=self._timing(cuda),
        )

    def _timing(self, cuda: bool) -> TimingSettings:
        """The timing settings (device defaults unless given), with ``back_to_back`` where it is set."""
        timing = self.timing or (TimingSettings(warmup=3, iters=20, min_iters=2, cap_s=5.0, warmup_cap_s=30.0,
                                                back_to_back=BACK_TO_BACK)
                                 if cuda else TimingSettings(warmup=1, iters=2, min_iters=1, cap_s=30.0,
                                                             warmup_cap_s=60.0))
        return timing if self.back_to_back is None else replace(timing, back_to_back=self.back_to_back)


def model_groups(models: Sequence[str]) -> list[list[str]]:
    """``['a', 'b', '/', 'c']`` (or ``'a/c'`` inside one item) -> ``[['a', 'b'], ['c']]``."""
    groups: list[list[str]] = [[]]
    for token in models:
        for i, part in enumerate(str(token).split(GROUP_SEPARATOR)):
            if i > 0:
                groups.append([])
            if part.strip():
                groups[-1].append(part.strip())
    return [g for g in groups if g]


def _meta(device: torch.device, command: str | None) -> dict:
    import timm

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                device=_device_name(device), torch=torch.__version__, timm=timm.__version__,
                python=platform.python_version())
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if command:
        meta["command"] = command
    return meta


def _not_run(name, backend, precision, reason, img_size, device) -> dict:
    return dict(model=name, backend=backend, precision=precision, infer_img_size=img_size, status="skipped",
                infer_error=reason, device=_device_name(device))


class _Run:
    """State of one run: output folder, rows done, model facts (params, MACs, uses NA) cached per model."""

    def __init__(self, options: BenchOptions, out_dir: str, command: str | None):
        self.options, self.out_dir = options, out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.rows_path = os.path.join(out_dir, "rows.jsonl")
        if not options.resume and os.path.isfile(self.rows_path):
            os.remove(self.rows_path)
        self.device = _resolve_device(options.device)
        self.meta = _meta(self.device, command)
        timing = options.timing
        if timing is not None:  # how the steps were timed, which the command leaves to the defaults
            self.meta["timing"] = (f"warmup {timing.warmup}, up to {timing.iters} samples of {timing.back_to_back} "
                                   f"back-to-back steps")
        mode = compile_mode(options.compile)
        if mode:  # every model compiles with the same inductor options
            self.meta["compile_options"] = compile_options(mode)
        if options.rounds > 1:
            self.meta["rounds"] = f"{options.rounds} (rows alternating; each row the median over its rounds)"
        self.done = {report.row_key(r): r for r in report.read_rows(self.rows_path) if r.get("status") != "skipped"}
        # a backend phase that once killed the CUDA context is not tried again in this run
        self.crashed = {(r["backend"], r["crash"]): f"{r['model']} {r['precision']}" for r in self.done.values()
                        if r.get("crash")}
        self.facts: dict[tuple, dict] = {}

    def facts_for(self, spec: ModelSpec, dense: bool) -> dict:
        key = (spec.name, dense)
        if key not in self.facts:
            model = build_model(spec.build, self.device, DENSE if dense else None, False)
            macs = count_macs(model, _as_inputs(spec.make_input(1, self.device)))
            self.facts[key] = dict(macs=macs, uses_na=macs["na_macs"] > 0)
            del model
            free_memory()
        return self.facts[key]

    def write(self, row: dict) -> None:
        report.append_row(self.rows_path, row)
        report.write_tables(report.merge_rounds(report.read_rows(self.rows_path)), self.out_dir, self.meta)


def _backends_for(run: _Run, spec: ModelSpec, group_models: Sequence[str], all_models: Sequence[str]) -> list[str]:
    facts = run.facts_for(spec, dense=False)
    if not facts["uses_na"]:
        return [NO_BACKEND]
    backends = list(run.options.backends)
    if DENSE in backends and run.options.skip_dense_for_dilated and spec.name.startswith("dinat_") and \
            spec.name.replace("dinat_", "nat_", 1) in all_models:
        backends.remove(DENSE)
    return backends


def run_benchmarks(options: BenchOptions, out_dir: str, *, command: str | None = None,
                   restart: Callable[[], None] | None = None, deadline_at: float | None = None,
                   progress: bool | None = None) -> list[dict]:
    """Runs the plan; returns all rows.  ``restart`` (CLI only) is called when the CUDA context died: it
    re-executes the process, which resumes from ``rows.jsonl``; without it the remaining rows are
    recorded as not run.  ``deadline_at`` (epoch seconds) overrides ``options.deadline_s``.
    ``progress``: a progress bar over the rows (model x backend x precision) on stderr; ``None``: only
    when stderr is a terminal.  Log records and the per-row lines print above it."""
    device = _resolve_device(options.device)
    options = options.defaults_for(device)
    for p in options.precisions:
        check_precision(p)
    for b in options.backends:
        _check_backend(b)
    if int(options.rounds) < 1:
        raise ValueError(f"rounds: must be >= 1, got {options.rounds!r}")
    deadline = deadline_at or (time.time() + options.deadline_s if options.deadline_s else None)
    run = _Run(options, out_dir, command)
    groups = model_groups(options.models)
    all_models = [m for g in groups for m in g]
    lost_context = None
    # planned rows: every backend for every model; a model's row count is corrected once its backends are known
    bar = tqdm(total=options.rounds * len(all_models) * len(options.precisions) * len(options.backends),
               desc="throughput",
               unit="row", disable=None if progress is None else not progress, dynamic_ncols=True)
    with bar, logging_redirect_tqdm():
        for round_index in range(options.rounds):  # every row once per round: the rows alternate
            lost_context = _run_round(run, groups, all_models, bar, round_index, lost_context, deadline, restart)
    rows = report.merge_rounds(report.read_rows(run.rows_path))
    report.write_tables(rows, out_dir, run.meta)
    if options.chart:
        report.plot(rows, os.path.join(out_dir, "throughput.png"),
                    ", ".join(f"{k} {run.meta[k]}" for k in ("device", "torch", "date") if run.meta.get(k)))
    return rows


def _run_round(run: _Run, groups: list[list[str]], all_models: list[str], bar, round_index: int,
               lost_context: str | None, deadline: float | None, restart: Callable[[], None] | None) -> str | None:
    """Every row of the plan once (one round); returns the lost-CUDA-context reason, if any."""
    options, device = run.options, run.device
    for group in groups:
        for precision in options.precisions:
            for name in group:
                spec = model_spec(name, options.img_size, options.frames)
                bar.set_postfix_str(f"{name} {precision}")
                try:
                    backends = _backends_for(run, spec, group, all_models) if lost_context is None else \
                        list(options.backends)
                except Exception as err:  # noqa: BLE001  (a model that does not build is reported, not fatal)
                    run.write(dict(_not_run(name, NO_BACKEND, precision, _short(err), spec.img_size, device),
                                   status="error", **_round_tag(options, round_index)))
                    bar.total -= len(options.backends) - 1
                    bar.update(1)
                    continue
                bar.total -= len(options.backends) - len(backends)
                bar.refresh()
                for backend in backends:
                    bar.set_postfix_str(f"{name} {backend} {precision}")
                    try:
                        lost_context = _run_row(run, spec, backend, precision, lost_context, deadline, restart,
                                                round_index)
                    finally:
                        bar.update(1)
    return lost_context


def _round_tag(options: BenchOptions, round_index: int) -> dict:
    """What a row records of its round: nothing in a run of one round (its rows read as before)."""
    return {"round": round_index} if options.rounds > 1 else {}


def _run_row(run: _Run, spec: ModelSpec, backend: str, precision: str, lost_context: str | None,
             deadline: float | None, restart: Callable[[], None] | None, round_index: int = 0) -> str | None:
    """Measures (or records as not run) one row of the plan in one round; returns the lost-CUDA-context reason, if
    any."""
    name, device, options = spec.name, run.device, run.options
    key = (name, backend, precision, round_index)
    in_round = _round_tag(options, round_index)
    if key in run.done:
        return lost_context
    if lost_context is not None:
        run.write(dict(_not_run(name, backend, precision, lost_context, spec.img_size, device), **in_round))
        return lost_context
    if deadline is not None and deadline - time.time() < options.min_row_s:
        run.write(dict(_not_run(name, backend, precision, "not run: time budget spent", spec.img_size, device),
                       **in_round))
        return lost_context
    try:
        row = _measure_row(run, spec, backend, precision)
    except Exception as err:  # noqa: BLE001  (e.g. the model does not build on the device)
        row = dict(_not_run(name, backend, precision, _short(err), spec.img_size, device), status="error")
    if row.get("cuda_ok", True) and not cuda_context_ok(device):
        row.update(cuda_ok=False, crash=row.get("crash") or "infer")
    row.update(in_round)
    run.write(row)  # before anything else: a restart or a kill keeps it
    run.done[key] = row
    tqdm.write(_row_line(row))  # above the progress bar
    sys.stdout.flush()
    if not row.get("cuda_ok", True):
        if restart is not None:
            restart()
        return f"not run: the CUDA context was lost at {name} {backend} {precision}"
    return lost_context


def _measure_row(run: _Run, spec: ModelSpec, backend: str, precision: str) -> dict:
    o = run.options
    train = o.train and spec.trainable
    dense = backend == DENSE
    try:
        macs = run.facts_for(spec, dense=dense)["macs"]
    except Exception as err:  # noqa: BLE001
        return dict(_not_run(spec.name, backend, precision, _short(err), spec.img_size, run.device), status="error")
    crashed = {phase: run.crashed.get((backend, phase)) for phase in ("infer", "train")}
    row = measure_throughput(
        spec.build, spec.make_input, name=spec.name, backend=backend, precision=precision,
        batch_size=o.batch_size, img_size=spec.img_size, device=run.device,
        infer=o.infer and not crashed["infer"], train=train and not crashed["train"], loss_fn=spec.loss,
        settings=o.timing, channels_last=o.channels_last, compile=o.compile, opt=o.opt, lr=o.lr, macs=macs,
    )
    for phase, where in crashed.items():
        if where:
            row[f"{phase}_error"] = f"not run: {backend} {phase} killed the CUDA context earlier ({where})"
    if row.get("crash"):
        run.crashed[(backend, row["crash"])] = f"{spec.name} {precision}"
    if o.train and not spec.trainable:
        row["train_error"] = row.get("train_error") or "not run: inference-only model"
    return row


def _row_line(row: dict) -> str:
    def f(v, unit=""):
        return "-" if v is None else f"{v:,.1f}{unit}"

    errors = "; ".join(e for e in (row.get("infer_error"), row.get("train_error")) if e)
    return (f"{row['model']:<32} {row['backend']:<6} {row['precision']:<5} infer {f(row.get('infer_samples_per_sec'))}/s "
            f"train {f(row.get('train_samples_per_sec'))}/s  {errors[:140]}")


# ------------------------------------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m namodels.benchmark.throughput",
                                description="Model throughput per neighborhood-attention backend.")
    p.add_argument("--models", nargs="+", default=None,
                   help="timm names (NAT/DiNAT/DiNAT_s/baselines), stylenat_<size>, video_nat_*; '/' starts a "
                        "new priority group (default: the GPU list on CUDA; on a CPU nat_mini and dinat_mini, gemm "
                        "against sdpa, batch 2)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="ops backends and/or 'sdpa' (default: naive gemm fused flex sdpa on CUDA, without fused "
                        "on CPU)")
    p.add_argument("--precisions", nargs="+", default=None, choices=list(PRECISIONS),
                   help="default: bf16 fp32 on CUDA, fp32 on CPU")
    p.add_argument("--batch", type=int, default=None, help="default 128 on CUDA, 8 on CPU")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--frames", type=int, default=8, help="clip length for video_nat_* models")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--min-iters", type=int, default=None)
    p.add_argument("--time-cap", type=float, default=None, help="seconds of timed steps per phase")
    p.add_argument("--warmup-cap", type=float, default=None, help="seconds of warm-up per phase")
    p.add_argument("--back-to-back", type=int, default=None,
                   help=f"steps per timed sample, run without a synchronisation between them (default "
                        f"{BACK_TO_BACK} on CUDA, 1 on CPU; 1 times each step alone)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the whole plan this many times, one row after another in each round, and report "
                        "each row's median over the rounds (rows of one run then see the same machine conditions)")
    p.add_argument("--deadline", type=float, default=None, help="start no row after this many seconds")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--keep-gc", action="store_true", help="leave Python's garbage collector on while timing")
    p.add_argument("--no-infer", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   help="torch.compile the model, in this mode (default: 'default')")
    p.add_argument("--opt", default="adamw")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", default="auto")
    p.add_argument("--keep-dense-dilated", action="store_true",
                   help="also run sdpa for dinat_X when nat_X is in the run (the same dense model)")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: one on a terminal)")
    p.add_argument("--resume", action="store_true", help="keep OUT/rows.jsonl and skip the rows it has")
    p.add_argument("--out", required=True)
    return p


def options_from_args(args: argparse.Namespace, device: torch.device) -> BenchOptions:
    base = BenchOptions().defaults_for(device).timing
    timing = TimingSettings(
        warmup=args.warmup if args.warmup is not None else base.warmup,
        iters=args.iters if args.iters is not None else base.iters,
        min_iters=args.min_iters if args.min_iters is not None else min(base.min_iters, args.iters or base.iters),
        cap_s=args.time_cap if args.time_cap is not None else base.cap_s,
        warmup_cap_s=args.warmup_cap if args.warmup_cap is not None else base.warmup_cap_s,
        keep_gc=args.keep_gc,
        back_to_back=base.back_to_back,
    )
    return BenchOptions(
        models=args.models, backends=args.backends, precisions=args.precisions, batch_size=args.batch,
        img_size=args.img_size, frames=args.frames, infer=not args.no_infer, train=not args.no_train,
        channels_last=args.channels_last, compile=args.compile or False, opt=args.opt, lr=args.lr, device=args.device,
        timing=timing, back_to_back=args.back_to_back, rounds=args.rounds, deadline_s=args.deadline,
        resume=args.resume, chart=not args.no_chart, skip_dense_for_dilated=not args.keep_dense_dilated,
    )


def _raise_recompile_limit() -> None:
    """With ``--compile`` every model class's ``forward`` is one code object shared by all its variants,
    precisions and grad modes; dynamo's default recompile limit (8) would silently run the later rows
    uncompiled.  (The flex backend raises the limit for its own calls: ``ops.flex.RECOMPILE_LIMIT``.)"""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = _resolve_device(args.device)
    if args.models is None:
        quick = CPU_DEFAULTS if device.type == "cpu" else {"models": DEFAULT_MODELS}
        args.models = list(quick["models"])
        args.backends = args.backends or quick.get("backends")
        args.batch = args.batch or quick.get("batch_size")
        log.info("models: %s (the %s default; --models names others)", " ".join(args.models), device.type)
    options = options_from_args(args, device)
    # a restarted process (see restart) inherits the deadline and the restart count of the first one
    deadline_at = float(os.environ.pop(_DEADLINE_ENV, 0) or 0) or (
        time.time() + options.deadline_s if options.deadline_s else None)
    restarts = int(os.environ.pop(_RESTARTS_ENV, "0"))
    _raise_recompile_limit()

    def restart():
        if restarts >= MAX_RESTARTS:
            log.error("CUDA context lost %d times; not restarting", restarts + 1)
            return
        os.environ[_RESTARTS_ENV] = str(restarts + 1)
        if deadline_at:
            os.environ[_DEADLINE_ENV] = str(deadline_at)
        log.warning("CUDA context lost: restarting the process to resume (%d)", restarts + 1)
        sys.stdout.flush()
        sys.stderr.flush()
        new_argv = [a for a in argv if a != "--resume"] + ["--resume"]
        os.execv(sys.executable, [sys.executable, "-m", "namodels.benchmark.throughput", *new_argv])

    command = "python -m namodels.benchmark.throughput " + " ".join(shlex.quote(a) for a in argv)
    rows = run_benchmarks(options, args.out, command=command, restart=restart if device.type == "cuda" else None,
                          deadline_at=deadline_at, progress=False if args.no_progress else None)
    print(report.markdown_table(rows))
    targets = report.targets_markdown(rows)
    if targets:  # GPU rows only
        print()
        print(targets)
    return rows


if __name__ == "__main__":
    main()
