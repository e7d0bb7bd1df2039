# Session 8 call 8: models on default tiles (no cache; NAT-Tiny / DiNAT-Tiny fused bf16), d8fc726's ops (.ab/vold) against
# this session's, alternating; then 3d-hunyuan forward and the fwd+bwd rows with the tuned cache; the large-logits test.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py -k large_logits > $OUT/c8_tests.txt 2>&1; tail -1 $OUT/c8_tests.txt
ARGS="--models nat_tiny dinat_tiny --backends fused --precisions bf16 --batch 128 --img-size 224 --warmup 2 --iters 10 --min-iters 2 --time-cap 2 --warmup-cap 2 --no-chart"
for r in 1 2; do
  (cd .ab/vold && NAMODELS_FUSED_CACHE=/tmp/none.json timeout 120 python3 -m namodels.benchmark.throughput $ARGS --out /tmp/c8_old_$r > /tmp/c8_old_$r.log 2>&1); echo "old $r rc=$? $(( $(date +%s)-T0 ))s"
  NAMODELS_FUSED_CACHE=/tmp/none.json timeout 120 python3 -m namodels.benchmark.throughput $ARGS --out /tmp/c8_new_$r > /tmp/c8_new_$r.log 2>&1; echo "new $r rc=$? $(( $(date +%s)-T0 ))s"
done
for f in /tmp/c8_*_?/rows.jsonl; do python3 -c "
import json
for l in open('$f'):
    r=json.loads(l); print('$f'.split('/')[2], r['model'], r['backend'], 'infer', r.get('infer_samples_per_sec'), 'train', r.get('train_samples_per_sec'), r.get('infer_error',''), r.get('train_error',''))"; done | tee $OUT/c8_models.txt
cp .ab/tune_s8c5.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
timeout 100 python3 -m ops.bench --check 16 --rep 300 --problems 3d-hunyuan --backends fused --out $OUT/c8_fwd > $OUT/c8_fwd.txt 2>&1
echo "fwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c8_fwd.txt | grep -v "^|---" | cut -d'|' -f2-9
timeout $(( 540 - ($(date +%s)-T0) )) python3 -m ops.bench --backward --rep 200 --problems 1d-32k,2d-flux,3d-hunyuan --backends fused --out $OUT/c8_bwd > $OUT/c8_bwd.txt 2>&1
echo "bwd rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c8_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
