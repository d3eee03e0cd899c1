# Sourced by run_train.sh / run_tests.sh: pick a Python that has torch.
# The active one is used when it already has torch; otherwise .venv is made
# and the pinned CPU-or-CUDA torch is installed FIRST, so that installing this
# package (torch>=2.11) does not pull a different build.
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if python3 -c "import torch" >/dev/null 2>&1; then
    PY="$(command -v python3)"
else
    if [ ! -x "$ROOT/.venv/bin/python" ]; then
        python3 -m venv "$ROOT/.venv"
    fi
    PY="$ROOT/.venv/bin/python"
    "$PY" -c "import torch" >/dev/null 2>&1 || "$PY" -m pip install -q "$TORCH_PIN"
fi
# Editable install without touching dependencies (torch is already there).
"$PY" -c "import ulysses_dtensor" >/dev/null 2>&1 || (cd "$ROOT" && "$PY" -m pip install -q --no-deps --no-build-isolation -e .)
"$PY" -c "import tomllib" >/dev/null 2>&1 || "$PY" -m pip install -q tomli
export PY ROOT
