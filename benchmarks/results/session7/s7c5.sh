# Session 7 call 5: rest of the GPU tests (tuner, training steps, register cap); register caps on nat-s1 / 3d-causal
# forward (ncu, call 4: nat-s1 runs 12 one-warp programs per SM, limited by 149 registers); nat-s1 table vs flex.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 240 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused.py tests/test_gpu_training.py -p no:cacheprovider -k "autotune_small or training or register_cap" > $OUT/c5_gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|assert|FAILED" $OUT/c5_gpu_tests.txt | tail -8
cp .ab/tune_s7b.json $OUT/c5_cache.json
export NAMODELS_FUSED_CACHE=$OUT/c5_cache.json
timeout 150 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 --keep-best \
  --variant "fwd:2x8/4x16/1/2/ptr/r128" --variant "fwd:2x8/4x16/1/1/ptr" --variant "fwd:2x8/4x16/1/1/ptr/r96" \
  --variant "fwd:2x8/4x16/1/1/ptr/r64" --variant "fwd:2x8/4x16/1/2/ptr/r96" > $OUT/c5_nat.txt 2>&1
echo "nat rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c5_nat.txt
timeout 150 python3 benchmarks/tile_ab.py 3d-causal --kernels fwd --rounds 3 --keep-best \
  --variant "fwd:4x2x8/4x8x2/4/3/tma/r128" --variant "fwd:4x2x8/4x8x2/4/2/tma/r128" --variant "fwd:4x2x8/4x8x2/4/3/tma/r168" \
  --variant "fwd:4x2x8/4x8x2/4/2/tma" > $OUT/c5_causal.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c5_causal.txt
timeout $(( 580 - ($(date +%s)-T0) )) python3 -m ops.bench --check 16 --rep 100 --problems nat-s1 --backends fused,flex --out $OUT/c5_natbench > $OUT/c5_natbench.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c5_natbench.txt | grep -v "^|---" | cut -d'|' -f2-10
