# Session 6 call 4: ncu on the fused kernels (3d-hunyuan and 1d-32k, tuned tiles): where dK/dV's time goes.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s6.json /tmp/tune.json
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats"
for P in 3d-hunyuan 1d-32k; do
  NAMODELS_FUSED_CACHE=/tmp/tune.json timeout 250 ncu -k regex:"na_(fwd|bwd_dq|bwd_dkdv)_kernel" -c 3 $S python3 .ab/tools/ncu_one.py $P > $OUT/ncu_$P.txt 2>&1
  echo "$P rc=$? $(( $(date +%s)-T0 ))"
done
for P in 3d-hunyuan 1d-32k; do echo "=== $P"; grep -E "na_.*kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Warp|No Eligible|Warp Cycles Per Issued|Executed Ipc|DRAM Throughput|Block Limit|ERR|Error" $OUT/ncu_$P.txt | head -80; done
