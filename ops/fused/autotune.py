"""Kernel configurations: a defaults table, an optional autotuner, and its on-disk cache.

A configuration is (outer tile size, inner tile size, num_warps, num_stages, tma, maxnreg); the N-D tile
shapes follow from the problem through ``tiles.choose_tiles``.  ``tma`` loads the tiles a kernel loops
over (K/V in the forward and dQ, Q/dO in dK/dV, plus dK/dV's own K/V tile where the queries are the
matmul rows) as Hopper bulk copies where the GPU and the tensors allow it (``launch.tma_eligible``);
elsewhere the same configuration runs with pointer loads.
Lookup order for a problem:

1. the in-memory / on-disk cache (JSON at ``$NAMODELS_FUSED_CACHE``, default
   ``~/.cache/namodels/fused_tuning.json``), keyed by kernel, rank, sizes, window, dtype (float32 with its
   matmul precision, ``dot_precision``), head dims, heads, batch, RPB, device name and ``CODE_VERSION`` (entries
   tuned on other code are ignored);
2. if tuning is on (``NAMODELS_FUSED_AUTOTUNE=1`` or ``set_autotune(True)``) and the inputs are on
   a GPU: time every candidate of the kernel on the real inputs (median of
   CUDA-graph replays, so small kernels are not timed at the host's launch speed), keep the
   fastest, write it to the cache;
3. otherwise the defaults table (by kernel and head dim).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from .tiles import axes_of, choose_tiles, loop_length, total_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Config:
    """Outer x inner tile: query tile x key tile for fwd / dq, key tile x query tile for dkdv."""

    outer: int
    inner: int
    num_warps: int
    num_stages: int
    tma: bool = False
    # register cap per thread for ptxas (None: its own choice); a lower cap fits more programs per SM
    maxnreg: int | None = None


# kernel -> list of (max head dim, default config); the first entry whose bound covers the head dim wins.
DEFAULTS: dict[str, list[tuple[int, Config]]] = {
    # The tuner's winners (docs/fused.md, "Tiling"): one warpgroup (4 warps) on 64-row tiles for every kernel,
    # kept by time although ptxas reports some spills for them at head dim 128.  Head dim 256 keeps small tiles.
    # TMA loads on the head-dim-128 entries; the head-dim-32 entries keep pointer loads, since a short program
    # pays for building its descriptors (docs/fused.md, "TMA and host descriptors").
    # The bound is ``row_width``: float32 past head dim 64 counts double (its tiles take twice the shared
    # memory; float32 at head dim 128 runs out of it with the 128 entry).
    "fwd": [(32, Config(32, 32, 4, 2)), (128, Config(64, 64, 4, 3, True)), (256, Config(64, 32, 8, 2)),
            (512, Config(32, 32, 8, 1))],
    "dq": [(32, Config(64, 32, 4, 2)), (128, Config(64, 64, 4, 2, True)), (256, Config(32, 32, 8, 1))],
    # dkdv: outer = key/value tile, inner = query tile.
    "dkdv": [(32, Config(64, 32, 4, 2)), (128, Config(64, 64, 4, 2, True)), (256, Config(32, 32, 8, 1))],
    "drpb": [(256, Config(64, 1, 4, 1))],
}

# Head dims up to 32 (NAT / DiNAT) by window regime, each replacing the table above where it was faster
# (docs/fused.md, "Tiling"):
# * small windows (at most SMALL_WINDOW keys, smaller than the dilation group): 16-query tiles on one warp reach
#   about half the keys of 32- or 64-query tiles;
# * windows covering their whole dilation group (DiNAT's dilated layers): dense attention inside each group, one
#   64-query tile per group.
# The small-window tiles use TMA where the launcher builds the descriptors on the host (``_default_resolved`` drops
# it elsewhere; docs/fused.md, "TMA and host descriptors").
SMALL_WINDOW = 81
SMALL_WINDOW_DEFAULTS = {"fwd": Config(16, 64, 1, 2, True), "dq": Config(16, 32, 1, 2, True),
                         "dkdv": Config(16, 32, 1, 2, True)}
DENSE_GROUP_DEFAULTS = {"fwd": Config(64, 64, 4, 3)}
REGIME_MAX_WIDTH = 32

# Candidates the tuner times (besides the default).
CANDIDATES: dict[str, list[Config]] = {
    "fwd": [Config(128, 64, 8, 3), Config(128, 64, 8, 2), Config(128, 128, 8, 2), Config(64, 64, 4, 3),
            Config(128, 32, 8, 3), Config(64, 32, 4, 2), Config(32, 32, 4, 2),
            # Why each group below is a candidate: docs/fused.md, "Tuner candidates".
            # small windows: 16-query tiles on one or two warps reach less than half the keys of 64-query tiles,
            # so less of the softmax work is wasted
            Config(16, 64, 1, 2), Config(16, 64, 2, 2), Config(16, 32, 1, 2),
            # small windows in 3-D: 16-key tiles cut the padding of a 64-query tile's key box, 32-query tiles on
            # two warps reach fewer pairs still
            Config(64, 16, 4, 3), Config(32, 32, 2, 2), Config(32, 64, 2, 2),
            # one-warp programs capped at 128 registers: more of them fit on an SM
            Config(16, 64, 1, 2, maxnreg=128),
            # head dim 128, windows aligned to the tile (stride variants): 32-key tiles at 3 stages fit more programs
            # per SM than 64-key ones
            Config(64, 32, 4, 3),
            # small-window forwards bound by L2 traffic: 32-query one-warp tiles reach fewer keys per query than
            # 16-query ones, so they read fewer K/V bytes
            Config(32, 32, 1, 3, maxnreg=128),
            # head dim 128, long unmasked loops (stride variants): 128 x 128 on two warpgroups at 3 stages, one
            # program per SM; 128-key tiles halve the score matmul's shared-memory reads per FLOP
            Config(128, 128, 8, 3)],
    "dq": [Config(64, 64, 4, 2), Config(64, 64, 8, 2), Config(128, 64, 8, 2), Config(64, 32, 4, 2),
           Config(32, 32, 4, 2), Config(128, 32, 8, 2), Config(128, 64, 8, 3), Config(64, 64, 4, 3),
           Config(64, 128, 8, 2), Config(16, 64, 1, 2), Config(16, 32, 1, 2)],
    "dkdv": [Config(64, 64, 8, 2), Config(64, 32, 8, 2), Config(64, 64, 4, 2), Config(128, 32, 8, 2),
             Config(32, 32, 4, 2), Config(64, 32, 8, 1), Config(64, 32, 4, 2), Config(64, 64, 4, 3),
             Config(128, 64, 8, 2), Config(128, 16, 8, 2), Config(64, 128, 8, 2), Config(64, 128, 8, 3),
             Config(16, 64, 1, 2), Config(16, 32, 1, 2)],
    "drpb": [Config(64, 1, 4, 1), Config(32, 1, 4, 1), Config(128, 1, 8, 1)],
}
# Every tile candidate also with TMA loads (used where the launch allows them, else the same as
# without): they win on most large problems and lose on some 3-D backward tiles.
for _kernel in ("fwd", "dq", "dkdv"):
    CANDIDATES[_kernel] += [dataclasses.replace(c, tma=True) for c in CANDIDATES[_kernel]]


def _code_version() -> str:
    """Hash of the sources that decide what a tuned entry ran: the kernels and the launcher's choices around them.
    A cached configuration outlives the code that chose it otherwise: entries tuned before a kernel change can be
    slower than the current defaults (docs/fused.md, "Tiling"), or name tiles a later kernel no longer compiles."""
    digest = hashlib.sha256()
    for name in ("kernels.py", "window_jit.py", "launch.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:12]


CODE_VERSION = _code_version()

_lock = threading.Lock()
_cache: dict[str, dict] | None = None
_tune_override: bool | None = None
_forced: dict[str, Config] = {}
_memo: dict[tuple, "ResolvedConfig"] = {}


@contextlib.contextmanager
def forced(**configs: Config):
    """Pins kernels to configurations, e.g. ``forced(fwd=Config(16, 16, 4, 1))`` (tests, experiments)."""
    previous = dict(_forced)
    _forced.update(configs)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(previous)


def set_autotune(enabled: bool | None) -> None:
    """Turns tuning on/off for this process (``None``: follow ``NAMODELS_FUSED_AUTOTUNE``)."""
    global _tune_override
    _tune_override = enabled


def state() -> tuple:
    """What a cached plan (``launch.forward`` / ``launch.backward``) depends on besides the problem: tuning on/off,
    pinned configurations and the memo (tests replace it to force a new choice)."""
    return autotune_enabled(), tuple(_forced.items()), id(_memo)


def autotune_enabled() -> bool:
    if _tune_override is not None:
        return _tune_override
    return os.environ.get("NAMODELS_FUSED_AUTOTUNE", "0") == "1"


def cache_path() -> Path:
    return Path(os.environ.get("NAMODELS_FUSED_CACHE", Path.home() / ".cache" / "namodels" / "fused_tuning.json"))


def _load() -> dict[str, dict]:
    global _cache
    if _cache is None:
        try:
            _cache = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _cache = {}
    return _cache


def _store(key: str, entry: dict) -> None:
    with _lock:
        cache = _load()
        cache[key] = entry
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as err:  # a read-only home must not break the kernels
            log.warning("fused autotune: cannot write %s: %s", path, err)


# Triton's input precision of float32 matmuls per torch setting (``torch.set_float32_matmul_precision``): "highest"
# asks for float32 results, which 3xTF32 gives on the tensor cores (each operand split into a TF32 head and tail, three
# products; as accurate as the gemm backend's float32) where an IEEE dot runs on the FMA units at a fraction of the
# speed; "high" and "medium" allow TF32 (errors of both: docs/fused.md, "Float32 inputs").
FP32_DOT_PRECISION = {"highest": "tf32x3", "high": "tf32", "medium": "tf32"}
# 16-bit matmuls: Triton's default (the argument only matters for float32 operands)
HALF_DOT_PRECISION = "tf32"


def float32_matmul_setting() -> str:
    """torch's float32 matmul precision ("highest", "high" or "medium").  torch >= 2.9 also sets it through
    ``torch.backends.cuda.matmul.fp32_precision``; once a program used that API its legacy getter raises, and the new
    one (with "none" inheriting from the backend-wide setting) says whether TF32 is allowed."""
    import torch

    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        for owner in (torch.backends.cuda.matmul, torch.backends.cuda, torch.backends):
            value = getattr(owner, "fp32_precision", "none")
            if value != "none":
                return "high" if value == "tf32" else "highest"
        return "highest"


def dot_precision(dtype) -> str:
    """The kernels' ``tl.dot`` input precision for inputs of ``dtype`` under torch's current setting."""
    import torch

    if dtype != torch.float32:
        return HALF_DOT_PRECISION
    return FP32_DOT_PRECISION[float32_matmul_setting()]


def problem_key(kernel: str, q, k, v, params, has_rpb: bool) -> str:
    import torch

    device = torch.cuda.get_device_name(q.device) if q.is_cuda else str(q.device)
    dtype = str(q.dtype).replace("torch.", "")
    if q.dtype == torch.float32:  # timed with its matmul precision (3xTF32 runs three products per TF32 one)
        dtype = f"{dtype}-{dot_precision(q.dtype)}"
    return "|".join(
        str(x)
        for x in (
            kernel, params.rank, params.spatial, params.kernel_size, params.stride, params.dilation,
            params.is_causal, dtype, q.shape[-1], v.shape[-1], q.shape[-2],
            k.shape[-2], q.shape[0], int(has_rpb), device, f"v{CODE_VERSION}",
        )
    )


def window_regime(params) -> str:
    """``"dense-group"`` where the window covers its whole dilation group on every axis, ``"small"`` for windows of
    at most ``SMALL_WINDOW`` keys, else ``"large"``."""
    axes = axes_of(params)
    if all(a.K >= a.Lg for a in axes):
        return "dense-group"
    window = 1
    for a in axes:
        window *= a.K
    return "small" if window <= SMALL_WINDOW else "large"


def default_config(kernel: str, head_dim: int, params=None) -> Config:
    """The defaults-table entry for a ``row_width`` (and, given the problem, its window regime)."""
    return _default_entry(kernel, head_dim, params)[1]


def _default_entry(kernel: str, head_dim: int, params=None) -> tuple[str, Config]:
    """``default_config``'s entry and the name of its table."""
    if params is not None and head_dim <= REGIME_MAX_WIDTH:
        regime = window_regime(params)
        name, table = {"small": ("SMALL_WINDOW_DEFAULTS", SMALL_WINDOW_DEFAULTS),
                       "dense-group": ("DENSE_GROUP_DEFAULTS", DENSE_GROUP_DEFAULTS)}.get(regime, ("", {}))
        if kernel in table:
            return name, table[kernel]
    for bound, cfg in DEFAULTS[kernel]:
        if head_dim <= bound:
            return "DEFAULTS", cfg
    return "DEFAULTS", DEFAULTS[kernel][-1][1]


