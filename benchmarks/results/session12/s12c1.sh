# Session 12 call 1: 3d-causal's forward with the window mask as the score matmul's initial value on every box (one
# dot, MASK_IN_DOT; SASS 408 instructions per step against 448 with selects) against the selects, and with 4-program
# tiles; 3d-hunyuan with it forced (outputs and cost); ops.bench 3d-causal against SDPA; GPU tests of both mask paths;
# 1d-32k-s256 forward tile candidates the tuner never timed.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session12
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 150 python3 benchmarks/kernel_ab.py 3d-causal --rounds 9 --rep 300 sel@set=base --set "launch.MASK_IN_DOT_FROM=float('inf')" \
  s2=base --force "s2:fwd=64,64,4,2,1,128" k32=base --force "k32:fwd=64,32,4,3,1,128" k16=base --force "k16:fwd=64,16,4,3,1,0" \
  > $OUT/c1_causal.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| 3d|DIFF|Error|max" $OUT/c1_causal.txt
timeout 90 python3 benchmarks/kernel_ab.py 3d-hunyuan --rounds 3 --rep 300 dot@set=base --set "launch.MASK_IN_DOT_FROM=0.0" > $OUT/c1_hunyuan.txt 2>&1
echo "hunyuan rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| 3d|DIFF|Error|max" $OUT/c1_hunyuan.txt
timeout 90 python3 -m ops.bench --check 16 --rounds 7 --rep 400 --problems 3d-causal --backends fused --out $OUT/c1_bench > $OUT/c1_bench.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "fused|sdpa" $OUT/c1_bench.txt | head -4
timeout 150 python3 -m pytest -q -n 4 -m "gpu or not gpu" tests/test_fused.py -p no:cacheprovider -k "mask_paths or random" > $OUT/c1_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/c1_tests.txt
timeout 100 python3 benchmarks/kernel_ab.py 1d-32k-s256 --rounds 5 --rep 300 a=base --force "a:fwd=128,64,8,2,1,128" \
  b=base --force "b:fwd=128,128,8,3,1,0" c=base --force "c:fwd=64,64,8,3,1,0" d=base --force "d:fwd=64,128,4,2,1,0" > $OUT/c1_s256.txt 2>&1
echo "s256 rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| 1d|DIFF|Error|max" $OUT/c1_s256.txt
