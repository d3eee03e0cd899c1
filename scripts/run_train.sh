#!/usr/bin/env bash
# The main job: train with torchrun on every GPU of this machine, or on 4 CPU
# ranks (gloo) when there is none.
#
#   bash scripts/run_train.sh                                  # debug model, CPU or GPU
#   bash scripts/run_train.sh --training.steps 50              # extra args pass through
#   bash scripts/run_train.sh --config train_configs/llama3_8b_128k.toml
#
# Setup (scripts/_python_env.sh): the active Python or ./.venv, pinned torch
# first (TORCH_PIN, default torch==2.13.0), then this package with its
# dependencies. Environment: PYTHON (interpreter), NPROC (ranks),
# PYTORCH_CUDA_ALLOC_CONF (default expandable_segments:True), MAX_RESTARTS
# (0): how often torchrun restarts the ranks after one fails; each restart resumes
# from the newest complete checkpoint (the trainer keys its process group's start
# on the attempt, see ulysses_dtensor/runtime/restarts.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python_env.sh"
cd "$ROOT"
py="$PY"

# Count GPUs through torch only where a GPU device node is present: importing torch
# costs a CPU-only machine 3 s of the launch. CUDA shows /dev/nvidia<N> (WSL2: /dev/dxg),
# ROCm /dev/kfd; with none of them torch sees no GPU either.
if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [ -e /dev/dxg ] || [ -e /dev/kfd ]; then
    gpus="$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
else
    gpus=0
fi
if [ -n "${NPROC:-}" ]; then
    nproc="$NPROC"
elif [ "$gpus" -gt 0 ]; then
    nproc="$gpus"
else
    nproc=4
fi

config=()
case " $* " in
    *" --config "*|*" --config="*) ;;
    *) config=(--config train_configs/debug_model.toml) ;;
esac

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The CUDA allocator for long context: expandable segments, unless you set
# PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF (even empty); the run's banner says which
# is in effect (ulysses_dtensor/runtime/allocator.py).
if [ -z "${PYTORCH_CUDA_ALLOC_CONF+set}" ] && [ -z "${PYTORCH_ALLOC_CONF+set}" ]; then
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ULYSSES_DTENSOR_ALLOC_DEFAULT=1
fi
echo "run_train.sh: $nproc ranks ($([ "$gpus" -gt 0 ] && echo "$gpus GPUs" || echo "CPU, gloo"))" >&2
exec "$py" -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
    --max_restarts="${MAX_RESTARTS:-0}" \
    -m ulysses_dtensor.train "${config[@]}" "$@"
