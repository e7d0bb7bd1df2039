# Session 11 call 2: where nat-s1-rpb's fwd+bwd goes with each dRPB path (torch.profiler, per kernel), then NAT-Tiny
# training / inference throughput (bf16, batch 128, default tiles) with the window-layout dRPB against the offset
# pass, alternating.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session11
cp .ab/tune_s10c5.json /tmp/cache.json
NAMODELS_FUSED_CACHE=/tmp/cache.json timeout 60 python3 $S/profile_rpb.py nat-s1-rpb > $OUT/c2_profile.txt 2>&1
NAMODELS_FUSED_CACHE=/tmp/cache.json timeout 60 python3 $S/profile_rpb.py nat-s1-rpb --offset >> $OUT/c2_profile.txt 2>&1
echo "profile rc=$? $(( $(date +%s)-T0 ))s"
ARGS="--models nat_tiny --backends fused --precisions bf16 --batch 128 --img-size 224 --warmup 5 --iters 30 --min-iters 10 --time-cap 6 --warmup-cap 6 --no-chart"
OFFSET="import runpy,sys; import ops.fused.rpb_grad as R; R.WINDOW_BUFFER_BYTES=0; sys.argv=['x']+sys.argv[1:]; runpy.run_module('namodels.benchmark.throughput', run_name='__main__')"
for r in 1 2; do
  NAMODELS_FUSED_CACHE=/tmp/none.json timeout 100 python3 -c "$OFFSET" $ARGS --out /tmp/c2_offset_$r > /tmp/c2_offset_$r.log 2>&1; echo "offset $r rc=$? $(( $(date +%s)-T0 ))s"
  NAMODELS_FUSED_CACHE=/tmp/none.json timeout 100 python3 -m namodels.benchmark.throughput $ARGS --out /tmp/c2_window_$r > /tmp/c2_window_$r.log 2>&1; echo "window $r rc=$? $(( $(date +%s)-T0 ))s"
done
for f in /tmp/c2_*_?/rows.jsonl; do python3 -c "
import json
for l in open('$f'):
    r=json.loads(l); print('$f'.split('/')[2], r['model'], r['backend'], 'infer', r.get('infer_samples_per_sec'), 'train', r.get('train_samples_per_sec'), r.get('infer_error',''), r.get('train_error',''))"; done | tee $OUT/c2_models.txt
tail -3 /tmp/c2_window_1.log /tmp/c2_offset_1.log > $OUT/c2_log_tail.txt
grep -E "Name|na_|void|elementwise|reduce|gemm|Self CUDA time total" $OUT/c2_profile.txt | cut -c1-150 | head -60
