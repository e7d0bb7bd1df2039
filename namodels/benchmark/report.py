"""Throughput results: CSV / JSON / Markdown table, a PNG chart, and the speed targets against timm baselines.

``python -m namodels.benchmark.report DIR`` rebuilds ``DIR/throughput.{csv,json,md,png}`` from
``DIR/rows.jsonl`` (what a run appends to, row by row).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics

# timm benchmark.py's columns first (same names and units: samples/s, ms per step, param_count in
# millions, GMACs per sample), then ours.
COLUMNS = (
    "model", "backend", "precision",
    "infer_samples_per_sec", "infer_step_time", "infer_batch_size", "infer_img_size", "infer_gmacs",
    "train_samples_per_sec", "train_step_time", "train_batch_size", "train_img_size",
    "param_count",
    "infer_peak_mem_mib", "train_peak_mem_mib", "na_gmacs", "infer_iters", "train_iters",
    "infer_gpu_ms", "train_gpu_ms",
    "channels_last", "compile", "device", "status", "infer_error", "train_error",
)

NO_BACKEND = "-"  # rows of models without neighborhood attention (timm baselines)
BACKEND_ORDER = ("naive", "gemm", "fused", "flex", "sdpa", NO_BACKEND)
BACKEND_COLORS = {"naive": "#9e9e9e", "gemm": "#1f77b4", "fused": "#d62728", "flex": "#2ca02c",
                  "sdpa": "#9467bd", NO_BACKEND: "#ff7f0e"}
BACKEND_LABELS = {"sdpa": "dense SDPA (same model)", NO_BACKEND: "timm baseline"}


def row_key(row: dict) -> tuple:
    """(model, backend, precision, round): a run with ``--rounds`` measures each row once per round."""
    return row["model"], row["backend"], row["precision"], row.get("round", 0)


# What a row with several rounds reports: the median of each round's value.
ROUND_MEDIANS = tuple(f"{phase}_{name}" for phase in ("infer", "train")
                      for name in ("samples_per_sec", "step_time", "gpu_ms"))


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (model, backend, precision): a row measured in several rounds (``round`` 0, 1, ...) becomes its
    first fully measured round's row with the medians of ``ROUND_MEDIANS`` over the rounds that have them, the
    rounds' samples/s as ``<phase>_samples_per_sec_rounds`` and ``rounds`` the count; a row of one round is kept as
    it is."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(row_key(row)[:3], []).append(row)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        group.sort(key=lambda r: r.get("round", 0))
        base = next((r for r in group if r.get("status") == "ok"), group[0])  # a measured round's facts and status
        row = {k: v for k, v in base.items() if k != "round"}
        row["rounds"] = len(group)
        for name in ROUND_MEDIANS:
            values = [r[name] for r in group if r.get(name) is not None]
            row[name] = statistics.median(values) if values else None
            if name.endswith("samples_per_sec"):
                row[f"{name}_rounds"] = values
        merged.append(row)
    return merged


def read_rows(path: str) -> list[dict]:
    """Rows of a ``rows.jsonl``; a later row with the same (model, backend, precision, round) replaces an earlier."""
    rows: dict[tuple, dict] = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    row = json.loads(line)
                    rows[row_key(row)] = row
    return list(rows.values())


def append_row(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fmt(value, digits=1):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _ratio(rows, model, precision, phase, num_backend, den_backend, den_model=None):
    def get(m, b):
        for r in rows:
            if (r["model"], r["backend"], r["precision"]) == (m, b, precision):
                return r.get(f"{phase}_samples_per_sec")
        return None

    a, b = get(model, num_backend), get(den_model or model, den_backend)
    return None if not a or not b else a / b


SWIN_T = "swin_tiny_patch4_window7_224"


def target_checks(rows: list[dict]) -> list[dict]:
    """The project's speed targets that these rows can answer (bf16): NAT-Tiny and DiNAT-Tiny on the fused
    kernels at least as fast as Swin-T, inference and training step.  ``value`` None = not measured."""
    checks = [(f"{model} fused {label} >= Swin-T, bf16",
               _ratio(rows, model, "bf16", phase, "fused", NO_BACKEND, SWIN_T), 1.0)
              for model in ("nat_tiny", "dinat_tiny") for phase, label in (("infer", "inference"), ("train", "training"))]
    return [dict(target=t, value=v, threshold=th, met=None if v is None else v >= th) for t, v, th in checks]


HOST_BOUND = 1.1  # a step whose wall time exceeds its GPU time by this factor is marked host-bound


def _host_note(row: dict, phase: str) -> str | None:
    wall, gpu = row.get(f"{phase}_step_time"), row.get(f"{phase}_gpu_ms")
    if wall and gpu and wall > HOST_BOUND * gpu:
        return f"{phase} host-bound ({wall / gpu:.2f}x GPU time)"
    return None


def has_gpu_times(rows: list[dict]) -> bool:
    """Whether any row has a GPU time (rows measured on CUDA; CPU rows have none)."""
    return any(r.get(f"{phase}_gpu_ms") is not None for r in rows for phase in ("infer", "train"))


def markdown_table(rows: list[dict]) -> str:
    """One line per row.  The step times show the GPU time in parentheses ("ms (GPU)" columns) only where some
    row has one: a table of CPU rows is headed "infer ms" / "train ms"."""
    gpu = has_gpu_times(rows)
    ms = "ms (GPU)" if gpu else "ms"
    head = (f"| model | backend | precision | compile | infer img/s | infer {ms} | train img/s | train {ms} "
            "| batch (inf/train) | infer mem GiB | train mem GiB | params M | GMACs (NA) | notes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        notes = "; ".join(x for x in (r.get("infer_error"), r.get("train_error"), _host_note(r, "infer"),
                                       _host_note(r, "train")) if x)

        def timed(phase, r=r):
            wall = _fmt(r.get(f"{phase}_step_time"), 2)
            return f"{wall} ({_fmt(r.get(f'{phase}_gpu_ms'), 2)})" if gpu else wall
        mem = lambda v: _fmt(None if v is None else v / 1024, 2)  # noqa: E731
        lines.append("| " + " | ".join([
            r["model"], r["backend"], r["precision"], str(r.get("compile") or "eager"),
            _fmt(r.get("infer_samples_per_sec")), timed("infer"),
            _fmt(r.get("train_samples_per_sec")), timed("train"),
            f"{_fmt(r.get('infer_batch_size'))}/{_fmt(r.get('train_batch_size'))}",
            mem(r.get("infer_peak_mem_mib")), mem(r.get("train_peak_mem_mib")),
            _fmt(r.get("param_count"), 2),
            f"{_fmt(r.get('infer_gmacs'), 3)} ({_fmt(r.get('na_gmacs'), 3)})",
            notes.replace("|", "/")[:160],
        ]) + " |")
    return "\n".join(lines)


def targets_markdown(rows: list[dict]) -> str:
    """The speed targets' table; empty for rows without GPU times (the targets are GPU ones: a CPU run measures
    none of them, and the JSON keeps them all)."""
    if not has_gpu_times(rows):
        return ""
    lines = ["| target | measured | met |", "|---|---|---|"]
    for c in target_checks(rows):
        value = "not measured" if c["value"] is None else f"{c['value']:.2f}x"
        met = "–" if c["met"] is None else ("yes" if c["met"] else "no")
        lines.append(f"| {c['target']} | {value} | {met} |")
    return "\n".join(lines)


def write_tables(rows: list[dict], out_dir: str, meta: dict | None = None, stem: str = "throughput") -> dict:
    """``<stem>.csv`` (COLUMNS), ``<stem>.json`` ({meta, rows, targets}), ``<stem>.md``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"{stem}.{ext}") for ext in ("csv", "json", "md")}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in COLUMNS})
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta or {}, "rows": rows, "targets": target_checks(rows)}, f, indent=1)
    with open(paths["md"], "w") as f:
        if meta:
            f.write(" ".join(f"{k}: {v};" for k, v in meta.items() if k != "command") + "\n\n")
            if meta.get("command"):
                f.write(f"Command: `{meta['command']}`\n\n")
        targets = targets_markdown(rows)
        f.write(markdown_table(rows) + "\n" + (f"\n{targets}\n" if targets else ""))
    return paths


