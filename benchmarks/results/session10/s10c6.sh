# Session 10 call 6: NAT-Tiny training and inference throughput on default tiles (no cache), fused bf16:
# session 9's code (c5e19be, .ab/vold: backward descriptors per program, pointer-load dQ / dK/dV defaults) against
# this session's (host descriptors, TMA dQ / dK/dV on small windows), alternating.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
ARGS="--models nat_tiny --backends fused --precisions bf16 --batch 128 --img-size 224 --warmup 5 --iters 30 --min-iters 10 --time-cap 6 --warmup-cap 6 --no-chart"
for r in 1 2; do
  (cd .ab/vold && NAMODELS_FUSED_CACHE=/tmp/none.json timeout 110 python3 -m namodels.benchmark.throughput $ARGS --out /tmp/c6_old_$r > /tmp/c6_old_$r.log 2>&1); echo "old $r rc=$? $(( $(date +%s)-T0 ))s"
  NAMODELS_FUSED_CACHE=/tmp/none.json timeout 110 python3 -m namodels.benchmark.throughput $ARGS --out /tmp/c6_new_$r > /tmp/c6_new_$r.log 2>&1; echo "new $r rc=$? $(( $(date +%s)-T0 ))s"
done
for f in /tmp/c6_*_?/rows.jsonl; do python3 -c "
import json
for l in open('$f'):
    r=json.loads(l); print('$f'.split('/')[2], r['model'], r['backend'], 'infer', r.get('infer_samples_per_sec'), 'train', r.get('train_samples_per_sec'), r.get('infer_error',''), r.get('train_error',''))"; done | tee $OUT/c6_models.txt
tail -3 /tmp/c6_new_1.log > $OUT/c6_log_tail.txt
