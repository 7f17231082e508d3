#!/usr/bin/env bash
# The GPU checks of issue 21, for a machine with CUDA (not run on the CPU-only machine where it was
# written): parity of ddp/zero1/zero2/zero3 with one process on CUDA at one rank per GPU (NCCL), and
# one step of each zero strategy under torch.cuda.set_sync_debug_mode("error"). Under 10 minutes.
#   bench/gpu_check.sh            # uses .venv (make setup) and every visible GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
    echo "no CUDA device visible: nothing to check" >&2
    exit 2
fi
timeout 540 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" bench/gpu_check.py
