# Session 8 call 1: keys-as-rows forward (KEY_ROWS) for the small-window problems, both accumulator orientations
# (1: acc [queries, dv] on mma.sync; 2: acc [dv, queries] on wgmma); GPU tests of the new path first.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_fused.py -k "small_window or keys_as_rows or host" > $OUT/c1_tests.txt 2>&1
echo "tests1 rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/c1_tests.txt
NAMODELS_KEY_ROWS_ACC=2 timeout 120 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_fused.py -k "small_window or keys_as_rows" >> $OUT/c1_tests.txt 2>&1
echo "tests2 rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/c1_tests.txt
cp .ab/tune_final_s7.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
CV='--variant fwd:4x2x2/4x2x8/4/3/tma --variant fwd:4x2x2/4x2x8/4/2/tma --variant fwd:4x2x2/4x2x8/4/3/ptr --variant fwd:4x2x4/4x8x2/4/3/tma --variant fwd:4x2x2/4x4x8/4/3/tma --variant fwd:4x2x2/4x4x8/8/2/tma --variant fwd:4x2x2/4x2x8/4/3/tma/r128'
NV='--variant fwd:2x8/4x16/4/2/tma --variant fwd:2x8/4x16/4/3/tma --variant fwd:2x8/4x16/4/2/ptr --variant fwd:2x8/8x16/4/2/tma --variant fwd:2x8/8x16/8/2/tma --variant fwd:4x8/4x16/4/2/tma --variant fwd:2x8/4x16/2/2/tma'
for acc in 1 2; do
  NAMODELS_KEY_ROWS_ACC=$acc timeout 200 python3 benchmarks/tile_ab.py 3d-causal --kernels fwd --rounds 3 $CV > $OUT/c1_causal_acc$acc.txt 2>&1
  echo "causal acc$acc rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c1_causal_acc$acc.txt
  NAMODELS_KEY_ROWS_ACC=$acc timeout 150 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 $NV > $OUT/c1_nat_acc$acc.txt 2>&1
  echo "nat acc$acc rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c1_nat_acc$acc.txt
done
