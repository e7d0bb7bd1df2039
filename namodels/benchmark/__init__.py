"""Model throughput per neighborhood-attention backend; importable without Hydra.

* :func:`~namodels.benchmark.throughput.measure_throughput`: one row for any model factory + input factory;
* :func:`~namodels.benchmark.throughput.run_benchmarks` / ``python -m namodels.benchmark.throughput``: a
  whole plan (models x backends x precisions) written as CSV / JSON / Markdown / PNG;
* :func:`~namodels.benchmark.models.swap_dense_attention`: the same model with dense SDPA attention;
* :func:`~namodels.benchmark.flops.count_macs`: GMACs with neighborhood attention counted analytically.
"""
from .flops import count_macs
from .models import swap_dense_attention
from .throughput import BenchOptions, ModelSpec, measure_throughput, model_spec, run_benchmarks
from .timing import TimingSettings

__all__ = ["BenchOptions", "ModelSpec", "TimingSettings", "count_macs", "measure_throughput",
           "model_spec", "run_benchmarks", "swap_dense_attention"]
