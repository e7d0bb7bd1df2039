# Prepared in session 9 (no device lent that session); for the next session's first device call.
# 1. GPU tests of session 9's changes (compiled): host-descriptor defaults, backward host descriptors (forced on),
#    forward rows without keys; 2. A/B of dQ and dK/dV with host-built descriptors against per-program ones and pointer
#    loads (tile_ab --bwd-host-desc adds a "+host" twin of every TMA variant). Offline (sm_90 SASS, ptxas): nat-s1-rpb
#    dK/dV with host descriptors 536 instructions per step and 168 registers (12 programs per SM) against 562 / 250
#    (8 per SM) with pointer loads.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 240 python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider \
  -k "descriptors or host or default or forward_random or small_tiles" > $OUT/c1_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c1_tests.txt | tail -8
cp .ab/tune_s8c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
for p in nat-s1-rpb nat-s1; do
  timeout 120 python3 benchmarks/tile_ab.py $p --kernels dq,dkdv --rounds 3 --bwd-host-desc \
    --variant "dq:1x2x8/1x2x16/1/2/tma" --variant "dq:1x2x8/1x8x4/1/2/tma" --variant "dkdv:1x2x8/1x2x16/1/2/tma" \
    >> $OUT/c1_bwd_ab.txt 2>&1
  echo "$p rc=$? $(( $(date +%s)-T0 ))s"
done
timeout $(( 570 - ($(date +%s)-T0) )) python3 benchmarks/tile_ab.py 2d-flux --kernels dq,dkdv --rounds 3 --bwd-host-desc \
  >> $OUT/c1_bwd_ab.txt 2>&1
echo "2d-flux rc=$? $(( $(date +%s)-T0 ))s"
grep "^|" $OUT/c1_bwd_ab.txt
