# Session 10 call 9: nat-s1 forward, 64-query tiles on 2 / 4 warps with 2x16 key tiles (448 K/V bytes per query against
# 640 for call 5's 32-query tile); the fastest kept; nat-s1 against flex.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 70 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 --keep-best \
  --variant "fwd:1x8x8/1x2x16/4/2/tma" --variant "fwd:1x8x8/1x2x16/2/2/tma" --variant "fwd:1x8x8/1x2x16/4/3/tma" \
  --variant "fwd:1x8x8/1x4x16/4/2/tma" --variant "fwd:1x4x16/1x2x16/4/2/tma" > $OUT/c9_nat_ab.txt 2>&1
echo "nat rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c9_nat_ab.txt; cp /tmp/cache.json $OUT/c9_cache.json
timeout $(( 165 - ($(date +%s)-T0) )) python3 -m ops.bench --check 16 --rounds 5 --rep 300 --problems nat-s1 \
  --backends fused,flex --out $OUT/c9_nat > $OUT/c9_nat.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c9_nat.txt | grep -v "^|---" | cut -d'|' -f2-10
