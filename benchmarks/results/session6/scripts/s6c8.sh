# Session 6 call 8: GPU tests of the final kernels (all of tests/test_fused.py compiled, and the training-step test).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 575 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused.py tests/test_gpu_training.py -p no:cacheprovider -x > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))"
grep -E "passed|failed|Error|assert|FAILED" $OUT/gpu_tests.txt | tail -15
