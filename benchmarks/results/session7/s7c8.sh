# Session 7 call 8: 2-D masks per axis (variant A) against one combined mask (base), 2d-flux, per kernel, alternating
# processes (2 rounds each).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s7b.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
for r in 1 2; do
  timeout 140 python3 benchmarks/tile_ab.py 2d-flux --rounds 2 > /tmp/c8_base_$r.txt 2>&1; echo "base $r rc=$? $(( $(date +%s)-T0 ))s"
  (cd .ab/vA && timeout 140 python3 benchmarks/tile_ab.py 2d-flux --rounds 2 > /tmp/c8_A_$r.txt 2>&1); echo "A $r rc=$? $(( $(date +%s)-T0 ))s"
done
for f in /tmp/c8_*.txt; do echo "== $f"; grep "current" $f | grep "^|"; done | tee $OUT/c8_summary.txt
cat /tmp/c8_*.txt > $OUT/c8_all.txt
