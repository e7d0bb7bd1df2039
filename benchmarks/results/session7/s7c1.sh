# Session 7 call 1: tile shapes from the exact loop model against the session-6 tiles (per kernel, 3 rounds),
# then the fwd+bwd table of 3d-hunyuan with each kernel's winner (SDPA in the same run).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
cp .ab/tune_final.json /tmp/cache.json
export NAMODELS_FUSED_CACHE=/tmp/cache.json
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 360 python3 benchmarks/tile_ab.py 3d-hunyuan --rounds 3 --keep-best \
  --variant "dkdv:2x8x4/4x4x8/8/3/tma" --variant "dkdv:2x4x8/4x4x8/8/3/tma" \
  --variant "fwd:2x4x8/2x4x8/4/3/tma" --variant "dq:2x8x8/2x8x4/8/3/tma" > $OUT/c1_hunyuan.txt 2>&1
echo "tile_ab rc=$? $(( $(date +%s)-T0 ))s"; tail -16 $OUT/c1_hunyuan.txt
cp /tmp/cache.json $OUT/c1_cache.json
timeout $(( 570 - ($(date +%s)-T0) )) python3 -m ops.bench --backward --rep 100 --problems 3d-hunyuan --backends fused --out $OUT/c1_bwd > $OUT/c1_bwd.txt 2>&1
echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep -E "^\| " $OUT/c1_bwd.txt | grep -v "^|---" | cut -d'|' -f2-9
