# Session 8 call 5: 3d-causal with the 96-register two-stage tile (kept in the cache if it wins), then the forward
# tables (do_bench --rep 500: the 100 ms budget gave 2d-flux only 7 samples) and the stride variants, tuned.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_final_s7.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 120 python3 benchmarks/tile_ab.py 3d-causal --kernels fwd --rounds 3 --keep-best \
  --variant "fwd:4x2x8/4x8x2/4/2/tma/r96" --variant "fwd:4x2x8/4x8x2/4/2/tma/r104" > $OUT/c5_causal.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c5_causal.txt
timeout 120 python3 -m ops.bench --check 16 --rep 500 --problems nat-s1,dinat-s1 --backends fused,flex --out $OUT/c5_small > $OUT/c5_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c5_small.txt | grep -v "^|---" | cut -d'|' -f2-10
timeout 150 python3 -m ops.bench --check 16 --rep 500 --problems 3d-causal,1d-32k,2d-flux --backends fused --out $OUT/c5_fwd > $OUT/c5_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c5_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout $(( 560 - ($(date +%s)-T0) )) python3 -m ops.bench --autotune --rep 300 --problems 1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8 --backends fused --out $OUT/c5_stride > $OUT/c5_stride.txt 2>&1
echo "stride rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c5_stride.txt | grep -v "^|---" | cut -d'|' -f2-9
cp /tmp/cache.json $OUT/c5_cache.json
