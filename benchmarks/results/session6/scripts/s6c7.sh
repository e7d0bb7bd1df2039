# Session 6 call 7: small-window problems tuned with the new 16-query candidates, beside flex and SDPA (fwd), then
# nat-s1-rpb fwd+bwd tuned.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
echo '{}' > $OUT/tune_small.json
NAMODELS_FUSED_CACHE=$OUT/tune_small.json timeout 330 python3 -m ops.bench --autotune --check 16 --rep 100 --problems nat-s1,dinat-s1,3d-causal --backends fused,flex --out $OUT/small_fwd > $OUT/small_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))"; grep -E "^\| " $OUT/small_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
python3 -c "
import json; c=json.load(open('$OUT/tune_small.json'))
for k,v in c.items(): print(k.split('|')[0], k.split('|')[2], v['outer_tile'], v['inner_tile'], v['num_warps'], v['num_stages'], v['tma'], round(v['ms'],4))"
NAMODELS_FUSED_CACHE=$OUT/tune_small.json timeout $(( 580 - ($(date +%s)-T0) )) python3 -m ops.bench --backward --autotune --rep 100 --problems nat-s1-rpb --backends fused,naive --out $OUT/small_bwd > $OUT/small_bwd.txt 2>&1
echo "bwd rc=$? $(( $(date +%s)-T0 ))"; grep -E "^\| " $OUT/small_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
