# Session 7 call 10: forward K/V descriptors built on the host (new) against per-program device-side descriptors
# (base, HEAD's ops/), alternating processes, 2 rounds each; same tiles.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp benchmarks/results/session7/c6_cache.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
NAT='--variant fwd:2x8/4x16/1/2/tma/r128 --variant fwd:2x8/4x16/1/2/tma --variant fwd:2x8/8x4/1/2/tma --variant fwd:8x8/4x16/4/2/tma'
CAU='--variant fwd:4x2x8/4x8x2/4/3/tma --variant fwd:4x2x8/4x8x2/4/3/ptr/r128'
for r in 1 2; do
  for tree in new base; do
    D=.; [ $tree = base ] && D=.ab/vbase
    (cd $D && timeout 100 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 2 $NAT > /tmp/c10_${tree}_nat_$r.txt 2>&1
     timeout 100 python3 benchmarks/tile_ab.py 3d-causal --kernels fwd --rounds 2 $CAU > /tmp/c10_${tree}_cau_$r.txt 2>&1
     timeout 100 python3 benchmarks/tile_ab.py 2d-flux --kernels fwd --rounds 2 > /tmp/c10_${tree}_flux_$r.txt 2>&1)
    echo "$tree $r $(( $(date +%s)-T0 ))s"
  done
done
for f in /tmp/c10_*.txt; do echo "== $f"; grep "^|" $f; done > $OUT/c10_summary.txt
cat /tmp/c10_*.txt > $OUT/c10_all.txt
grep -c Error $OUT/c10_all.txt; cat $OUT/c10_summary.txt | head -80
