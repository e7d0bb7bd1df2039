# Session 11 call 5: 3d-causal forward against SDPA (call 4's small table ran out of time before it), and fwd+bwd of
# the RPB problem with the window-layout dRPB, in alternating rounds (tuned cache of session 10).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 150 python3 -m ops.bench --check 16 --rounds 7 --rep 300 --problems 3d-causal --backends fused \
  --out $OUT/c5_causal > $OUT/c5_causal.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c5_causal.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout 200 python3 -m ops.bench --backward --rounds 3 --rep 200 --problems nat-s1-rpb,nat-s1 --backends fused \
  --out $OUT/c5_bwd > $OUT/c5_bwd.txt 2>&1
echo "bwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c5_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
