# Session 6 call 2: tune dK/dV (new orientation rule) on 3d-hunyuan, fwd+bwd E beside SDPA, per-kernel profile;
# then tune the whole backward of 1d-32k / 2d-flux and time them.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune6_nodkdv.json $OUT/tune.json
NAMODELS_FUSED_CACHE=$OUT/tune.json timeout 330 python3 -m ops.bench --backward --autotune --rep 100 --problems 3d-hunyuan --backends fused --out $OUT/h > $OUT/h.txt 2>&1
echo "hunyuan rc=$? $(( $(date +%s)-T0 ))"; grep -E "^\| " $OUT/h.txt | grep -v "^|---"
NAMODELS_FUSED_CACHE=$OUT/tune.json timeout 60 python3 benchmarks/fused_profile.py 3d-hunyuan --iters 5 > $OUT/prof.txt 2>&1
echo "prof $(( $(date +%s)-T0 ))"; cat $OUT/prof.txt | head -8
grep -A12 "dkdv|3" $OUT/tune.json | tr -d ' \n'; echo
NAMODELS_FUSED_CACHE=$OUT/tune.json timeout $(( 585 - ($(date +%s)-T0) )) python3 -m ops.bench --backward --autotune --rep 100 --problems 1d-32k,2d-flux --backends fused --out $OUT/b12 > $OUT/b12.txt 2>&1
echo "b12 rc=$? $(( $(date +%s)-T0 ))"; grep -E "^\| " $OUT/b12.txt | grep -v "^|---"
