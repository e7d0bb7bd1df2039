# Session 8 call 7: GPU tests of the final kernels and defaults (gpu-marked fused + training tests, then the compiled
# non-gpu fused tests).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 400 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu tests/test_fused.py tests/test_gpu_training.py > $OUT/c7_gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/c7_gpu_tests.txt
timeout $(( 570 - ($(date +%s)-T0) )) python3 -m pytest -q -p no:cacheprovider -n 4 -m "not gpu" tests/test_fused.py > $OUT/c7_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/c7_tests.txt
