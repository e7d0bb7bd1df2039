# Session 7 call 4: GPU tests marked gpu (fused + training step) with the exact tile model; ncu of nat-s1's forward.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 420 python3 -m pytest -q -m gpu tests/test_fused.py tests/test_gpu_training.py -p no:cacheprovider --durations 8 > $OUT/c4_gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|assert|FAILED" $OUT/c4_gpu_tests.txt | tail -12
cp .ab/tune_s7b.json /tmp/tune.json
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats"
NAMODELS_FUSED_CACHE=/tmp/tune.json timeout $(( 580 - ($(date +%s)-T0) )) /usr/local/cuda/bin/ncu -k regex:"na_fwd_kernel" -c 1 $S python3 .ab/tools/ncu_one.py nat-s1 > $OUT/c4_ncu_nat-s1.txt 2>&1
echo "ncu rc=$? $(( $(date +%s)-T0 ))s"
grep -E "na_.*kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|L2 Hit|L1/TEX Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|DRAM Throughput|Block Limit|Max Bandwidth|ERR" $OUT/c4_ncu_nat-s1.txt | head -40
