# Session 11 call 10: 3-D forward masks folded into the score matmul's accumulator (mask_acc_variant.py: a 0 / -inf
# bias tile as the dot's initial value on partial boxes; SASS: same instruction count on 3d-causal's masked step,
# 49,200 B of shared memory against 57,368, so 4 programs per SM instead of 3) against the current kernels.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session11
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
python3 $S/mask_acc_variant.py ops/fused/kernels.py /tmp/k_acc.py
timeout 80 python3 benchmarks/kernel_ab.py 3d-causal --rounds 9 --rep 300 acc=/tmp/k_acc.py > $OUT/c10_ab.txt 2>&1
echo "causal rc=$? $(( $(date +%s)-T0 ))s"
timeout $(( 200 - ($(date +%s)-T0) )) python3 benchmarks/kernel_ab.py 3d-hunyuan --rounds 3 --rep 300 acc=/tmp/k_acc.py >> $OUT/c10_ab.txt 2>&1
echo "hunyuan rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| [0-9a-z]|DIFF|Error|base:|acc:" $OUT/c10_ab.txt