def row_width(head_dim: int, dtype) -> int:
    """The defaults-table key: the head dim, doubled for float32 rows wider than 64, whose tiles take
    twice the shared memory (float32 up to 64 fits the 16-bit entries and keeps their tiles)."""
    return head_dim * 2 if dtype.itemsize > 2 and head_dim > 64 else head_dim


@dataclass(frozen=True)
class ResolvedConfig:
    """A ``Config`` resolved for one problem (``resolve``): its N-D tile shapes plus the pipeline settings."""

    outer_tile: tuple[int, int, int]
    inner_tile: tuple[int, int, int]
    num_warps: int
    num_stages: int
    tma: bool = False
    maxnreg: int | None = None


@functools.lru_cache(maxsize=4096)
def resolve(cfg: Config, params, kernel: str) -> ResolvedConfig:
    """N-D tile shapes for a configuration of ``kernel`` (padded to 3 axes, leading dummy axes of size 1)."""
    axes = axes_of(params)
    tokens = 1
    for a in axes:
        tokens *= a.Lg
    outer_size = total_size(tokens, cfg.outer)
    if cfg.inner == 1:  # kernels without an inner tile (drpb)
        outer, inner = choose_tiles(axes, outer_size, 1)
    else:
        outer, inner = choose_tiles(axes, outer_size, total_size(tokens, cfg.inner), inverse=kernel == "dkdv")
    pad = (1,) * (3 - len(axes))
    return ResolvedConfig(pad + tuple(outer), pad + tuple(inner), cfg.num_warps, cfg.num_stages, cfg.tma, cfg.maxnreg)


