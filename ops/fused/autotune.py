"""The tuner and its on-disk cache: times the candidate configurations it is given and stores the winner.

A configuration is (outer tile size, inner tile size, num_warps, num_stages, tma, maxnreg); ``decide.resolve`` turns
it into a problem's N-D tile shapes.  Which configuration a launch takes (pinned, tuning-cache entry, tuner winner or
defaults table) is decided in ``decide.tile_config``; this module only

1. keeps the tuning cache (JSON at ``$NAMODELS_FUSED_CACHE``, default ``~/.cache/namodels/fused_tuning.json``), keyed
   by kernel, rank, sizes, window, dtype (float32 with its matmul precision), head dims, heads, batch, RPB, device
   name and ``CODE_VERSION`` (entries tuned on other code are ignored);
2. times candidates (``tune``: median of CUDA-graph replays, so small kernels are not timed at the host's launch
   speed) where tuning is on (``NAMODELS_FUSED_AUTOTUNE=1`` or ``set_autotune(True)``), keeps the fastest and writes
   it to the cache;
3. holds the candidate lists (``CANDIDATES``) and the configurations pinned by ``forced``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path


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
    for name in ("kernels.py", "window_jit.py", "launch.py", "decide.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:12]


CODE_VERSION = _code_version()

_lock = threading.Lock()
_cache: dict[str, dict] | None = None
_tune_override: bool | None = None
_forced: dict[str, Config] = {}
# bumped whenever the tuning cache's contents change (loaded, reset, a new entry): part of ``state``, so a decision
# cached before an entry was tuned or loaded is not reused after
_cache_version = 0


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
    """What a decision (``decide.forward_plan`` / ``backward_plan``) reads of this module besides the problem: tuning
    on/off, pinned configurations and the tuning cache's version."""
    return autotune_enabled(), tuple(_forced.items()), _cache_version


def autotune_enabled() -> bool:
    if _tune_override is not None:
        return _tune_override
    return os.environ.get("NAMODELS_FUSED_AUTOTUNE", "0") == "1"


def cache_path() -> Path:
    return Path(os.environ.get("NAMODELS_FUSED_CACHE", Path.home() / ".cache" / "namodels" / "fused_tuning.json"))


def _load() -> dict[str, dict]:
    global _cache, _cache_version
    if _cache is None:
        _cache_version += 1
        try:
            _cache = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _cache = {}
    return _cache


def _store(key: str, entry: dict) -> None:
    global _cache_version
    with _lock:
        cache = _load()
        cache[key] = entry
        _cache_version += 1
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as err:  # a read-only home must not break the kernels
            log.warning("fused autotune: cannot write %s: %s", path, err)


def stored(key: str) -> "ResolvedConfig | None":
    """The tuning cache's entry under ``key`` (``problem_key``), or None."""
    entry = _load().get(key)
    if entry is None:
        return None
    return ResolvedConfig(tuple(entry["outer_tile"]), tuple(entry["inner_tile"]), entry["num_warps"],
                          entry["num_stages"], entry.get("tma", False), entry.get("maxnreg"))


def problem_key(kernel: str, q, k, v, params, has_rpb: bool) -> str:
    import torch

    from .decide import dot_precision  # (decide imports this module)

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


@dataclass(frozen=True)
class ResolvedConfig:
    """A ``Config`` resolved for one problem (``resolve``): its N-D tile shapes plus the pipeline settings."""

    outer_tile: tuple[int, int, int]
    inner_tile: tuple[int, int, int]
    num_warps: int
    num_stages: int
    tma: bool = False
    maxnreg: int | None = None


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


def tune(key: str, candidates, run) -> "ResolvedConfig | None":
    """Times ``run(candidate)`` for each resolved candidate (``decide`` lists them), stores the fastest under ``key``
    and returns it; None where every candidate failed."""
    results = []
    for candidate in candidates:
        try:
            ms = _kernel_ms(lambda: run(candidate))
        except Exception as err:  # e.g. out of shared memory for this shape: skip the candidate
            log.debug("fused autotune %s: %s failed: %s", key, candidate, err)
            continue
        results.append((ms, candidate))
    if not results:
        return None
    ms, best = min(results, key=lambda r: r[0])
    log.info("fused autotune %s: %s -> %.4f ms (%d candidates)", key, best, ms, len(results))
    _store(key, {**asdict(best), "ms": ms})
    return best
