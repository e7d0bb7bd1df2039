# Prepared in session 9 (no device lent that session): 1. ncu of the nat-s1 / 3d-causal forwards (is nat-s1 bound by
# L2 traffic or by latency? per-SASS-instruction stall samples in the csv); 2. the stride variants' forward with
# 32-key inner tiles at 3 stages (3 CTAs per SM by ptxas / shared memory, against 2 for the tuned 64-key tiles);
# nat-s1 with 32-query tiles (fewer K/V bytes per query).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s8c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
NCU=/usr/local/cuda/bin/ncu
for p in nat-s1 3d-causal; do
  timeout 100 $NCU -k regex:na_fwd_kernel -c 1 --set full --import-source no -o /tmp/$p python3 .ab/tools/ncu_fwd.py $p \
    > $OUT/c3_ncu_${p}.txt 2>&1
  $NCU --import /tmp/$p.ncu-rep --page details >> $OUT/c3_ncu_${p}.txt 2>&1
  $NCU --import /tmp/$p.ncu-rep --page source --print-source sass --csv > $OUT/c3_ncu_${p}_sass.csv 2>&1
  echo "ncu $p $(( $(date +%s)-T0 ))s"
done
grep -E "Duration|L2 Cache Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued|Achieved Occupancy|Issued Ipc" $OUT/c3_ncu_*.txt
# nat-s1 with fewer K/V bytes per query (L2 hypothesis): 32-query tiles on one or two warps (731 / 622 B per query
# against 1024 for the current 16-query tile; 183 / 155 pairs per query against 128)
timeout 90 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 --variant "fwd:1x4x8/1x4x16/1/2/tma" \
  --variant "fwd:1x4x8/1x2x16/1/2/tma/r128" --variant "fwd:1x4x8/1x4x16/2/2/tma" --variant "fwd:1x4x8/1x2x16/2/2/tma" \
  > $OUT/c3_nat_ab.txt 2>&1
echo "nat $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c3_nat_ab.txt
timeout 100 python3 benchmarks/tile_ab.py 1d-32k-s256 --kernels fwd --rounds 3 --variant "fwd:1x1x64/1x1x32/4/3/tma" \
  > $OUT/c3_stride_ab.txt 2>&1
timeout 120 python3 benchmarks/tile_ab.py 2d-flux-s16 --kernels fwd --rounds 3 --variant "fwd:1x4x16/1x2x16/4/3/tma" \
  >> $OUT/c3_stride_ab.txt 2>&1
timeout $(( 570 - ($(date +%s)-T0) )) python3 benchmarks/tile_ab.py 3d-hunyuan-s16x8x8 --kernels fwd --rounds 3 \
  --variant "fwd:1x8x8/1x4x8/4/3/tma" --variant "fwd:1x8x8/1x8x8/4/3/tma" >> $OUT/c3_stride_ab.txt 2>&1
echo "stride $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c3_stride_ab.txt
