# Sourced by run_train.sh / run_tests.sh: find or make a Python, install this
# package WITH its dependencies into it, and export PY (the interpreter) and ROOT.
#
# Which Python:
#   $PYTHON if set; else the active virtualenv ($VIRTUAL_ENV); else python3 when it
#   already has torch (e.g. a GPU machine's CUDA build); else ./.venv, created here.
# What is installed, in this order, only when missing:
#   1. torch: the pinned $TORCH_PIN (default torch==2.13.0) FIRST. Installing the
#      package first would let pip resolve torch>=2.11 to the newest CUDA build.
#   2. the package, editable, with its dependencies and the extras in $EXTRAS
#      (run_tests.sh: test). Skipped while pyproject.toml and the extras are those
#      of the last install into this interpreter (a stamp file beside it).
# Setup prints one line per step; pip's own output goes to $SETUP_LOG and is
# shown only when a step fails.
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-}"

_setup_step() {  # _setup_step "what" cmd...: run quietly, show the log on failure
    local what="$1"; shift
    local t0=$SECONDS
    printf 'setup: %s ... ' "$what" >&2
    if "$@" >>"$SETUP_LOG" 2>&1; then
        echo "done ($((SECONDS - t0)) s)" >&2
    else
        echo "FAILED; the last lines of $SETUP_LOG:" >&2
        tail -n 30 "$SETUP_LOG" >&2
        exit 1
    fi
}

_has_torch() {  # _has_torch PYTHON: torch is installed there (found, not imported: an import costs seconds)
    "$1" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' >/dev/null 2>&1
}

if [ -n "${PYTHON:-}" ]; then
    PY="$(command -v "$PYTHON")"
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PY="$VIRTUAL_ENV/bin/python"
elif command -v python3 >/dev/null 2>&1 && _has_torch python3; then
    PY="$(command -v python3)"
else
    PY="$ROOT/.venv/bin/python"
    if [ ! -x "$PY" ]; then
        SETUP_LOG="$ROOT/.venv-setup.log"
        : >"$SETUP_LOG"
        _setup_step "creating $ROOT/.venv" python3 -m venv "$ROOT/.venv"
    fi
fi
PREFIX="$("$PY" -c 'import sys; print(sys.prefix)')"
SETUP_LOG="${SETUP_LOG:-$PREFIX/ulysses-dtensor-setup.log}"
[ -w "$(dirname "$SETUP_LOG")" ] || SETUP_LOG="$(mktemp -t ulysses-dtensor-setup.XXXXXX)"

if ! _has_torch "$PY"; then
    _setup_step "installing $TORCH_PIN into $PREFIX" "$PY" -m pip install -q "$TORCH_PIN"
fi

# One line per install: "<cksum of pyproject.toml> <root> extras=<extras>". The
# base package is satisfied by any install of this pyproject (extras add to it).
stamp="$PREFIX/ulysses-dtensor-setup.stamp"
sum="$(cksum <"$ROOT/pyproject.toml" | cut -d' ' -f1)"
key="$sum $ROOT"
extras="${EXTRAS:+[$EXTRAS]}"
_stamped() {  # _stamped ROOT_OR_EMPTY: this pyproject installed (from that root, or any) with these extras
    awk -v s="$sum" -v r="$1" -v e="$EXTRAS" \
        '$1 == s && (r == "" || $2 == r) && (e == "" ? $3 ~ /^extras=/ : $3 == "extras=" e) { f = 1 } END { exit !f }' \
        "$stamp" 2>/dev/null
}
_imports_from_root() {  # the interpreter imports this package from ROOT already (PYTHONPATH)
    "$PY" -c 'import os, sys, ulysses_dtensor as u; sys.exit(os.path.dirname(os.path.dirname(os.path.abspath(u.__file__))) != sys.argv[1])' "$ROOT" >/dev/null 2>&1
}
# A checkout the interpreter already imports from, with this pyproject's dependencies
# installed (from another checkout), is used as it is: reinstalling would point a
# shared environment's editable install at it (a test that launches these scripts
# with PYTHONPATH set to its own checkout).
installed=0
if _stamped "$ROOT" || { _imports_from_root && _stamped ""; }; then
    installed=1
fi
if [ "$installed" = 0 ] || ! "$PY" -c "import ulysses_dtensor" >/dev/null 2>&1; then
    # torch is already there and satisfies torch>=2.11: pip keeps that build.
    _setup_step "installing ulysses-dtensor$extras and its dependencies into $PREFIX" \
        "$PY" -m pip install -q -e "$ROOT$extras"
    echo "$key extras=$EXTRAS" >>"$stamp" 2>/dev/null || true
fi
export PY ROOT
