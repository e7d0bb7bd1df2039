# Session 6 call 11: dQ variants: D0 (HEAD), D1 (keys as matmul rows where the key tile has >= 64 rows),
# D2 (HEAD with the dQ programs in axis-0-fastest order); per-kernel profile, 2 alternating rounds, final tiles.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
ROOT=$PWD
P="3d-hunyuan 2d-flux 1d-32k"
for r in 1 2; do
  for v in D0 D1 D2; do
    d=$ROOT/.ab/v$v; [ $v = D1 ] && d=$ROOT
    cp $ROOT/.ab/tune_final.json /tmp/tune_$v.json
    (cd $d && NAMODELS_FUSED_CACHE=/tmp/tune_$v.json timeout 150 python3 benchmarks/fused_profile.py $P --iters 5 >> $OUT/prof_$v.txt 2>&1)
    echo "round $r $v rc=$? $(( $(date +%s)-T0 ))"
  done
done
for v in D0 D1 D2; do echo "== $v"; grep -E "^[a-z0-9-]+:|na_|Error" $OUT/prof_$v.txt | awk '{print $1, $2}' | paste -sd' ' | sed 's/ \([0-9a-z-]*\): per/\n\1:/g'; done
