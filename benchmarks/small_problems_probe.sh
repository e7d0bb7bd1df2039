#!/bin/bash
# Small-window problems and models on the fused backend: where the time goes (issues 3, 8).
# Usage (device, repo root, carry [".whl"]): bash benchmarks/small_problems_probe.sh [--no-tests]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-probe_out}; mkdir -p "$OUT"
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/hydra*.whl .whl/omegaconf*.whl .whl/antlr4*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PYTHONPATH
T0=$(date +%s)
run() { local name=$1 limit=$2; shift 2; echo "== $name ($(( $(date +%s) - T0 )) s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt"; tail -${TAIL:-8} "$OUT/$name.txt"; }
if [ "$1" != "--no-tests" ]; then
  run fused_gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/test_fused.py tests/test_gpu_training.py
fi
SMALL="--problems nat-s1,nat-s1-rpb,dinat-s1,nat-s3 --custom nat-s3-rpb:128,8,32,14x14,7,1,1,0,1 --custom nat-s4-rpb:128,16,32,7x7,7,1,1,0,1"
TAIL=14 run bench_default 150 python3 -m ops.bench $SMALL --backends fused,flex --out "$OUT/small_default"
TAIL=14 NAMODELS_FUSED_CACHE=$OUT/tuning.json run bench_tuned 200 python3 -m ops.bench $SMALL --backends fused --autotune --out "$OUT/small_tuned"
TAIL=20 run profile_nat_tiny_fused 120 python3 benchmarks/model_profile.py nat_tiny --backend fused
TAIL=20 run profile_nat_tiny_sdpa 120 python3 benchmarks/model_profile.py nat_tiny --backend sdpa
echo "total $(( $(date +%s) - T0 )) s"
