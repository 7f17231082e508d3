#!/usr/bin/env bash
# The GPU checks (bench/gpu_check.py: parity of ddp/zero1/zero2/zero3, no_sync + clipping, bf16, sw.save /
# sw.save_async / sw.load (a host-offloaded run's too), no host sync, one timed step, each against one process on
# the same device; at 2 or more ranks zero3's overlap: all-gathers beside compute seen in the profiler's kernel
# trace, 0 host syncs per step counted; then every engine path of issue 58 point 5 (bench/gpu_paths.py: streams
# and prefetch, device-form tags, hybrid, hpZ, compression, bf16, fp16 + scaler, norms, optimizer in backward,
# Muon, host offload on a "cpu:gloo,cuda:nccl" group, a pipeline stage, compile) under
# set_sync_debug_mode("error"), and ddp / zero3 / FSDP2 step times). `python bench/gpu_check.py --dry-run` lists
# them. Written on a CPU-only machine and never run on a GPU yet.
#   bench/gpu_check.sh     # GPU found by nvidia-smi: a fresh venv (.venv-gpu) with the CUDA build of the pinned
#                          # torch, then one rank per GPU (NCCL); no GPU: the CPU path (.venv, 2 ranks on gloo)
# CUDA_INDEX overrides the wheel index (default: cu130, cu128 or cu126, the newest the driver takes).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "$GPUS" -lt 1 ]; then
    PYTHON=${PYTHON:-.venv/bin/python}
    echo "no GPU found by nvidia-smi: the CPU path only (bench/gpu_check.py --device cpu, 2 ranks on gloo)"
    exec timeout 540 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 bench/gpu_check.py --device cpu
fi

# The pin is constraints.txt's (never an unpinned torch); the CUDA build comes from PyTorch's wheel index,
# in the form its install page gives (pip install torch==X --index-url https://download.pytorch.org/whl/cuXYZ).
PIN=$(grep -E '^torch==' constraints.txt)
if [ -z "${CUDA_INDEX:-}" ]; then
    DRIVER=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\)\.\([0-9]*\).*/\1\2/p' | head -1)
    TAG=cu126
    if [ "${DRIVER:-0}" -ge 130 ]; then TAG=cu130; elif [ "${DRIVER:-0}" -ge 128 ]; then TAG=cu128; fi
    CUDA_INDEX=https://download.pytorch.org/whl/$TAG
fi
VENV=${VENV:-.venv-gpu}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "$PIN" --index-url "$CUDA_INDEX"
"$VENV/bin/python" -m pip install -q -c constraints.txt -e .   # torch is already there, at the pin
"$VENV/bin/python" -c "import torch, sys; ok = torch.cuda.is_available() and torch.version.cuda
print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)'); sys.exit(0 if ok else 1)"

STATUS=0
timeout 540 "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" bench/gpu_check.py \
    --device cuda || STATUS=$?
if [ "$GPUS" -eq 1 ]; then
    # One GPU: ws 1 moved nothing between ranks. NCCL refuses two ranks on one device, so the multi-rank
    # pass runs gloo over CUDA tensors; gloo lacks some collectives for them: reported, not counted.
    echo "one GPU: 2 ranks on it over gloo (exploratory, not counted)"
    timeout 300 "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 bench/gpu_check.py \
        --device cuda --backend gloo || echo "2 ranks on one GPU over gloo: did not pass (not counted)"
fi
exit $STATUS
