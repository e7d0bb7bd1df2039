# Session 12 call 3: MASK_IN_DOT for any rank (launch rule: boxes partial on >= half the axes on average; bias summed
# inner axes first, 400 SASS instructions per 3d-causal step): nat-s1 / nat-s3 (2-D, small windows; nat-s1's masked
# step 489 -> 449 instructions offline) and 3d-causal against the selects; GPU tests of both mask paths.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session12
cp .ab/tune_s12_128.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
for P in nat-s1 nat-s3 3d-causal; do
  timeout 100 python3 benchmarks/kernel_ab.py $P --rounds 9 --rep 300 sel@set=base --set "launch.MASK_IN_DOT_FROM=float('inf')" >> $OUT/c3_ab.txt 2>&1
  echo "$P rc=$? $(( $(date +%s)-T0 ))s"
done
grep -E "^\| [0-9a-z]|DIFF|Error|max" $OUT/c3_ab.txt
timeout 120 python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider -k "mask_paths or small_tiles" > $OUT/c3_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/c3_tests.txt
