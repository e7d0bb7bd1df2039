#!/usr/bin/env bash
# A/B of two versions of ops/fused in one device call, same tile configurations (session-2 tuned cache).
# The old version is a copy of the package from a commit, in an ignored folder carried to the device:
#   mkdir -p .ab/old && git archive <old commit> ops | tar -x -C .ab/old   (then carry [".ab"])
# Session 4 used it for the per-axis masking (old = 7923d42).
set -u
export PYTHONUNBUFFERED=1
C=$PWD/benchmarks/results/fused_tuning_h100_run4.json
cp $C /tmp/c_old.json; cp $C /tmp/c_new.json
P=1d-32k,2d-flux,3d-hunyuan,1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,3d-causal
B=1d-32k,2d-flux,3d-hunyuan
ROOT=$PWD
T0=$(date +%s)
(cd .ab/old && NAMODELS_FUSED_CACHE=/tmp/c_old.json timeout 170 python3 -m ops.bench --problems $P --backends fused --rep 100 --out $OUT/old_fwd > $OUT/old_fwd.txt 2>&1); echo "old fwd $(( $(date +%s)-T0 ))"
NAMODELS_FUSED_CACHE=/tmp/c_new.json timeout 170 python3 -m ops.bench --problems $P --backends fused --rep 100 --check 16 --out $OUT/new_fwd > $OUT/new_fwd.txt 2>&1; echo "new fwd $(( $(date +%s)-T0 ))"
(cd .ab/old && NAMODELS_FUSED_CACHE=/tmp/c_old.json timeout 150 python3 -m ops.bench --backward --problems $B --backends fused --rep 100 --out $OUT/old_bwd > $OUT/old_bwd.txt 2>&1); echo "old bwd $(( $(date +%s)-T0 ))"
NAMODELS_FUSED_CACHE=/tmp/c_new.json timeout 150 python3 -m ops.bench --backward --problems $B --backends fused --rep 100 --out $OUT/new_bwd > $OUT/new_bwd.txt 2>&1; echo "new bwd $(( $(date +%s)-T0 ))"
for f in old_fwd new_fwd old_bwd new_bwd; do echo "== $f"; grep -E "^\| " $OUT/$f.txt | grep -v "^|---" ; done
