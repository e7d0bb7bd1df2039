# Session 11 call 6: fwd+bwd of nat-s1 / nat-s1-rpb on default tiles (no cache: the session-10 cache holds RPB dQ /
# dK/dV entries tuned before the backward's host descriptors), session 10's code (f351fa6, .ab/vold) against this
# session's, alternating processes; is call 5's nat-s1 fwd+bwd (0.803 ms, tuned cache) against session 10's 0.716
# (defaults) a regression?
export PYTHONUNBUFFERED=1
T0=$(date +%s)
export NAMODELS_FUSED_CACHE=/tmp/none.json
A="--backward --rounds 3 --rep 200 --problems nat-s1,nat-s1-rpb --backends fused"
for r in 1 2; do
  (cd .ab/vold && timeout 90 python3 -m ops.bench $A > /tmp/old_$r.txt 2>&1); echo "old $r rc=$? $(( $(date +%s)-T0 ))s"
  timeout 90 python3 -m ops.bench $A > /tmp/new_$r.txt 2>&1; echo "new $r rc=$? $(( $(date +%s)-T0 ))s"
done
for f in /tmp/old_1.txt /tmp/new_1.txt /tmp/old_2.txt /tmp/new_2.txt; do echo "== $f"; grep -E "^\| " $f | grep -v "^|---" | grep fused | cut -d'|' -f2-6; done | tee $OUT/c6_ab.txt
