# Session 12 call 7: MASK_IN_DOT in the backward too (dQ and dK/dV start their score matmuls from the window bias;
# offline 3d-causal dQ 404 -> 343 and dK/dV 575 -> 510 SASS instructions per step, nat-s1 256 -> 234 / 392 -> 369):
# fwd+bwd against the selects everywhere (MASK_IN_DOT_FROM=inf); GPU tests of the mask paths with gradients.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session12
# caches: call 4's and call 5's tuned entries, re-keyed to today's CODE_VERSION (the kernels changed since)
export NAMODELS_FUSED_CACHE=/tmp/cache.json
# (as run, the merge took two rekey calls and a python -c json merge; the same entries)
python3 $S/rekey_cache.py $S/cache_s12.json $S/c5_cache.json /tmp/cache.json
for P in 3d-causal nat-s1 nat-s1-rpb; do
  timeout 120 python3 benchmarks/kernel_ab.py $P --backward --rounds 9 --rep 400 sel@set=base --set "launch.MASK_IN_DOT_FROM=float('inf')" >> $OUT/c7_ab.txt 2>&1
  echo "$P rc=$? $(( $(date +%s)-T0 ))s"
done
grep -E "^\| [0-9a-z]|DIFF|Error|max" $OUT/c7_ab.txt
timeout 150 python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider -k "mask_paths or random or small_tiles" > $OUT/c7_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/c7_tests.txt
