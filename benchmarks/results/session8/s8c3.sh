# Session 8 call 3: tiles of the small-window forwards after the loop-counter change (per-iteration cost is lower,
# so smaller key tiles -- less L2 traffic and padding -- may now win): nat-s1 and 3d-causal, 3 rounds each.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_final_s7.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 220 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 \
  --variant "fwd:2x8/8x4/1/2/tma" --variant "fwd:2x8/8x4/1/3/tma" --variant "fwd:2x8/8x4/1/2/tma/r112" \
  --variant "fwd:2x8/8x2/1/3/tma" --variant "fwd:2x8/8x2/1/2/tma/r96" --variant "fwd:2x8/4x16/1/3/tma/r112" \
  --variant "fwd:2x8/8x4/1/2/ptr" --variant "fwd:2x8/8x4/1/3/tma/r96" --variant "fwd:2x8/4x16/1/2/tma/r128" > $OUT/c3_nat.txt 2>&1
echo "nat rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c3_nat.txt
timeout 300 python3 benchmarks/tile_ab.py 3d-causal --kernels fwd --rounds 3 \
  --variant "fwd:4x2x8/4x8x4/4/3/tma" --variant "fwd:4x4x4/4x2x2/4/3/tma" --variant "fwd:4x4x4/8x2x2/4/3/tma" \
  --variant "fwd:4x2x8/4x8x2/4/4/tma/r128" --variant "fwd:4x2x8/4x8x2/4/2/tma/r128" --variant "fwd:4x2x8/4x8x2/4/3/tma" \
  --variant "fwd:4x4x8/4x8x2/8/3/tma" --variant "fwd:4x2x8/4x8x2/4/3/ptr/r128" --variant "fwd:4x2x8/4x8x4/4/2/tma/r128" > $OUT/c3_causal.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c3_causal.txt
