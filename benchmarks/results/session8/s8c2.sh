# Session 8 call 2: loop counters instead of per-iteration index divisions, division-free program decode for
# undilated / dummy axes, reciprocal normalisation.  A/B against HEAD's kernels (.ab/old) in alternating rounds
# (tuner's CUDA-graph timing, same cached tiles), then the forward tables of the small problems and GPU tests.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_final_s7.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
for r in 1 2; do
  for p in nat-s1:fwd,dq,dkdv 3d-causal:fwd 1d-32k:fwd,dq,dkdv 2d-flux:fwd dinat-s1:fwd; do
    name=${p%%:*}; k=${p##*:}
    (cd .ab/old && timeout 100 python3 benchmarks/tile_ab.py $name --kernels $k --rounds 1) 2>&1 | grep "^| " | sed "s/^/old r$r $name /" >> $OUT/c2_ab.txt
    timeout 100 python3 benchmarks/tile_ab.py $name --kernels $k --rounds 1 2>&1 | grep "^| " | sed "s/^/new r$r $name /" >> $OUT/c2_ab.txt
  done
  echo "round $r $(( $(date +%s)-T0 ))s"
done
grep "current" $OUT/c2_ab.txt | sort -k3,3 -k1,1 -k2,2
timeout 120 python3 -m ops.bench --check 16 --rep 100 --problems nat-s1,dinat-s1 --backends fused,flex --out $OUT/c2_small > $OUT/c2_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c2_small.txt | grep -v "^|---" | cut -d'|' -f2-10
timeout 100 python3 -m ops.bench --check 16 --rep 100 --problems 3d-causal,2d-flux --backends fused --out $OUT/c2_fwd > $OUT/c2_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c2_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout $(( 570 - ($(date +%s)-T0) )) python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_fused.py -k "small_window or host or tma_loads or random_problems or repeated or small_tiles" > $OUT/c2_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/c2_tests.txt
