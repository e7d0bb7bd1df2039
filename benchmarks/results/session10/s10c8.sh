# Session 10 call 8: NAT-Tiny training throughput (fused bf16, default tiles) with the backward host descriptors off /
# on, same code, alternating (call 6 compared against session 9's code: train 1271 / 1286 old, 1203 / 1149 new).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
ARGS="--models nat_tiny --backends fused --precisions bf16 --batch 128 --img-size 224 --warmup 5 --iters 30 --min-iters 10 --time-cap 6 --warmup-cap 6 --no-chart"
for r in 1 2 3; do for sw in False True; do
  NAMODELS_FUSED_CACHE=/tmp/none.json timeout 60 python3 -c "
import runpy, sys
import ops.fused.launch as L
L.BACKWARD_HOST_DESCRIPTORS = $sw
sys.argv = ['throughput'] + sys.argv[1:]
runpy.run_module('namodels.benchmark.throughput', run_name='__main__')" $ARGS --out /tmp/c8_${sw}_$r > /tmp/c8_${sw}_$r.log 2>&1
  echo "host=$sw $r rc=$? $(( $(date +%s)-T0 ))s"
  python3 -c "
import json
for l in open('/tmp/c8_${sw}_$r/rows.jsonl'):
    r=json.loads(l); print('host=$sw round $r', r['model'], 'infer', r.get('infer_samples_per_sec'), 'train', r.get('train_samples_per_sec'))" | tee -a $OUT/c8_models.txt
done; done