def pick(kernel: str, q, k, v, params, has_rpb: bool, run, tunable: bool = True, tma: bool = False,
         host_descriptors: bool = False) -> ResolvedConfig:
    """The resolved configuration of one kernel for a problem; ``run(config)`` executes the kernel once with a
    candidate (for tuning).
    ``tma``: the launch can use TMA loads (else the tuner skips those candidates, which would run as
    their pointer-load twins); ``host_descriptors``: its TMA descriptors are built on the host
    (``launch.host_descriptors_ok``), which decides whether the defaults keep TMA on short loops."""
    if kernel in _forced:
        return resolve(_forced[kernel], params, kernel)
    # Host time matters for small problems: one dict lookup per launch once a problem was seen.
    memo_key = _memo_key(kernel, q, k, v, params, has_rpb, tunable, tma, host_descriptors)
    resolved = _memo.get(memo_key)
    if resolved is None:
        resolved = _memo[memo_key] = _pick(kernel, q, k, v, params, has_rpb, run, tunable, tma, host_descriptors)
    return resolved


def lookup(kernel: str, q, k, v, params, has_rpb: bool, tunable: bool = True, tma: bool = False,
           host_descriptors: bool = False) -> tuple[ResolvedConfig | None, str]:
    """``(config, source)``: what ``pick`` returns for these arguments and where it comes from, without tuning or
    remembering anything; ``config`` is None where ``pick`` would run the tuner first."""
    if kernel in _forced:
        return resolve(_forced[kernel], params, kernel), "pinned by autotune.forced"
    config, source = _stored_or_default(kernel, q, k, v, params, has_rpb, tunable, host_descriptors)
    memo = _memo.get(_memo_key(kernel, q, k, v, params, has_rpb, tunable, tma, host_descriptors))
    if memo is not None:
        return memo, f"picked earlier in this process (autotune._memo; now: {source})"
    return config, source


