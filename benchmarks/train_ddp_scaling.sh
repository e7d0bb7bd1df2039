#!/bin/bash
# DDP scaling of a real training run: NAT-Mini training throughput through train.py (synthetic 224x224 tensors, bf16,
# the ImageNet recipe) on 1 GPU and on 2 GPUs, and their ratio.  Needs a machine with 2 GPUs.
# Usage (repo root, after `pip install -e .`): [BACKEND=fused|gemm|...] bash benchmarks/train_ddp_scaling.sh [batches per process]
set -uo pipefail
# NVLink multicast (NVLS) off: some hosts cannot use it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BATCHES=${1:-100}
nvidia-smi -L
python3 -c "import torch, triton, timm, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__, 'lightning', lightning.__version__)"
for n in 1 2; do
  rm -rf /tmp/run$n
  timeout 280 python3 train.py experiment=nat_mini_synthetic trainer.devices=$n paths.root_dir=/tmp/run$n \
      trainer.limit_train_batches=$BATCHES model.backend=${BACKEND:-null} > "$OUT/ddp$n.log" 2>&1
  echo "devices=$n rc=$?"; tail -4 "$OUT/ddp$n.log"
  cp /tmp/run$n/logs/classification/*/csv/version_0/metrics.csv "$OUT/metrics_$n.csv" 2>/dev/null
done
python3 - "$OUT" <<'PY'
import csv, statistics, sys
out = sys.argv[1]
rates = {}
for n in (1, 2):
    try:
        rows = list(csv.DictReader(open(f"{out}/metrics_{n}.csv")))
    except FileNotFoundError:
        continue
    # all processes: train/samples_per_sec (logged only when world size > 1), else the one device's
    key = "train/samples_per_sec" if n > 1 else "train/device/samples_per_sec"
    values = [float(r[key]) for r in rows if r.get(key)]
    # each value is measured over the last 20 batches; skip the first windows (Triton compile/autotune)
    steady = values[len(values) // 2:]
    rates[n] = statistics.median(steady) if steady else float("nan")
    print(f"devices={n}: samples/s windows {[round(v) for v in values]} -> median of last half {rates[n]:.0f}")
if 1 in rates and 2 in rates:
    print(f"scaling 2 GPUs / 1 GPU = {rates[2] / rates[1]:.3f}")
PY
