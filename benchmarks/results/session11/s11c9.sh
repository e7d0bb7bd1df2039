# Session 11 call 9: the stride variants' forward with 128-key tiles (64 x 128 on one warpgroup, FA3's per-warpgroup
# shape at head dim 128, not among the tuner's candidates) and 128 x 128 at 3 stages (timed only at 2 before);
# tile_ab, tuner timing, alternating rounds, tuned cache of session 10.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 100 python3 benchmarks/tile_ab.py 1d-32k-s256 --kernels fwd --rounds 3 --variant "fwd:1x1x64/1x1x128/4/2/tma" \
  --variant "fwd:1x1x64/1x1x128/4/3/tma" --variant "fwd:1x1x128/1x1x128/8/3/tma" > $OUT/c9_1d.txt 2>&1
echo "1d rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c9_1d.txt
timeout $(( 280 - ($(date +%s)-T0) )) python3 benchmarks/tile_ab.py 3d-hunyuan-s16x8x8 --kernels fwd --rounds 3 \
  --variant "fwd:1x8x8/1x8x16/4/2/tma" --variant "fwd:2x8x8/1x8x16/8/2/tma" > $OUT/c9_3d.txt 2>&1
echo "3d rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c9_3d.txt
