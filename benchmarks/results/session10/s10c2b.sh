# Session 10 call 2: GPU tests after switching the backward host descriptors on (and the fixed float16 default test);
# fwd+bwd of the small-window problems on default tiles (empty cache: the new TMA dQ / dK/dV defaults); then issue 3's
# forward tables in alternating rounds (s10c2.sh, tuned cache of session 8).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 150 python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider \
  -k "descriptors or host or default or forward_random or small_tiles or backward_random or gpu_" > $OUT/c2_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c2_tests.txt | tail -8
NAMODELS_FUSED_CACHE=/tmp/none.json timeout 120 python3 -m ops.bench --backward --rounds 3 --rep 200 \
  --problems nat-s1,nat-s1-rpb,dinat-s1 --backends fused,flex --out $OUT/c2_bwd_small > $OUT/c2_bwd_small.txt 2>&1
echo "bwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c2_bwd_small.txt | grep -v "^|---" | cut -d'|' -f2-9
cp .ab/tune_s8c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 150 python3 -m ops.bench --check 16 --rounds 5 --rep 300 --problems nat-s1,dinat-s1,3d-causal \
  --backends fused,flex --out $OUT/c2_small > $OUT/c2_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c2_small.txt | grep -v "^|---" | cut -d'|' -f2-10
timeout $(( 580 - ($(date +%s)-T0) )) python3 -m ops.bench --check 16 --rounds 5 --rep 400 \
  --problems 1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,1d-32k,2d-flux,3d-hunyuan --backends fused \
  --out $OUT/c2_fwd > $OUT/c2_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c2_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
