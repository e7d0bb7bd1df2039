#!/bin/bash
# GPU correctness in one device call: the gpu-marked tests of every compiled backend, the model
# training-step check (issue 4), then a per-kernel profile of the fused backward.
# Usage (device, repo root, carry [".whl"]): bash benchmarks/gpu_verify.sh [profile problems...]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_verify_out}; mkdir -p "$OUT"
# the device has pytest (with plugins); add only what it lacks (hydra), never a second pytest
rm -rf /tmp/site  # a warm machine keeps what an earlier call installed
python3 -c "import pytest" 2>/dev/null || { echo "no pytest on this machine"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/hydra*.whl .whl/omegaconf*.whl .whl/antlr4*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PYTHONPATH
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
T0=$(date +%s)
run() { local name=$1 limit=$2; shift 2; echo "== $name ($(( $(date +%s) - T0 )) s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt"; tail -6 "$OUT/$name.txt"; }
PT="python3 -m pytest -q -p no:cacheprovider -rA --durations=5"
# the device has pytest-xdist: Triton / Inductor compilation per test parallelises over its CPU cores
python3 -c "import xdist" 2>/dev/null && XDIST="-n ${XDIST_WORKERS:-8}" || XDIST=""
[ -z "$SKIP_FUSED" ] && run fused_gpu_tests 240 $PT -m gpu tests/test_fused.py tests/test_gpu_training.py -s
[ -z "$SKIP_FUSED" ] && run fused_module_step 60 $PT -m "not slow" tests/test_fused.py -k "module_training_step or random"
run gemm_gpu_tests 200 $PT $XDIST --tb=short -m gpu tests/test_gemm.py tests/test_unfused.py
run flex_gpu_tests 200 $PT $XDIST --tb=short -m gpu tests/test_flex.py
[ $# -gt 0 ] && run fused_profile 120 python3 benchmarks/fused_profile.py "$@"
echo "total $(( $(date +%s) - T0 )) s"
