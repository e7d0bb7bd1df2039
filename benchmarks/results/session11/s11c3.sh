# Session 11 call 3: what skipping the forward's lse store would save on the memory-bound small-window forwards
# (no_lse_variant.py, same process, alternating rounds, tuned cache of session 10).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session11
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
python3 $S/no_lse_variant.py ops/fused/kernels.py /tmp/k_nolse.py
for p in nat-s1 dinat-s1 nat-s3; do
  timeout 100 python3 benchmarks/kernel_ab.py $p --rounds 9 --rep 300 nolse=/tmp/k_nolse.py >> $OUT/c3_ab.txt 2>&1
  echo "$p rc=$? $(( $(date +%s)-T0 ))s"
done
grep -E "^\| [a-z]|DIFF|Error" $OUT/c3_ab.txt
