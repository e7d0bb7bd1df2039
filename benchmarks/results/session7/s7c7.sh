# Session 7 call 7: model-level check of the exact tile model on default tiles (no tuning cache): NAT-Tiny / DiNAT-Tiny
# fused bf16 inference + training, old (e4b229a) and new ops/ alternating, 2 rounds; then compiled fused tests (not gpu).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
export NAMODELS_FUSED_CACHE=/tmp/none.json
ARGS="--models nat_tiny dinat_tiny --backends fused --precisions bf16 --batch 128 --img-size 224 --warmup 2 --iters 10 --min-iters 2 --time-cap 2 --warmup-cap 2 --no-chart"
for r in 1 2; do
  (cd .ab/vold && timeout 120 python3 -m namodels.benchmark.throughput $ARGS --out /tmp/c7_old_$r > /tmp/c7_old_$r.log 2>&1); echo "old $r rc=$? $(( $(date +%s)-T0 ))s"
  timeout 120 python3 -m namodels.benchmark.throughput $ARGS --out /tmp/c7_new_$r > /tmp/c7_new_$r.log 2>&1; echo "new $r rc=$? $(( $(date +%s)-T0 ))s"
done
for f in /tmp/c7_*_?/rows.jsonl; do python3 -c "
import json
for l in open('$f'):
    r=json.loads(l); print('$f'.split('/')[2], r['model'], r['backend'], 'infer', r.get('infer_samples_per_sec'), 'train', r.get('train_samples_per_sec'), r.get('infer_error',''), r.get('train_error',''))"; done | tee $OUT/c7_models.txt
cat /tmp/c7_old_1.log /tmp/c7_new_1.log > $OUT/c7_logs.txt
timeout $(( 585 - ($(date +%s)-T0) )) python3 -m pytest -q -m "not gpu" tests/test_fused.py -p no:cacheprovider > $OUT/c7_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|Error|FAILED" $OUT/c7_tests.txt | tail -8; tail -c 300 $OUT/c7_tests.txt
