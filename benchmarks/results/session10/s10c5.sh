# Session 10 call 5: more nat-s1 forward tiles around call 4's best ((1,4,8) x (1,2,16), one warp, 128 registers):
# register caps, 16-key inner tiles, 2x16 / 4x4 query tiles; the fastest kept; nat-s1 against flex again.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s10c4.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 150 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 --keep-best \
  --variant "fwd:1x4x8/1x2x16/1/2/tma/r112" --variant "fwd:1x4x8/1x2x16/1/2/tma/r96" \
  --variant "fwd:1x2x16/1x2x16/1/2/tma/r128" --variant "fwd:1x4x8/1x2x8/1/2/tma/r128" \
  --variant "fwd:1x4x8/1x2x8/1/3/tma/r128" --variant "fwd:1x2x8/1x2x16/1/2/tma/r112" \
  --variant "fwd:1x4x4/1x2x16/1/2/tma/r112" --variant "fwd:1x4x4/1x4x16/1/2/tma/r112" \
  > $OUT/c5_nat_ab.txt 2>&1
echo "nat rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c5_nat_ab.txt; cp /tmp/cache.json $OUT/c5_cache.json
timeout 200 python3 -m ops.bench --check 16 --rounds 5 --rep 300 --problems nat-s1 \
  --backends fused,flex --out $OUT/c5_nat > $OUT/c5_nat.txt 2>&1
echo "nat bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c5_nat.txt | grep -v "^|---" | cut -d'|' -f2-10
