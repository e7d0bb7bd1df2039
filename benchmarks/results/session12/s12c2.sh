# Session 12 call 2: the stride variants' forward on 128 x 128 tiles, 8 warps, 3 stages (call 1: 1d-32k-s256 1.179 ->
# 1.120 ms): kernel_ab on 2d-flux-s16 and 3d-hunyuan-s16x8x8 against the cached tiles, then ops.bench of the three
# against SDPA with a cache whose three entries are that configuration (.ab/tune_s12_128.json, written offline from
# .ab/tune_s10c5.json with autotune.resolve).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session12
cp .ab/tune_s10c5.json /tmp/cache.json; export NAMODELS_FUSED_CACHE=/tmp/cache.json
for P in 2d-flux-s16 3d-hunyuan-s16x8x8; do
  timeout 100 python3 benchmarks/kernel_ab.py $P --rounds 5 --rep 300 t128=base --force "t128:fwd=128,128,8,3,1,0" >> $OUT/c2_ab.txt 2>&1
  echo "$P rc=$? $(( $(date +%s)-T0 ))s"
done
grep -E "^\| [0-9]|DIFF|Error|max" $OUT/c2_ab.txt
cp .ab/tune_s12_128.json /tmp/cache128.json; export NAMODELS_FUSED_CACHE=/tmp/cache128.json
timeout 200 python3 -m ops.bench --check 16 --rounds 7 --rep 400 --problems 1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8 --backends fused --out $OUT/c2_bench > $OUT/c2_bench.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\|" $OUT/c2_bench.txt
