# Forward A/B/C of session 5 (RESULTS.md, "Session 5", call 2): kernels of an older commit vs the current ones with
# pointer loads vs the current ones with TMA loads, same tiles for all three (a tuned cache; defaults elsewhere,
# with TMA forced on for the third), two alternating rounds.
# Set up the old copy first:  mkdir -p .ab/old && git archive <commit> ops | tar -x -C .ab/old
# Device: bash benchmarks/fused_tma_ab.sh  (carry .ab)
export PYTHONUNBUFFERED=1
C=${CACHE:-$PWD/benchmarks/results/fused_tuning_h100_session4.json}
python3 - "$C" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
json.dump({k: dict(v, tma=False) for k, v in c.items()}, open("/tmp/c_ptr.json", "w"))
json.dump({k: dict(v, tma=True) for k, v in c.items()}, open("/tmp/c_tma.json", "w"))
PY
P=${P:-1d-32k,2d-flux,3d-hunyuan,1d-32k-s256,2d-flux-s16,3d-hunyuan-s16x8x8,3d-causal}
# the defaults table with TMA on or off for the problems the cache does not hold
with_defaults() {
  python3 -c "import dataclasses, sys; from ops.fused import autotune
for k in ('fwd', 'dq', 'dkdv'): autotune.DEFAULTS[k] = [(b, dataclasses.replace(c, tma=$1)) for b, c in autotune.DEFAULTS[k]]
from ops import bench; bench.main(sys.argv[1:])" "${@:2}"
}
for r in 1 2; do
  (cd .ab/old && NAMODELS_FUSED_CACHE=$C python3 -m ops.bench --problems $P --backends fused --rep 100 > $OUT/old_$r.txt 2>&1)
  NAMODELS_FUSED_CACHE=/tmp/c_ptr.json with_defaults False --problems $P --backends fused --rep 100 > $OUT/ptr_$r.txt 2>&1
  NAMODELS_FUSED_CACHE=/tmp/c_tma.json with_defaults True --problems $P --backends fused --rep 100 --check 16 > $OUT/tma_$r.txt 2>&1
done
for f in old_1 ptr_1 tma_1 old_2 ptr_2 tma_2; do
  echo "== $f"; grep -E "^\| " $OUT/$f.txt | grep fused | awk -F'|' '{print $2, $5, $8, $11}'
done
