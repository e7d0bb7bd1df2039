# Session 11 call 1: GPU tests of dRPB from dQ's window-layout dS; nat-s1-rpb fwd+bwd with it against the offset
# pass (same process, alternating rounds); 3d-causal forward with the 3-D mask variants (mask_variant.py).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 130 python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider \
  -k "rpb" > $OUT/c1_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c1_tests.txt | tail -8
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
S=benchmarks/results/session11
timeout 120 python3 benchmarks/kernel_ab.py nat-s1-rpb --backward --rounds 5 offset@set=base \
  --set rpb_grad.WINDOW_BUFFER_BYTES=0 > $OUT/c1_ab.txt 2>&1
echo "rpb rc=$? $(( $(date +%s)-T0 ))s"
for m in all3 any; do python3 $S/mask_variant.py ops/fused/kernels.py /tmp/k_$m.py $m; done
timeout 150 python3 benchmarks/kernel_ab.py 3d-causal --rounds 7 --rep 300 all3=/tmp/k_all3.py any=/tmp/k_any.py >> $OUT/c1_ab.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"
timeout $(( 560 - ($(date +%s)-T0) )) python3 benchmarks/kernel_ab.py 3d-causal --backward --rounds 3 all3=/tmp/k_all3.py \
  any=/tmp/k_any.py >> $OUT/c1_ab.txt 2>&1
echo "causal bwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\||base:|DIFF|Error" $OUT/c1_ab.txt
