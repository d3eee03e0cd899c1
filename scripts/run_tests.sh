#!/usr/bin/env bash
# Set up (if needed) and run the test suite; extra args go to pytest.
#
#   bash scripts/run_tests.sh                      # everything (CPU; GPU tests skip without CUDA)
#   bash scripts/run_tests.sh tests/test_data.py   # one file
#   bash scripts/run_tests.sh -m quick             # the quick tier (tests/quick_tier.py)
#   TEST_WORKERS=0 bash scripts/run_tests.sh ...   # one pytest process (e.g. with -s or pdb)
#
# Setup (scripts/_python_env.sh): the active Python or ./.venv, pinned torch first,
# then this package with the `test` extra (pytest, transformers, tokenizers, ...).
set -euo pipefail
EXTRAS="${EXTRAS:-test}"
source "$(dirname "${BASH_SOURCE[0]}")/_python_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# About 40 fresh interpreters (pytest workers, forkservers, torchrun ranks, the
# scripts under test) import this package and the tests: with bytecode writing
# off (PYTHONDONTWRITEBYTECODE, set on some machines) each compiles them again,
# pytest's assertion rewriting included (2 s per worker). __pycache__ is ignored by git.
unset PYTHONDONTWRITEBYTECODE
# Two pytest workers (pytest-xdist), each taking whole files (a file's module
# fixtures run once): most tests wait on their ranks' collectives or on launched
# processes, and a second worker fills the idle core (10 min -> 7 on 2 cores).
WORKERS="${TEST_WORKERS:-2}"
args=(-q -p no:cacheprovider --durations=15)
if [ "$WORKERS" != 0 ]; then
    args+=(-n "$WORKERS" --dist loadfile)
fi
exec "$PY" -m pytest "${args[@]}" "$@"
