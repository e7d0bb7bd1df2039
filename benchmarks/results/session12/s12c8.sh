# Session 12 call 8: issue 3's forward table again in one run, on the session's final code (call 4's command; the
# forward is the same, the backward took MASK_IN_DOT since), caches of calls 4 and 5 re-keyed to today's CODE_VERSION.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session12
export NAMODELS_FUSED_CACHE=/tmp/cache.json
# (as run, the merge took two rekey calls and a python -c json merge; the same entries)
python3 $S/rekey_cache.py $S/cache_s12.json $S/c5_cache.json /tmp/cache.json
timeout 450 python3 -m ops.bench --check 16 --rounds 5 --rep 400 \
  --problems nat-s1,dinat-s1,3d-causal,1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,1d-32k,2d-flux,3d-hunyuan \
  --backends fused,flex --out $OUT/c8_all > $OUT/c8_all.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c8_all.txt | grep -v "^|---" | cut -d'|' -f2-10
