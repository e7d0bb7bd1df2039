# Session 11 call 4: GPU tests of the lse-free inference forward and the window-layout dRPB; issue 3's forward tables
# in alternating rounds (tuned cache of session 10): small-window problems against flex, then the large ones.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 100 python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider \
  -k "without_lse or rpb or large_logits" > $OUT/c4_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c4_tests.txt | tail -8
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 170 python3 -m ops.bench --check 16 --rounds 5 --rep 300 --problems nat-s1,dinat-s1,nat-s3,3d-causal \
  --backends fused,flex --out $OUT/c4_small > $OUT/c4_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c4_small.txt | grep -v "^|---" | cut -d'|' -f2-10
timeout $(( 570 - ($(date +%s)-T0) )) python3 -m ops.bench --check 16 --rounds 5 --rep 400 \
  --problems 1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,1d-32k,2d-flux,3d-hunyuan --backends fused \
  --out $OUT/c4_fwd > $OUT/c4_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c4_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
