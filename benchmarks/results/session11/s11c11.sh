# NOT RUN: the session's device time ran out before this call; MASK_IN_DOT was reverted (see RESULTS, session 11).
# Session 11 call 11: MASK_IN_DOT with one dot per step (the init tile is zeros on unmasked boxes; call 10's variant
# had two dots in the branches of an if, and gave wrong 3d-hunyuan outputs): 3d-causal with it (rule) against
# selects, 3d-hunyuan with selects (rule) against it, outputs compared; GPU test of both mask paths.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session11
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 60 python3 benchmarks/kernel_ab.py 3d-causal --rounds 9 --rep 300 sel@set=base --set "launch.MASK_IN_DOT_FROM=float('inf')" > $OUT/c11_ab.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"
timeout 60 python3 benchmarks/kernel_ab.py 3d-hunyuan --rounds 3 --rep 300 dot@set=base --set "launch.MASK_IN_DOT_FROM=0.0" >> $OUT/c11_ab.txt 2>&1
echo "hunyuan rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| [0-9a-z]|DIFF|Error|base:|sel@|dot@" $OUT/c11_ab.txt
timeout 50 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider -k "mask_paths" > $OUT/c11_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/c11_tests.txt