def _memo_key(kernel, q, k, v, params, has_rpb, tunable, tma, host_descriptors) -> tuple:
    return (kernel, params, q.dtype, dot_precision(q.dtype), tuple(q.shape), k.shape[-2], v.shape[-1], has_rpb,
            q.device, tunable and autotune_enabled(), tma, host_descriptors)


def _stored_or_default(kernel, q, k, v, params, has_rpb, tunable, host_descriptors) -> tuple:
    """``(config, source)`` of ``_pick``'s first step: the tuning cache's entry, else None where the tuner runs,
    else the defaults table's."""
    key = problem_key(kernel, q, k, v, params, has_rpb)
    entry = _load().get(key)
    if entry is not None:
        return (ResolvedConfig(tuple(entry["outer_tile"]), tuple(entry["inner_tile"]), entry["num_warps"],
                               entry["num_stages"], entry.get("tma", False), entry.get("maxnreg")),
                f"tuning cache entry {key} ({cache_path()})")
    if tunable and autotune_enabled() and q.is_cuda:
        return None, f"the tuner, on first use (stored as {key})"
    width = row_width(max(q.shape[-1], v.shape[-1]), q.dtype)
    return _default_resolved(kernel, params, width, host_descriptors), default_source(kernel, params, width,
                                                                                      host_descriptors)


