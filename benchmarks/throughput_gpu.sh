#!/usr/bin/env bash
# Issue 8 GPU run in ONE device call (results: benchmarks/RESULTS.md, "Model throughput (issue 8)").
# Priority rows first; every row is appended to OUT/rows.jsonl as soon as it is measured, so a timeout
# keeps what was done.  flex (one torch.compile per NA shape and dtype) runs last on what time is left.
#   bash benchmarks/throughput_gpu.sh OUT_DIR [TOTAL_SECONDS]
set -u
OUT=${1:?usage: throughput_gpu.sh OUT_DIR [TOTAL_SECONDS]}
TOTAL=${2:-345}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Continue an earlier call's table: RESUME_FROM=<its rows.jsonl> (carried into the device tree);
# rows already there are skipped, so several calls fill one table.
RESUME=""
if [ -n "${RESUME_FROM:-}" ]; then cp "$RESUME_FROM" "$OUT/rows.jsonl" && RESUME="--resume"; fi
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch,triton,timm,sys;print('torch',torch.__version__,'triton',triton.__version__,'timm',timm.__version__,'python',sys.version.split()[0])"
} > "$OUT/env.txt" 2>&1
COMMON=${COMMON:-"--batch 128 --img-size 224 --warmup 2 --iters 10 --min-iters 2 --time-cap 2 --warmup-cap 2"}
# part 1 gets PART1_PERCENT of the time; flex (part 2) runs on FLEX_MODELS with the rest
PART1_PERCENT=${PART1_PERCENT:-68}
FLEX_MODELS=${FLEX_MODELS:-"nat_mini dinat_mini nat_tiny"}
# 1) fused / naive / gemm / dense SDPA: minis, NAT-Tiny and the timm baselines (bf16, then fp32), then the rest
export NAMODELS_BENCH_DEADLINE=$((T0 + TOTAL * PART1_PERCENT / 100))
PART1_LIMIT=$((TOTAL * (PART1_PERCENT + 17) / 100)); [ "$PART1_LIMIT" -gt "$TOTAL" ] && PART1_LIMIT=$TOTAL
timeout "$PART1_LIMIT" python3 -m namodels.benchmark.throughput \
  --models nat_mini dinat_mini nat_tiny swin_tiny_patch4_window7_224 convnext_tiny / \
           dinat_tiny nat_small dinat_small nat_base dinat_base dinat_large \
  --backends fused naive gemm sdpa --precisions bf16 fp32 $COMMON --no-chart --out "$OUT" $RESUME > "$OUT/log1.txt" 2>&1
# 2) flex on the minis and NAT-Tiny with the time left
export NAMODELS_BENCH_DEADLINE=$((T0 + TOTAL - 15))
LEFT=$((T0 + TOTAL - $(date +%s)))
if [ "$LEFT" -gt 20 ]; then
  timeout "$LEFT" python3 -m namodels.benchmark.throughput --resume --models $FLEX_MODELS \
    --backends flex --precisions bf16 fp32 $COMMON --no-chart --out "$OUT" > "$OUT/log2.txt" 2>&1
fi
unset NAMODELS_BENCH_DEADLINE
python3 -m namodels.benchmark.report "$OUT" > /dev/null 2>&1 || echo "report failed"
echo "elapsed $(( $(date +%s) - T0 )) s"
tail -4 "$OUT/log1.txt"; tail -4 "$OUT/log2.txt" 2>/dev/null
cat "$OUT/throughput.md"
