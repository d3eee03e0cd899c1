#!/usr/bin/env bash
# Set up (if needed) and run the test suite; extra args go to pytest.
#
#   bash scripts/run_tests.sh                      # everything (CPU; GPU tests skip without CUDA)
#   bash scripts/run_tests.sh tests/test_data.py   # one file
#
# Setup (scripts/_python_env.sh): the active Python or ./.venv, pinned torch first,
# then this package with the `test` extra (pytest, transformers, tokenizers, ...).
set -euo pipefail
EXTRAS="${EXTRAS:-test}"
source "$(dirname "${BASH_SOURCE[0]}")/_python_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m pytest -q -p no:cacheprovider --durations=15 "$@"
