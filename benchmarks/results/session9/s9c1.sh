# Session 9 call 1: ncu (full set + per-SASS-instruction stall samples) of the nat-s1 and 3d-causal forwards, cached tiles.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s8c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
NCU=/usr/local/cuda/bin/ncu
for p in nat-s1 3d-causal; do
  timeout 200 $NCU -k regex:na_fwd_kernel -c 1 --set full --import-source no -o /tmp/$p python3 .ab/tools/ncu_fwd.py $p > $OUT/ncu_${p}_details.txt 2>&1
  echo "$p rc=$? $(( $(date +%s)-T0 ))s"
  $NCU --import /tmp/$p.ncu-rep --page details >> $OUT/ncu_${p}_details.txt 2>&1
  $NCU --import /tmp/$p.ncu-rep --page source --print-source sass --csv > $OUT/ncu_${p}_sass.csv 2>&1
  ls -la $OUT
done
grep -E "Duration|Throughput|Warp Cycles|Issued Ipc|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|No Eligible|Active Warps Per" $OUT/ncu_*_details.txt | head -60
