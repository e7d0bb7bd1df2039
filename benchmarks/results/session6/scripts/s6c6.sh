# Session 6 call 6: program order A/B (O0 = last axis fastest, O1 = axis 0 fastest), per-kernel profile,
# alternating rounds, session-6 tuned tiles (dkdv 3d: V5) + defaults; then ncu L2 hit rates of O1.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
ROOT=$PWD
P="3d-hunyuan 2d-flux 3d-causal nat-s1 1d-32k"
for r in 1 2 3; do
  for v in O0 O1; do
    d=$ROOT/.ab/v$v; [ $v = O1 ] && d=$ROOT
    cp $ROOT/.ab/tune_V5.json /tmp/tune_$v.json
    (cd $d && NAMODELS_FUSED_CACHE=/tmp/tune_$v.json timeout 200 python3 benchmarks/fused_profile.py $P --iters 5 >> $OUT/prof_$v.txt 2>&1)
    echo "round $r $v rc=$? $(( $(date +%s)-T0 ))"
  done
done
for v in O0 O1; do echo "== $v"; grep -E "^[a-z0-9-]+:|na_|Error" $OUT/prof_$v.txt | awk '{print $1, $2}' | paste -sd' ' | sed 's/ \([0-9a-z-]*\): per/\n\1:/g'; done
cp .ab/tune_V5.json /tmp/t.json
NAMODELS_FUSED_CACHE=/tmp/t.json timeout 200 ncu -k regex:"na_(fwd|bwd_dq|bwd_dkdv)_kernel" -c 3 --section MemoryWorkloadAnalysis --section SpeedOfLight python3 .ab/tools/ncu_one.py 3d-hunyuan > $OUT/ncu_o1.txt 2>&1
grep -E "na_.*kernel \(|Duration|L2 Hit|DRAM Throughput" $OUT/ncu_o1.txt
