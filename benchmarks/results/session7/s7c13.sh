# Session 7 call 13: GPU check of the last host-descriptor refactor (layouts cached per direct plan): tests + nat-s1 bench.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider -k "host or alignment or repeated or tma_loads" > $OUT/c13_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/c13_tests.txt
cp .ab/tune_final_s7.json /tmp/cache.json
NAMODELS_FUSED_CACHE=/tmp/cache.json timeout 100 python3 -m ops.bench --check 16 --rep 100 --problems nat-s1,3d-causal --backends fused --out /tmp/c13 > $OUT/c13_bench.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c13_bench.txt | grep -v "^|---" | cut -d'|' -f2-10
