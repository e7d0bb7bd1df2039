# Session 7 call 6: 2d-flux retuned (fwd, dQ, dK/dV) with the exact tile model (13 of its 27 candidate tile sizes get
# new shapes), fwd+bwd; then the forward table of the large problems with the final cache.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s7d_in.json $OUT/c6_cache.json
export NAMODELS_FUSED_CACHE=$OUT/c6_cache.json
timeout 420 python3 -m ops.bench --backward --autotune --rep 100 --problems 2d-flux --backends fused --out $OUT/c6_bwd > $OUT/c6_bwd.txt 2>&1
echo "bwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c6_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout $(( 585 - ($(date +%s)-T0) )) python3 -m ops.bench --autotune --rep 100 --problems 2d-flux,3d-hunyuan,1d-32k,3d-causal --backends fused --out $OUT/c6_fwd > $OUT/c6_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c6_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
python3 -c "
import json; d=json.load(open('$OUT/c6_cache.json'))
[print(k.split('|')[0], v) for k, v in d.items() if '(256, 256)|(80, 80)|(1, 1)|(1, 1)' in k]"