def _pick(kernel, q, k, v, params, has_rpb, run, tunable, tma, host_descriptors) -> ResolvedConfig:
    config, _ = _stored_or_default(kernel, q, k, v, params, has_rpb, tunable, host_descriptors)
    if config is not None:
        return config
    tuned = _tune(kernel, q, params, run, problem_key(kernel, q, k, v, params, has_rpb), tma)
    if tuned is not None:
        return tuned
    return _default_resolved(kernel, params, row_width(max(q.shape[-1], v.shape[-1]), q.dtype), host_descriptors)


# A program that builds its TMA descriptors itself pays for it once, so TMA pays only over a long enough loop
# (docs/fused.md, "TMA and host descriptors").  Where the launcher builds the descriptors on the host (an undilated
# problem with packed heads and power-of-two head dims, ``launch.host_descriptors_ok``), TMA wins on short loops too
# (the backward: ``launch.BACKWARD_HOST_DESCRIPTORS``).
MIN_TMA_LOOP = 16


def _default_resolved(kernel: str, params, width: int, host_descriptors: bool = False) -> ResolvedConfig:
    """The defaults-table entry for a ``row_width``, resolved, without TMA where a program's loop is short and
    builds its own descriptors (``host_descriptors``: the launcher passes them in, as it decided with the tensors)."""
    resolved = resolve(default_config(kernel, width, params), params, kernel)
    if resolved.tma and not host_descriptors:
        outer, inner = resolved.outer_tile, resolved.inner_tile
        axes = axes_of(params)
        pad = 3 - len(axes)
        if loop_length(axes, outer[pad:], inner[pad:], inverse=kernel == "dkdv") < MIN_TMA_LOOP:
            resolved = dataclasses.replace(resolved, tma=False)
    return resolved


def default_source(kernel: str, params, width: int, host_descriptors: bool = False) -> str:
    """Which defaults-table entry ``_default_resolved`` takes, in words."""
    table, config = _default_entry(kernel, width, params)
    words = f"defaults: {table}[{kernel!r}] ({window_regime(params)} window, row width {width})"
    if config.tma and not _default_resolved(kernel, params, width, host_descriptors).tma:
        words += f"; TMA off: a loop under MIN_TMA_LOOP ({MIN_TMA_LOOP}) boxes without host descriptors"
    return words


def _kernel_ms(fn) -> float:
    """Median time of ``fn``'s kernels, replayed from a CUDA graph: timed launch by launch, a kernel
    shorter than its host launch work is timed at the host's speed, and the tuner picked worse tiles than
    the defaults on small maps that way (docs/fused.md, "Tiling").  Plain ``do_bench`` where graph capture
    is not possible."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    except Exception as err:  # noqa: BLE001  (capture unsupported here: time launch by launch)
        log.debug("fused autotune: CUDA graph timing failed (%s); timing launch by launch", err)
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _tune(kernel, q, params, run, key, tma):
    seen, results = set(), []
    default = default_config(kernel, row_width(q.shape[-1], q.dtype), params)  # q/k rows set the register budget
    for cfg in [default] + CANDIDATES[kernel]:
        if cfg.tma and not tma:  # would run as its pointer-load twin: time that one (once)
            cfg = dataclasses.replace(cfg, tma=False)
        candidate = resolve(cfg, params, kernel)
        if candidate in seen:
            continue
        seen.add(candidate)
        try:
            ms = _kernel_ms(lambda: run(candidate))
        except Exception as err:  # e.g. out of shared memory for this shape: skip the candidate
            log.debug("fused autotune %s: %s failed: %s", kernel, candidate, err)
            continue
        results.append((ms, candidate))
    if not results:
        return None
    ms, best = min(results, key=lambda r: r[0])
    log.info("fused autotune %s: %s -> %.4f ms (%d candidates)", key, best, ms, len(results))
    _store(key, {**asdict(best), "ms": ms})
    return best
