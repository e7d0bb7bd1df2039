# Session 7 call 3: forward table (3d-hunyuan with call 2's tiles; 3d-causal and nat-s1 retuned with the exact model
# and the new small-window candidates), flex in the same run.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_s7c_in.json $OUT/c3_cache.json
export NAMODELS_FUSED_CACHE=$OUT/c3_cache.json
timeout 300 python3 -m ops.bench --autotune --check 16 --rep 100 --problems 3d-causal,nat-s1,dinat-s1 --backends fused,flex --out $OUT/c3_small > $OUT/c3_small.txt 2>&1
echo "small rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c3_small.txt | grep -v "^|---" | cut -d'|' -f2-10
timeout $(( 580 - ($(date +%s)-T0) )) python3 -m ops.bench --rep 100 --problems 3d-hunyuan,1d-32k,2d-flux --backends fused --out $OUT/c3_fwd > $OUT/c3_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c3_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
python3 -c "
import json; d=json.load(open('$OUT/c3_cache.json'))
[print(k.split('|')[:3], v) for k, v in d.items() if k.startswith('fwd|') and ('(16, 32, 32)' in k or '(56, 56)' in k)]"
