#!/usr/bin/env bash
# A/B of the fused forward, two rounds (old ops from .ab/old, see fused_mask_ab.sh), then the new code's
# fwd+bwd and the GPU tests. Session 4 used it for FOLD_SCALE.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
C=$PWD/benchmarks/results/fused_tuning_h100_run4.json
cp $C /tmp/c_old.json; cp $C /tmp/c_new.json
P=1d-32k,2d-flux,3d-hunyuan,1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,3d-causal
T0=$(date +%s)
for r in 1 2; do
(cd .ab/old && NAMODELS_FUSED_CACHE=/tmp/c_old.json timeout 120 python3 -m ops.bench --problems $P --backends fused --rep 100 --out $OUT/old_fwd$r > $OUT/old_fwd$r.txt 2>&1); echo "old fwd $r $(( $(date +%s)-T0 ))"
NAMODELS_FUSED_CACHE=/tmp/c_new.json timeout 120 python3 -m ops.bench --problems $P --backends fused --rep 100 --check 16 --out $OUT/new_fwd$r > $OUT/new_fwd$r.txt 2>&1; echo "new fwd $r $(( $(date +%s)-T0 ))"
done
NAMODELS_FUSED_CACHE=/tmp/c_new.json timeout 150 python3 -m ops.bench --backward --problems 1d-32k,2d-flux,3d-hunyuan --backends fused --rep 100 --out $OUT/new_bwd > $OUT/new_bwd.txt 2>&1; echo "new bwd $(( $(date +%s)-T0 ))"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/test_fused.py tests/test_gpu_training.py > $OUT/gpu_tests.txt 2>&1; tail -2 $OUT/gpu_tests.txt
for f in old_fwd1 new_fwd1 old_fwd2 new_fwd2 new_bwd; do echo "== $f"; grep -E "^\| " $OUT/$f.txt | grep -v "^|---" | grep -v "problem |"; done
