# Session 7 call 9: occupancy variants of the small-window forwards (nat-s1, 3d-causal): smaller key tiles, two warps,
# register caps; per kernel, 3 rounds.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp benchmarks/results/session7/c6_cache.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 200 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 \
  --variant "fwd:2x8/8x4/1/2/ptr" --variant "fwd:2x8/8x4/1/3/ptr" --variant "fwd:2x8/8x4/1/2/ptr/r96" \
  --variant "fwd:2x8/8x4/1/2/ptr/r80" --variant "fwd:2x8/4x16/2/2/ptr" --variant "fwd:2x8/4x16/2/2/ptr/r96" \
  --variant "fwd:2x8/4x16/1/3/ptr/r128" --variant "fwd:4x8/2x16/2/2/ptr" --variant "fwd:2x8/4x16/1/2/ptr/r112" > $OUT/c9_nat.txt 2>&1
echo "nat rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c9_nat.txt
timeout 250 python3 benchmarks/tile_ab.py 3d-causal --kernels fwd --rounds 3 \
  --variant "fwd:4x2x2/4x2x8/1/2/ptr" --variant "fwd:4x2x2/4x2x8/1/2/ptr/r128" --variant "fwd:4x2x2/4x2x8/1/2/ptr/r96" \
  --variant "fwd:4x2x2/4x2x8/2/2/ptr" --variant "fwd:2x2x4/2x8x2/1/2/ptr/r96" --variant "fwd:4x2x4/4x8x2/2/2/ptr" \
  --variant "fwd:4x2x4/4x8x2/2/2/ptr/r128" --variant "fwd:4x2x2/4x2x8/1/3/ptr/r128" > $OUT/c9_causal.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c9_causal.txt
