#!/usr/bin/env bash
# Small problems, fused forward: default tiles, then tuned (CUDA-graph timing), plus the fused GPU tests.
# Device, repo root, carry [".whl"]. Session 4, call 10.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
T0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/test_fused.py tests/test_gpu_training.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt; echo "tests $(( $(date +%s)-T0 ))"
S="--problems nat-s1,nat-s1-rpb,dinat-s1,nat-s3 --custom nat-s3-rpb:128,8,32,14x14,7,1,1,0,1 --custom nat-s4-rpb:128,16,32,7x7,7,1,1,0,1 --backends fused"
timeout 100 python3 -m ops.bench $S --out $OUT/default > $OUT/default.txt 2>&1; echo "default $(( $(date +%s)-T0 ))"
NAMODELS_FUSED_CACHE=$OUT/tune.json timeout 200 python3 -m ops.bench $S --autotune --out $OUT/tuned > $OUT/tuned.txt 2>&1; echo "tuned $(( $(date +%s)-T0 ))"
for f in default tuned; do echo "== $f"; grep -E "^\| " $OUT/$f.txt | grep fused; done
