# Session 6 call 5: 3d-hunyuan dK/dV tile variants (4 vs 8 warps; ncu showed 4-warp spills), per-kernel profile, 2 rounds.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
for r in 1 2; do
  for v in V1 V2 V3 V4 V5; do
    cp .ab/tune_$v.json /tmp/t_$v.json
    NAMODELS_FUSED_CACHE=/tmp/t_$v.json timeout 120 python3 benchmarks/fused_profile.py 3d-hunyuan --iters 5 >> $OUT/p_${v}.txt 2>&1
    echo "$r $v $(grep dkdv $OUT/p_${v}.txt | tail -1 | awk '{print $1}') $(( $(date +%s)-T0 ))"
  done
done
cp .ab/tune_V4.json /tmp/t.json
NAMODELS_FUSED_CACHE=/tmp/t.json timeout 200 ncu -k regex:"na_bwd_dkdv_kernel" -c 1 --section MemoryWorkloadAnalysis --section SpeedOfLight python3 .ab/tools/ncu_one.py 3d-hunyuan > $OUT/ncu_v4.txt 2>&1
grep -E "Duration|Spilling Requests|L2 Hit|DRAM Throughput" $OUT/ncu_v4.txt
