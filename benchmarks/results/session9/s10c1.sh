# Prepared in session 9 (no device lent that session); for the next session's first device call.
# 1. GPU tests of session 9's changes (compiled): host-descriptor defaults, dQ host descriptors (forced on),
#    forward rows without keys; 2. A/B of dQ with host-built K/V descriptors against per-program ones and pointer
#    loads (tile_ab --dq-host-desc).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 200 python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider \
  -k "descriptors or host or default or forward_random or small_tiles" > $OUT/c1_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c1_tests.txt | tail -8
cp .ab/tune_s8c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
for p in nat-s1-rpb nat-s1; do
  timeout 90 python3 benchmarks/tile_ab.py $p --kernels dq --rounds 3 --dq-host-desc \
    --variant "dq:1x2x8/1x2x16/1/2/tma" --variant "dq:1x2x8/1x4x8/1/2/tma" >> $OUT/c1_dq_ab.txt 2>&1
  echo "$p rc=$? $(( $(date +%s)-T0 ))s"
done
for p in 2d-flux; do
  timeout 120 python3 benchmarks/tile_ab.py $p --kernels dq --rounds 3 --dq-host-desc >> $OUT/c1_dq_ab.txt 2>&1
  echo "$p rc=$? $(( $(date +%s)-T0 ))s"
done
grep "^|" $OUT/c1_dq_ab.txt
