# Session 12 call 6: the row sum of the probabilities on the tensor cores (l accumulated as p16 @ ones[keys, 16] in a
# second dot sharing p's registers; `.ab/s12/k_sumdot.py`, unconditional) against today's FADD row sums on 3d-causal
# (392 -> 365 SASS instructions per step offline), dinat-s1 and nat-s1; MASK_IN_DOT on 3d-hunyuan in 5 rounds.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
S=benchmarks/results/session12
export NAMODELS_FUSED_CACHE=/tmp/cache.json; cp $S/c5_cache.json /tmp/c5.json
python3 $S/rekey_cache.py $S/cache_s12.json /tmp/cache.json
python3 -c "
import json; a=json.load(open('/tmp/cache.json')); b=json.load(open('/tmp/c5.json')); a.update(b); json.dump(a, open('/tmp/cache.json','w'))"
for P in 3d-causal dinat-s1 nat-s1; do
  timeout 100 python3 benchmarks/kernel_ab.py $P --rounds 9 --rep 300 sum=.ab/s12/k_sumdot.py >> $OUT/c6_ab.txt 2>&1
  echo "$P rc=$? $(( $(date +%s)-T0 ))s"
done
timeout 150 python3 benchmarks/kernel_ab.py 3d-hunyuan --rounds 5 --rep 300 dot@set=base --set "launch.MASK_IN_DOT_FROM=0.0" >> $OUT/c6_ab.txt 2>&1
echo "hunyuan rc=$? $(( $(date +%s)-T0 ))s"
grep -E "^\| [0-9a-z]|DIFF|Error|max" $OUT/c6_ab.txt
