# Session 6 call 9: the rest of the GPU tests (after call 8's stop), then the final fwd+bwd table (session-6 tiles).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 370 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused.py tests/test_gpu_training.py -p no:cacheprovider -k "scratch_allocator or default_tma or tuner or gpu or training" > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))"
grep -E "passed|failed|Error|assert|FAILED" $OUT/gpu_tests.txt | tail -15
cp .ab/tune_final.json $OUT/tune_final.json
NAMODELS_FUSED_CACHE=$OUT/tune_final.json timeout $(( 585 - ($(date +%s)-T0) )) python3 -m ops.bench --backward --rep 100 --problems 1d-32k,2d-flux,3d-hunyuan,nat-s1-rpb --backends fused --out $OUT/final_bwd > $OUT/final_bwd.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))"; grep -E "^\| " $OUT/final_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
