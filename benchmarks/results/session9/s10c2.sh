# Prepared in session 9 (no device lent that session): issue 3's forward tables with SDPA and the backends timed in
# alternating rounds (ops.bench --rounds, new in session 9), tuned cache of session 8 (stride variants included).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s8c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 200 python3 -m ops.bench --check 16 --rounds 5 --rep 300 --problems nat-s1,dinat-s1,3d-causal \
  --backends fused,flex --out $OUT/c2_small > $OUT/c2_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c2_small.txt | grep -v "^|---" | cut -d'|' -f2-10
timeout $(( 560 - ($(date +%s)-T0) )) python3 -m ops.bench --check 16 --rounds 5 --rep 500 \
  --problems 1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,1d-32k,2d-flux,3d-hunyuan --backends fused \
  --out $OUT/c2_fwd > $OUT/c2_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c2_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
