# Session 8 call 6: lazy softmax rescaling in the forward (LAZY_RESCALE; the accumulator is rescaled only when a
# row's max grew by more than 2**8) against the eager rescale, alternating processes, tuned tiles (call 5's cache);
# then the forward tables with it on.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s8c5.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
for r in 1 2; do
  for p in 1d-32k-s256 2d-flux-s16 3d-hunyuan-s16x8x8 3d-causal nat-s1 1d-32k 2d-flux; do
    for lr in 0 1; do
      NAMODELS_LAZY_RESCALE=$lr timeout 100 python3 benchmarks/tile_ab.py $p --kernels fwd --rounds 1 2>&1 | grep "current" | sed "s/^/lazy$lr r$r $p /" >> $OUT/c6_ab.txt
    done
  done
  echo "round $r $(( $(date +%s)-T0 ))s"
done
sort -k3,3 -k1,1 $OUT/c6_ab.txt
export NAMODELS_LAZY_RESCALE=1
timeout 200 python3 -m ops.bench --check 16 --rep 500 --problems 1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,3d-causal --backends fused --out $OUT/c6_fwd > $OUT/c6_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c6_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout 100 python3 -m ops.bench --check 16 --rep 500 --problems nat-s1 --backends fused,flex --out $OUT/c6_nat > $OUT/c6_nat.txt 2>&1
echo "nat rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c6_nat.txt | grep -v "^|---" | cut -d'|' -f2-10
