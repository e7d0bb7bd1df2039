# Session 10 call 7: NAT-Tiny trained ~7% slower with this session's backward (call 6). fwd+bwd of NAT-Tiny's four
# stage shapes (batch 128, head dim 32, RPB, 7x7) on default tiles, backward host descriptors off / on, alternating.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
P="--custom s1:128,2,32,56x56,7x7,1x1,1x1,0x0,1 --custom s2:128,4,32,28x28,7x7,1x1,1x1,0x0,1 --custom s3:128,8,32,14x14,7x7,1x1,1x1,0x0,1 --custom s4:128,16,32,7x7,7x7,1x1,1x1,0x0,1"
for r in 1 2; do for sw in False True; do
  NAMODELS_FUSED_CACHE=/tmp/none.json timeout 100 python3 -c "
import runpy, sys
import ops.fused.launch as L
L.BACKWARD_HOST_DESCRIPTORS = $sw
sys.argv = ['ops.bench'] + sys.argv[1:]
runpy.run_module('ops.bench', run_name='__main__')" --backward --rep 200 --problems "" $P --backends fused --out /tmp/c7_${sw}_$r > /tmp/c7_${sw}_$r.txt 2>&1
  echo "host=$sw round $r rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| s" /tmp/c7_${sw}_$r.txt | grep fused | cut -d'|' -f2-6 | tee -a $OUT/c7_stages.txt
done; done
tail -5 /tmp/c7_True_1.txt > $OUT/c7_tail.txt