def plot(rows: list[dict], path: str, title: str = "") -> str | None:
    """Grouped bars: samples/s per model (x), one bar per backend; one panel per (precision, phase).
    A panel whose values span 20x or more (naive next to fused) gets a log scale, labelled as such."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.FuncFormatter below)

    measured = [r for r in rows if r.get("infer_samples_per_sec") or r.get("train_samples_per_sec")]
    if not measured:
        return None
    precisions = [p for p in ("bf16", "fp16", "tf32", "fp32") if any(r["precision"] == p for r in measured)]
    models = list(dict.fromkeys(r["model"] for r in measured))
    backends = [b for b in BACKEND_ORDER if any(r["backend"] == b for r in measured)]
    backends += sorted({r["backend"] for r in measured} - set(backends))
    phases = [p for p in ("infer", "train") if any(r.get(f"{p}_samples_per_sec") for r in measured)]
    fig, axes = plt.subplots(len(precisions), len(phases), squeeze=False,
                             figsize=(max(8.0, 0.9 * len(models) * len(phases) + 3), 3.6 * len(precisions)))
    index = {row_key(r)[:3]: r for r in measured}
    for i, precision in enumerate(precisions):
        for j, phase in enumerate(phases):
            ax = axes[i][j]
            # per model, only the backends it has, centred on the model's tick; one bar width everywhere
            present = {m: [b for b in backends if index.get((m, b, precision), {}).get(f"{phase}_samples_per_sec")]
                       for m in models}
            width = 0.8 / max(1, max(len(v) for v in present.values()))
            for m_i, model in enumerate(models):
                for b_i, backend in enumerate(present[model]):
                    value = index[(model, backend, precision)][f"{phase}_samples_per_sec"]
                    x = m_i + width * (b_i - (len(present[model]) - 1) / 2)
                    ax.bar(x, value, width * 0.95, color=BACKEND_COLORS.get(backend, "#333333"))
                    ax.annotate(f"{value:,.0f}" if value >= 10 else f"{value:.2g}", (x, value), xytext=(0, 2),
                                textcoords="offset points", ha="center", va="bottom", rotation=90, fontsize=6)
            values = [index[(m, b, precision)][f"{phase}_samples_per_sec"] for m in models for b in present[m]]
            if values and max(values) / min(values) >= 20:  # log only where the bars span orders of magnitude
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
                    lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                ax.set_ylabel("samples / s (log scale)")
            else:
                ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
                ax.set_ylabel("samples / s")
            ax.margins(y=0.25)
            ax.set_xticks(range(len(models)))
            ax.set_xticklabels(models, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{'inference' if phase == 'infer' else 'training step'} — {precision}", fontsize=10)
            ax.grid(axis="y", which="both", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=BACKEND_COLORS.get(b, "#333333")) for b in backends]
    fig.legend(handles, [BACKEND_LABELS.get(b, b) for b in backends], loc="upper center", ncol=len(backends),
               fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, y=0.005, va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rebuild(out_dir: str, meta: dict | None = None, chart: bool = True) -> dict:
    """Tables (and chart) of ``out_dir`` from its ``rows.jsonl`` (rounds merged: ``merge_rounds``)."""
    rows = merge_rounds(read_rows(os.path.join(out_dir, "rows.jsonl")))
    if meta is None:
        old = os.path.join(out_dir, "throughput.json")
        if os.path.isfile(old):
            with open(old) as f:
                meta = json.load(f).get("meta")
    paths = write_tables(rows, out_dir, meta)
    if chart:
        title = ", ".join(f"{k} {meta[k]}" for k in ("device", "torch", "date") if meta and meta.get(k))
        png = plot(rows, os.path.join(out_dir, "throughput.png"), title)
        if png:
            paths["png"] = png
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--no-chart", action="store_true")
    args = parser.parse_args(argv)
    for kind, path in rebuild(args.out_dir, chart=not args.no_chart).items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
