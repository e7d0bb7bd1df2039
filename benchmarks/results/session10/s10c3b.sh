# Session 10 call 3: GPU tests of the backward host descriptors (on by default now); 3d-causal forward table; nat-s1
# forward ncu; 32-query nat-s1 tiles and the stride variants' 3-stage 32-key tiles (tile_ab).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 110 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider \
  -k "small_window_defaults or built_on_the_host or follow_the_switch or default_keeps or gpu_small_window_tiles" > $OUT/c3_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c3_tests.txt | tail -8
cp .ab/tune_s8c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 80 python3 -m ops.bench --check 16 --rounds 3 --rep 300 --problems 3d-causal --backends fused --out /tmp/c3_causal > $OUT/c3_causal.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c3_causal.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout 90 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 --variant "fwd:1x4x8/1x4x16/1/2/tma" \
  --variant "fwd:1x4x8/1x2x16/1/2/tma/r128" --variant "fwd:1x4x8/1x4x16/2/2/tma" --variant "fwd:1x4x8/1x2x16/2/2/tma" \
  > $OUT/c3_nat_ab.txt 2>&1
echo "nat $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c3_nat_ab.txt
timeout 80 python3 benchmarks/tile_ab.py 1d-32k-s256 --kernels fwd --rounds 3 --variant "fwd:1x1x64/1x1x32/4/3/tma" \
  > $OUT/c3_stride_ab.txt 2>&1
timeout 100 python3 benchmarks/tile_ab.py 2d-flux-s16 --kernels fwd --rounds 3 --variant "fwd:1x4x16/1x2x16/4/3/tma" \
  >> $OUT/c3_stride_ab.txt 2>&1
timeout 120 python3 benchmarks/tile_ab.py 3d-hunyuan-s16x8x8 --kernels fwd --rounds 3 \
  --variant "fwd:1x8x8/1x4x8/4/3/tma" --variant "fwd:1x8x8/1x8x8/4/3/tma" >> $OUT/c3_stride_ab.txt 2>&1
echo "stride $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c3_stride_ab.txt
NCU=/usr/local/cuda/bin/ncu
timeout $(( 575 - ($(date +%s)-T0) )) $NCU -k regex:na_fwd_kernel -c 1 --set full --import-source no -o /tmp/nat python3 .ab/tools/ncu_fwd.py nat-s1 \
  > $OUT/c3_ncu_nat.txt 2>&1
$NCU --import /tmp/nat.ncu-rep --page details >> $OUT/c3_ncu_nat.txt 2>&1
grep -E "Duration|L2 Cache Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued|Achieved Occupancy|Issued Ipc|DRAM Throughput|Memory Throughput" $OUT/c3_ncu_nat.txt
echo "end $(( $(date +%s)-T0 ))s"
