# Session 6 call 3: A/B of the unsigned window compare (M0 = two compares, M1 = one unsigned compare),
# per-kernel profile, alternating rounds, tiles from the session-6 tuning cache + defaults.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
ROOT=$PWD
which ncu nsys 2>&1 | head -2
P="nat-s1 dinat-s1 3d-causal 2d-flux 3d-hunyuan"
for r in 1 2 3; do
  for v in M0 M1; do
    d=$ROOT/.ab/v$v; [ $v = M1 ] && d=$ROOT
    cp $ROOT/.ab/tune_s6.json /tmp/tune_$v.json
    (cd $d && NAMODELS_FUSED_CACHE=/tmp/tune_$v.json timeout 200 python3 benchmarks/fused_profile.py $P --iters 10 >> $OUT/prof_$v.txt 2>&1)
    echo "round $r $v rc=$? $(( $(date +%s)-T0 ))"
  done
done
for v in M0 M1; do echo "== $v"; grep -E "^[a-z0-9-]+:|na_|Error" $OUT/prof_$v.txt | awk '{print $1, $2}' | paste -sd' ' | sed 's/ \([0-9a-z-]*\): per/\n\1:/g'; done
