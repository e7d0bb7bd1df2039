# Session 7 call 12: after the direct-launch fix (host descriptors are not pointers): GPU tests of the host-descriptor
# path, then the final forward tables and 3d-hunyuan fwd+bwd (cache: call 11's, nat-s1 forward = TMA, cap 112).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider -k "host or alignment or repeated or tma_loads or small_window" > $OUT/c12_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/c12_tests.txt
cp .ab/tune_s7e.json $OUT/c12_cache.json
export NAMODELS_FUSED_CACHE=$OUT/c12_cache.json
timeout 120 python3 -m ops.bench --check 16 --rep 100 --problems nat-s1,dinat-s1 --backends fused,flex --out /tmp/c12_small > $OUT/c12_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c12_small.txt | grep -v "^|---" | cut -d'|' -f2-10
timeout 150 python3 -m ops.bench --rep 100 --problems 3d-causal,2d-flux,3d-hunyuan,1d-32k --backends fused --out /tmp/c12_fwd > $OUT/c12_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c12_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout $(( 560 - ($(date +%s)-T0) )) python3 -m ops.bench --backward --rep 100 --problems 3d-hunyuan --backends fused --out /tmp/c12_bwd > $OUT/c12_bwd.txt 2>&1
echo "bwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c12_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
cp /tmp/c12_small.json /tmp/c12_fwd.json /tmp/c12_bwd.json $OUT/ 2>/dev/null
