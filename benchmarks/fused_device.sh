#!/bin/bash
# One device call for the fused backend: environment, GPU correctness tests, op benchmarks.
# Usage (device machine, repo root): bash benchmarks/fused_device.sh [tests|fwd|bwd|all] [extra bench args]
# Logs and result files go to $OUT (or ./bench_out when run elsewhere).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export NAMODELS_FUSED_CACHE="$OUT/fused_tuning.json"
what=${1:-all}; shift || true
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
if ! python3 -c "import pytest" 2>/dev/null && [ -d .whl_fused ]; then  # carried wheels (see report)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl_fused/pytest-*.whl .whl_fused/pluggy-*.whl \
    .whl_fused/iniconfig-*.whl && export PYTHONPATH=/tmp/site
fi
if [[ $what == tests || $what == all ]]; then
  timeout 240 python3 -m pytest -m gpu tests/test_fused.py -x -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
fi
if [[ $what == fwd || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-900} python3 -m ops.bench --out "$OUT/op_bench_fwd" "$@" 2>&1 | tee "$OUT/bench_fwd.txt"
fi
if [[ $what == bwd || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-900} python3 -m ops.bench --backward --out "$OUT/op_bench_bwd" "$@" 2>&1 | tee "$OUT/bench_bwd.txt"
fi
