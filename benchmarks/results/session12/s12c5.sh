# Session 12 call 5: the tuner on today's code (empty cache, NAMODELS_FUSED_AUTOTUNE=1) for the problems whose choice
# this session changed (3d-causal: MASK_IN_DOT; the stride variants: the 128 x 128 candidate), then ops.bench of them
# with the tuned entries against SDPA.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
export NAMODELS_FUSED_CACHE=$OUT/c5_cache.json NAMODELS_FUSED_AUTOTUNE=1
timeout 560 python3 -m ops.bench --check 16 --rounds 5 --rep 400 \
  --problems 3d-causal,1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8 --backends fused --out $OUT/c5_tuned > $OUT/c5_tuned.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c5_tuned.txt | grep -v "^|---" | cut -d'|' -f2-9
python3 -c "
import json; d=json.load(open('$OUT/c5_cache.json'))
for k, v in d.items(): print(k.split('|')[:5], v['outer_tile'], v['inner_tile'], v['num_warps'], v['num_stages'], v.get('tma'), v.get('maxnreg'), round(v['ms'], 4))"
