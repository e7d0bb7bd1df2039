# Session 8 call 4: (a) 3d-causal register caps / stages after the loop-counter change; (b) the defaults (no cache)
# against small-window defaults (16-query one-warp tiles) on the NAT-sized problems.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_final_s7.json /tmp/cache.json
NAMODELS_FUSED_CACHE=/tmp/cache.json timeout 150 python3 benchmarks/tile_ab.py 3d-causal --kernels fwd --rounds 3 \
  --variant "fwd:4x2x8/4x8x2/4/2/tma/r96" --variant "fwd:4x2x8/4x8x2/4/2/tma/r112" --variant "fwd:4x2x8/4x8x2/4/3/tma/r112" \
  --variant "fwd:4x2x8/4x8x2/4/3/tma/r120" > $OUT/c4_causal.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c4_causal.txt
export NAMODELS_FUSED_CACHE=/tmp/empty.json
for p in nat-s1 nat-s1-rpb; do
  timeout 120 python3 benchmarks/tile_ab.py $p --rounds 2 --variant "fwd:2x8/4x16/1/2/tma" --variant "fwd:2x8/4x16/1/2/ptr" \
    --variant "dq:2x8/8x4/1/2/ptr" --variant "dq:2x8/8x4/1/2/tma" --variant "dkdv:2x8/2x16/1/2/ptr" --variant "dkdv:2x8/2x16/1/2/tma" > $OUT/c4_def_$p.txt 2>&1
  echo "$p rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c4_def_$p.txt
done
timeout 120 python3 benchmarks/tile_ab.py nat-s3 --rounds 2 --variant "fwd:1x16/4x16/1/2/tma" --variant "fwd:1x16/4x16/1/2/ptr" \
    --variant "dq:2x8/8x4/1/2/ptr" --variant "dkdv:1x16/2x16/1/2/ptr" > $OUT/c4_def_nat-s3.txt 2>&1
echo "nat-s3 rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c4_def_nat-s3.txt
timeout 100 python3 benchmarks/tile_ab.py dinat-s1 --rounds 2 --kernels fwd --variant "fwd:2x8/8x8/1/2/ptr" --variant "fwd:8x8/8x8/4/3/ptr" > $OUT/c4_def_dinat.txt 2>&1
echo "dinat rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c4_def_dinat.txt
