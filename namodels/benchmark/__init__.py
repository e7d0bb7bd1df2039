"""Model throughput per neighborhood-attention backend; importable without Hydra.

* :func:`~namodels.benchmark.throughput.measure_throughput`: one row for any model factory + input factory;
* :func:`~namodels.benchmark.throughput.run_benchmarks` / ``python -m namodels.benchmark.throughput``: a
  whole plan (models x backends x precisions) written as CSV / JSON / Markdown / PNG;
* :func:`~namodels.benchmark.models.swap_dense_attention`: the same model with dense SDPA attention;
* :func:`~namodels.benchmark.flops.count_macs`: GMACs with neighborhood attention counted analytically.
"""
import importlib

# Public names and the submodule of each, imported on first use: importing the package must not import
# ``throughput`` itself, or ``python -m namodels.benchmark.throughput`` would run a module already in
# sys.modules (runpy's RuntimeWarning, and two copies of its globals).
_EXPORTS = {
    "BenchOptions": "throughput", "ModelSpec": "throughput", "measure_throughput": "throughput",
    "model_spec": "throughput", "run_benchmarks": "throughput", "TimingSettings": "timing",
    "count_macs": "flops", "swap_dense_attention": "models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
