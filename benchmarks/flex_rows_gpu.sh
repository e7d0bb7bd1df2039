#!/usr/bin/env bash
# Issue 8: the flex rows of the throughput table (plus StyleNAT-256 and the video model on every backend),
# on one warm machine, across several device calls.
#
# flex compiles one kernel per NA problem, dtype and grad mode (about 2.5 min per model row on an H100).
# Phase 1 compiles in parallel processes, timing nothing, so that Inductor's on-disk caches hold every
# graph; phase 2 then times the rows in ONE process, one row after another, where each compile is a
# cache hit.  Phase 2's timings are the only numbers kept.
#
#   start (returns at once; runs on under setsid):  bash benchmarks/flex_rows_gpu.sh start RESUME_ROWS
#   poll  (waits up to SECONDS, copies results):    bash benchmarks/flex_rows_gpu.sh wait SECONDS
set -u
WORK=/tmp/flexrows
COMMON="--batch 128 --img-size 224 --warmup 2 --iters 8 --min-iters 2 --time-cap 1.5 --warmup-cap 1.5 --no-chart"
# the rows still missing from run 4 first, then the minis (their only flex rows were older code)
MODELS="nat_small dinat_small nat_base dinat_base dinat_large nat_tiny dinat_tiny nat_mini dinat_mini"
GEN="stylenat_256 video_nat_tiny"
GEN_COMMON="--batch 16 --img-size 256 --warmup 2 --iters 8 --min-iters 2 --time-cap 3 --warmup-cap 3 --no-chart"
VIDEO_COMMON="--batch 8 --img-size 64 --frames 16 --warmup 2 --iters 8 --min-iters 2 --time-cap 3 --warmup-cap 3 --no-chart"
WARM="--warmup 1 --iters 1 --min-iters 1 --time-cap 0.01 --warmup-cap 0.01"

run_all() {
  export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  T0=$(date +%s)
  log() { echo "[$(( $(date +%s) - T0 )) s] $*" >> "$WORK/progress.txt"; }
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch,triton,timm,sys;print('torch',torch.__version__,'triton',triton.__version__,'timm',timm.__version__,'python',sys.version.split()[0])"
  } > "$WORK/env.txt" 2>&1
  log "phase 1: compile in parallel"
  TP="python3 -m namodels.benchmark.throughput --backends flex --precisions bf16 fp32"
  # grouped so that the largest models (most GPU memory) do not all train at once
  $TP --models dinat_large nat_mini dinat_mini $COMMON $WARM --out $WORK/warm1 > $WORK/warm1.log 2>&1 &
  $TP --models nat_base nat_small nat_tiny $COMMON $WARM --out $WORK/warm2 > $WORK/warm2.log 2>&1 &
  $TP --models dinat_base dinat_small dinat_tiny $COMMON $WARM --out $WORK/warm3 > $WORK/warm3.log 2>&1 &
  { $TP --models stylenat_256 $GEN_COMMON $WARM --out $WORK/warm4 > $WORK/warm4.log 2>&1
    $TP --models video_nat_tiny $VIDEO_COMMON $WARM --out $WORK/warm4 >> $WORK/warm4.log 2>&1; } &
  wait
  log "phase 1 done"
  log "phase 2: timed rows"
  python3 -m namodels.benchmark.throughput --resume --models $MODELS --backends flex --precisions bf16 fp32 \
    $COMMON --out $WORK/table > $WORK/timed.log 2>&1
  log "phase 2 classification done"
  python3 -m namodels.benchmark.throughput --models stylenat_256 --backends fused flex gemm naive \
    --precisions bf16 fp32 $GEN_COMMON --out $WORK/gen > $WORK/gen.log 2>&1
  python3 -m namodels.benchmark.throughput --resume --models video_nat_tiny --backends fused flex gemm naive \
    --precisions bf16 fp32 $VIDEO_COMMON --out $WORK/gen >> $WORK/gen.log 2>&1
  log "phase 2 done"
  echo done > "$WORK/DONE"
}

case "${1:-}" in
  start)
    rm -rf "$WORK"; mkdir -p "$WORK/table"
    cp "${2:?RESUME_ROWS: rows.jsonl of the table to complete}" "$WORK/table/rows.jsonl"
    export -f run_all
    export WORK COMMON MODELS GEN_COMMON VIDEO_COMMON WARM
    setsid bash -c run_all > "$WORK/run_all.log" 2>&1 < /dev/null &
    echo "started"
    ;;
  wait)
    END=$(( $(date +%s) + ${2:-500} ))
    while [ ! -f "$WORK/DONE" ] && [ "$(date +%s)" -lt "$END" ]; do sleep 10; done
    cat "$WORK/progress.txt" 2>/dev/null
    for f in "$WORK"/warm*.log "$WORK/timed.log" "$WORK/gen.log"; do
      [ -f "$f" ] && { echo "== $f"; grep -E "^\S+ +\S+ +(bf16|fp32)|Error|error|recompile" "$f" | tail -8; }
    done
    mkdir -p "$OUT"
    cp "$WORK/env.txt" "$WORK/progress.txt" "$WORK/timed.log" "$OUT/" 2>/dev/null
    cp "$WORK/table/rows.jsonl" "$OUT/table_rows.jsonl" 2>/dev/null
    cp "$WORK/gen/rows.jsonl" "$OUT/gen_rows.jsonl" 2>/dev/null
    cat "$WORK/warm"*.log 2>/dev/null | grep -iE "error|Traceback|OOM|out of memory" | head -20 > "$OUT/warm_errors.txt"
    [ -f "$WORK/DONE" ] && echo "ALL DONE" || echo "still running"
    ;;
  *) echo "usage: $0 start RESUME_ROWS | wait SECONDS"; exit 2 ;;
esac
