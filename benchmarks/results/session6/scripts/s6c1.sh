# Session 6 call 1: dK/dV variants A (HEAD), B (k/v by TMA), C (B + queries-by-keys orientation), per-kernel
# profile in alternating rounds; then the GPU tests of the working tree (C).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
ROOT=$PWD
P="1d-32k 2d-flux 3d-hunyuan nat-s1-rpb"
for r in 1 2 3; do
  for v in A B C; do
    d=$ROOT/.ab/v$v; [ $v = C ] && d=$ROOT
    cp $ROOT/.ab/tune6.json /tmp/tune_$v.json
    (cd $d && NAMODELS_FUSED_CACHE=/tmp/tune_$v.json timeout 200 python3 benchmarks/fused_profile.py $P --iters 5 >> $OUT/prof_$v.txt 2>&1)
    echo "round $r $v rc=$? $(( $(date +%s)-T0 ))"
  done
done
for v in A B C; do echo "== $v"; grep -E "^[a-z0-9-]+:|na_|Error" $OUT/prof_$v.txt | awk '{print $1, $2}' | paste -sd' ' | sed 's/ \([0-9a-z-]*\): per/\n\1:/g'; done
timeout $(( 570 - ($(date +%s)-T0) )) python3 -m pytest -q -m gpu tests/test_fused.py -p no:cacheprovider -k "head_dims or tma or random" > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s)-T0 ))"
grep -E "passed|failed|Error|assert" $OUT/gpu_tests.txt | tail -15
