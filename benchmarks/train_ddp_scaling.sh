#!/bin/bash
# DDP scaling of real training runs: train.py with the in1k recipe (as it compiles, bf16) on random ImageNet-sized
# tensors, for each model on each GPU count, and the per-GPU efficiency against the one-GPU run of the same model.
# Usage (repo root, after `pip install -e .`, on a machine with as many GPUs as the largest count):
#   [GPUS="1 2 4"] [MODELS="nat_tiny dinat_tiny swin_tiny_patch4_window7_224"] [BATCHES=200] [RUN_TIMEOUT=540] \
#       bash benchmarks/train_ddp_scaling.sh [-- extra train.py overrides, e.g. model.compile=false]
# A model name of ours runs as `model.name=<name>` of the NAT recipe; any other name runs through `model=timm`.
# Samples/s: the ThroughputMonitor's all-process rate (train/samples_per_sec; the one device's on one GPU), median
# of the second half of the run's windows (the first half holds compilation and autotuning).  The table goes to
# $OUT/scaling.md in the layout of docs/performance.md.
set -uo pipefail
# NVLink multicast (NVLS) off: some hosts cannot use it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GPUS=${GPUS:-"1 2 4"}; MODELS=${MODELS:-"nat_tiny dinat_tiny swin_tiny_patch4_window7_224"}; BATCHES=${BATCHES:-200}
extra=()
[ "${1:-}" = "--" ] && { shift; extra=("$@"); }
available=$(nvidia-smi -L | wc -l)
nvidia-smi -L
python3 -c "import torch, triton, timm, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__, 'lightning', lightning.__version__)"
for model in $MODELS; do
  if [[ $model == nat_* || $model == dinat_* ]]; then
    pick=(model.name=$model)
  else
    pick=(model=timm model.name=$model model.compile=reduce-overhead)
  fi
  for n in $GPUS; do
    if [ "$n" -gt "$available" ]; then echo "$model x$n: skipped, $available GPUs here"; continue; fi
    tag=${model}_x$n; rm -rf /tmp/scaling_$tag
    timeout ${RUN_TIMEOUT:-540} python3 train.py experiment=nat_mini_synthetic "${pick[@]}" trainer=ddp trainer.devices=$n \
        paths.output_dir=/tmp/scaling_$tag trainer.limit_train_batches=$BATCHES \
        data.train_samples=$((BATCHES * 128 * n)) "${extra[@]}" > "$OUT/$tag.log" 2>&1
    echo "$tag rc=$?"; grep -i "error\|warn" "$OUT/$tag.log" | sort | uniq -c | sort -rn | head -3
    cp /tmp/scaling_$tag/csv/version_0/metrics.csv "$OUT/metrics_$tag.csv" 2>/dev/null
  done
done
python3 - "$OUT" "$MODELS" "$GPUS" <<'PY' | tee "$OUT/scaling.md"
import csv, statistics, sys
out, models, gpus = sys.argv[1], sys.argv[2].split(), [int(n) for n in sys.argv[3].split()]


def rate(model, n):
    try:
        rows = list(csv.DictReader(open(f"{out}/metrics_{model}_x{n}.csv")))
    except FileNotFoundError:
        return None
    key = "train/samples_per_sec" if n > 1 else "train/device/samples_per_sec"
    values = [float(r[key]) for r in rows if r.get(key)]
    print(f"{model} x{n}: windows {[round(v) for v in values]}", file=sys.stderr)
    steady = values[len(values) // 2:]
    return statistics.median(steady) if steady else None


print("| model | " + " | ".join(f"{n} GPU{'s' if n > 1 else ''} img/s (per-GPU efficiency)" for n in gpus) + " |")
print("|---|" + "---|" * len(gpus))
for model in models:
    rates = {n: rate(model, n) for n in gpus}
    one = rates.get(1)
    cells = []
    for n in gpus:
        r = rates[n]
        if r is None:
            cells.append("not run")
        elif one:
            cells.append(f"{r:,.0f} ({r / (n * one):.1%})")
        else:
            cells.append(f"{r:,.0f}")
    print(f"| {model} | " + " | ".join(cells) + " |")
PY
