# Session 10 call 4: nat-s1 forward with fewer K/V bytes per query (ncu of call 3: L2 throughput 84.5%, DRAM 42%;
# 32-query one-warp tiles 0.129 -> 0.124 ms): wider query tiles on one warp, 3 stages; the fastest kept in the cache;
# then nat-s1 / dinat-s1 against flex with that cache, alternating rounds.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s8c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 150 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 --keep-best \
  --variant "fwd:1x4x8/1x2x16/1/2/tma/r128" --variant "fwd:1x4x8/1x2x16/1/3/tma/r128" \
  --variant "fwd:1x4x16/1x2x16/1/2/tma/r160" --variant "fwd:1x8x8/1x2x16/1/2/tma/r160" \
  --variant "fwd:1x4x16/1x2x16/2/2/tma" --variant "fwd:1x4x8/1x4x8/1/2/tma/r128" --variant "fwd:1x4x8/1x2x16/1/2/tma" \
  > $OUT/c4_nat_ab.txt 2>&1
echo "nat rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c4_nat_ab.txt; cp /tmp/cache.json $OUT/c4_cache.json
timeout $(( 560 - ($(date +%s)-T0) )) python3 -m ops.bench --check 16 --rounds 5 --rep 300 --problems nat-s1,dinat-s1 \
  --backends fused,flex --out $OUT/c4_small > $OUT/c4_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c4_small.txt | grep -v "^|---" | cut -d'|' -f2-10
