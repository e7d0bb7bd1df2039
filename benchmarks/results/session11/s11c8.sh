# Session 11 call 8: a wider GPU test run of test_fused after the STORE_LSE / STORE_DS changes, then nat-s1 / dinat-s1
# against flex again (is call 4's 10.15x repeatable?), tuned cache of session 10.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 100 python3 -m ops.bench --check 16 --rounds 7 --rep 300 --problems nat-s1,dinat-s1 --backends fused,flex \
  --out $OUT/c8_small > $OUT/c8_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c8_small.txt | grep -v "^|---" | cut -d'|' -f2-10
unset NAMODELS_FUSED_CACHE
timeout 230 python3 -m pytest -q -n 8 -m "gpu or not gpu" tests/test_fused.py tests/test_rpb_grad.py -p no:cacheprovider \
  -k "random or small_tiles or default or descriptors or lse or half" > $OUT/c8_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c8_tests.txt | tail -8
