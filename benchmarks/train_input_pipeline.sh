#!/bin/bash
# End-to-end training throughput on JPEG files against the same run on synthetic tensors: train.py with an in1k recipe
# (compiled as the recipe says, or eager), samples/s from the ThroughputMonitor (median of the run's second half of
# windows), and the ratio; then the validation loader's images/s alone (namodels.benchmark.input_pipeline).  Both
# training runs take $BATCHES steps: the folder run as many epochs of its training split as that needs.  Makes an
# ImageNet-like folder first when $ROOT has none (namodels.benchmark.jpeg_folder).
# Usage (repo root, after `pip install -e .`, on a GPU machine):
#   [ROOT=/tmp/imagenet_like] [PIPELINE=gpu|cpu] [WORKERS=10 (CPU pipeline)] [GPU_WORKERS=6] [LAUNCHER=main|workers] \
#       [MPS=1] \
#       bash benchmarks/train_input_pipeline.sh \
#       [experiments (default: nat_tiny_in1k dinat_tiny_in1k)] [-- extra train.py overrides, e.g. model.compile=false]
# MPS=1 runs every process under an MPS control daemon of this user (started here, stopped at the end): the training
# process and the GPU pipeline's loader processes then share the GPU instead of taking turns on it, which shows how
# much of the gap is time-slicing between their contexts.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=${ROOT:-/tmp/imagenet_like}; BATCHES=${BATCHES:-300}; PIPELINE=${PIPELINE:-gpu}; WORKERS=${WORKERS:-10}
exps=(); extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  exps+=("$1"); shift
done
[ ${#exps[@]} -eq 0 ] && exps=(nat_tiny_in1k dinat_tiny_in1k)
[ -d "$ROOT/train" ] || python3 -m namodels.benchmark.jpeg_folder "$ROOT" --train 12800 --val 1000 --classes 100 \
    --odd 10 || exit 1
nvidia-smi -L
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$OUT/mps_pipe CUDA_MPS_LOG_DIRECTORY=$OUT/mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS control daemon started" || { echo "MPS: could not start"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
files=$(find "$ROOT/train" -type f | wc -l)
epochs=$(( (BATCHES * 128 + files - 1) / files ))  # the folder run's epochs for $BATCHES steps of batch 128
common=(trainer.limit_train_batches=$BATCHES trainer.limit_val_batches=0
        trainer.num_sanity_val_steps=0 trainer.log_every_n_steps=10 callbacks.throughput.window_size=5
        trainer.enable_checkpointing=false callbacks.model_checkpoint=null callbacks.last_checkpoint=null
        callbacks.curves=null callbacks.samples=null logger=csv export=false
        task.module.scheduler.warmup_epochs=0 task.module.scheduler.cooldown_epochs=0)
for exp in "${exps[@]}"; do
  for data in ${ORDER:-synthetic folder}; do
    tag=${exp}_${data}
    if [ $data = synthetic ]; then src=(data=synthetic data.num_classes=100 data.train_samples=$((BATCHES * 128))
                                        trainer.max_epochs=1)
    else src=(data.root=$ROOT data.num_classes=100 data.pipeline=$PIPELINE data.num_workers=$WORKERS
              data.gpu.workers=${GPU_WORKERS:-6} data.gpu.launcher=${LAUNCHER:-main} trainer.max_epochs=$epochs); fi
    rm -rf /tmp/run_$tag
    timeout ${RUN_TIMEOUT:-540} python3 train.py experiment=$exp paths.output_dir=/tmp/run_$tag "${src[@]}" "${common[@]}" \
        "${extra[@]}" > "$OUT/$tag.log" 2>&1
    echo "$tag rc=$?"; grep -i "input-bound\|pipeline\|Error" "$OUT/$tag.log" | tail -3
    cp /tmp/run_$tag/csv/version_0/metrics.csv "$OUT/metrics_$tag.csv" 2>/dev/null
  done
done
python3 - "$OUT" "${exps[@]}" <<'PY'
import csv, statistics, sys
out, exps = sys.argv[1], sys.argv[2:]
print("| experiment | synthetic img/s | JPEG folder img/s | ratio |\n|---|---|---|---|")
for exp in exps:
    rates = {}
    for data in ("synthetic", "folder"):
        try:
            rows = list(csv.DictReader(open(f"{out}/metrics_{exp}_{data}.csv")))
        except FileNotFoundError:
            continue
        values = [float(r["train/device/samples_per_sec"]) for r in rows if r.get("train/device/samples_per_sec")]
        steady = values[len(values) // 2:]
        rates[data] = statistics.median(steady) if steady else float("nan")
        print(f"{exp} {data}: windows {[round(v) for v in values]}", file=sys.stderr)
    s, f = rates.get("synthetic", float("nan")), rates.get("folder", float("nan"))
    print(f"| {exp} | {s:,.0f} | {f:,.0f} | {f / s:.3f} |")
PY
workers=$([ "$PIPELINE" = gpu ] && echo "${GPU_WORKERS:-6}" || echo "$WORKERS")
timeout ${VAL_TIMEOUT:-240} python3 -m namodels.benchmark.input_pipeline "$ROOT" --splits val --pipelines "$PIPELINE" \
    --workers "$workers" --launchers "${LAUNCHER:-main}" --batches 16 --warmup 2 --out "$OUT" > "$OUT/validation.log" 2>&1
echo "validation loader alone rc=$?"; tail -4 "$OUT/validation.log"
