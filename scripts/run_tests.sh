#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python_env.sh"
"$PY" -c "import pytest" >/dev/null 2>&1 || "$PY" -m pip install -q pytest
cd "$ROOT"
exec "$PY" -m pytest -q "$@"
