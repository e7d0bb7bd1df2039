# Session 12 call 4: issue 3's forward table in one ops.bench run (every problem, fused and flex, SDPA in the same
# run), with session 10's tuned cache plus call 2's stride entries re-keyed to today's CODE_VERSION
# (rekey_cache.py; stale RPB backward entries dropped); then the GPU tests.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session12
python3 $S/rekey_cache.py $S/cache_s12.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 400 python3 -m ops.bench --check 16 --rounds 5 --rep 400 \
  --problems nat-s1,dinat-s1,3d-causal,1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,1d-32k,2d-flux,3d-hunyuan \
  --backends fused,flex --out $OUT/c4_all > $OUT/c4_all.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c4_all.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout $(( 585 - ($(date +%s)-T0) )) python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider \
  -k "random or small_tiles or default or descriptors or lse or half or mask_paths or autotune" > $OUT/c4_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c4_tests.txt | tail -8
