# Session 7 call 2: retune 3d-hunyuan (fwd, dQ, dK/dV) over all candidates with the exact tile model, then fwd+bwd.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s7_nohun.json $OUT/c2_cache.json
export NAMODELS_FUSED_CACHE=$OUT/c2_cache.json
timeout 585 python3 -m ops.bench --backward --autotune --rep 100 --problems 3d-hunyuan --backends fused --out $OUT/c2_bwd > $OUT/c2_bwd.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c2_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
python3 -c "
import json; d=json.load(open('$OUT/c2_cache.json'))
[print(k.split('|')[0], v) for k, v in d.items() if '(30, 48, 80)|(18, 24, 24)|(1, 1, 1)|' in k]"
