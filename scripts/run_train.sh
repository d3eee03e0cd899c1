#!/usr/bin/env bash
# The main job: train with torchrun on every GPU of this machine, or on 4 CPU
# ranks (gloo) when there is none.
#
#   bash scripts/run_train.sh                                  # debug model, CPU or GPU
#   bash scripts/run_train.sh --training.steps 50              # extra args pass through
#   bash scripts/run_train.sh --config train_configs/llama3_8b_128k.toml
#
# Python: the active `python` if it has torch; otherwise a .venv is created with
# torch==2.13.0 (installed first, so pip does not pick another build) and this
# package installed editable. Environment: PYTHON (interpreter), NPROC (ranks),
# TORCH_SPEC (default torch==2.13.0).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

py="${PYTHON:-python}"
if ! command -v "$py" >/dev/null 2>&1 || ! "$py" -c "import torch" >/dev/null 2>&1; then
    if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
        echo "run_train.sh: no python with torch; creating .venv" >&2
        python3 -m venv .venv
        .venv/bin/python -m pip install --upgrade pip
        .venv/bin/python -m pip install "${TORCH_SPEC:-torch==2.13.0}"
        .venv/bin/python -m pip install -e .
    fi
    py="$repo/.venv/bin/python"
fi
"$py" -c "import ulysses_dtensor" >/dev/null 2>&1 || "$py" -m pip install -e . >&2

gpus="$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
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
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
echo "run_train.sh: $nproc ranks ($([ "$gpus" -gt 0 ] && echo "$gpus GPUs" || echo "CPU, gloo"))" >&2
exec "$py" -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
    -m ulysses_dtensor.train "${config[@]}" "$@"
