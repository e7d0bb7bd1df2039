# Session 7 call 11: nat-s1 TMA variants with host-built descriptors (kept best), then the final forward tables
# (nat-s1 / dinat-s1 with flex, the large problems and 3d-causal with SDPA) and 3d-hunyuan fwd+bwd.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp benchmarks/results/session7/c6_cache.json $OUT/c11_cache.json
export NAMODELS_FUSED_CACHE=$OUT/c11_cache.json
timeout 120 python3 benchmarks/tile_ab.py nat-s1 --kernels fwd --rounds 3 --keep-best \
  --variant fwd:2x8/4x16/1/2/tma/r128 --variant fwd:2x8/4x16/1/2/tma/r112 --variant fwd:2x8/4x16/1/2/tma/r96 \
  --variant fwd:2x8/8x4/1/2/tma/r96 --variant fwd:2x8/8x4/1/3/tma/r96 --variant fwd:2x8/4x16/1/3/tma/r128 > $OUT/c11_nat.txt 2>&1
echo "nat rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/c11_nat.txt
timeout 150 python3 -m ops.bench --check 16 --rep 100 --problems nat-s1,dinat-s1 --backends fused,flex --out $OUT/c11_small > $OUT/c11_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c11_small.txt | grep -v "^|---" | cut -d'|' -f2-10
timeout 200 python3 -m ops.bench --rep 100 --problems 3d-causal,2d-flux,3d-hunyuan,1d-32k --backends fused --out $OUT/c11_fwd > $OUT/c11_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c11_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout $(( 585 - ($(date +%s)-T0) )) python3 -m ops.bench --backward --rep 100 --problems 3d-hunyuan --backends fused --out $OUT/c11_bwd > $OUT/c11_bwd.txt 2>&1
echo "bwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c11_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
