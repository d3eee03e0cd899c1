#!/usr/bin/env bash
# scripts/gpu_check.sh fitted to a short GPU lease (15 device-minutes, one
# command of at most 10): the correctness pieces run side by side (they take no
# timings), then the timing pieces one at a time, and everything lands in one
# tarball, $OUT/gpu.tar.gz (a lease brings back at most 8 files).
#
#   bash scripts/gpu_check_lease.sh OUT_DIR                    # tests | matrices, then smoke attn
#   bash scripts/gpu_check_lease.sh OUT_DIR train_8b_32k_eager # other timing pieces
#
# CORRECT_LIMIT_S (default 300) bounds each correctness piece, TIMING_LIMIT_S
# (default 150) each timing piece; GPU_TESTS_ARGS (default: 150 s per test when
# pytest-timeout is there) goes to pytest. The last lines printed sum it up.
# Seen on an H200 (torch 2.11, 2026-11-26), side by side: tests ~250 s (93 of 96
# in 170 s, then the compile test ~60 s), matrix 88 s, ring_documents 15 s, flex
# 3.5-18.5 s a row (30 bf16 rows ~200 s); smoke 23 s; attn's sdpa rows ~60 s.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,13p "$0"; exit 2; }
out="$(mkdir -p "$1" && cd "$1" && pwd)"; shift
timing=("$@")
[ ${#timing[@]} -gt 0 ] || timing=(smoke attn)
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="${PYTHON:-python3}"
export PYTHON="$py" PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# The hybrid mixers' GPU kernels: fla-core's carried wheel (scripts/kernel_wheels.sh), where fla does not import.
source "$repo/scripts/kernel_wheels.sh"
mkdir -p "$out/a" "$out/b" "$out/f" "$out/c"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c "import torch, sys; print(sys.version); print('torch', torch.__version__, torch.version.cuda)"
  "$py" -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|flash.attn|pytest-timeout) "
} >"$out/c/env.txt" 2>&1
cat "$out/c/env.txt"
trap '(cd "$out" && tar czf gpu.tar.gz a b f c && rm -rf a b f c)' EXIT

if [ -z "${GPU_TESTS_ARGS+x}" ] && "$py" -c "import pytest_timeout" 2>/dev/null; then
    export GPU_TESTS_ARGS="--timeout 150"
fi
export GPU_CHECK_LIMIT_S="${CORRECT_LIMIT_S:-300}"
bash scripts/gpu_check.sh "$out/a" tests 2>"$out/a/driver.log" &
bash scripts/gpu_check.sh "$out/b" matrix ring_documents 2>"$out/b/driver.log" &
bash scripts/gpu_check.sh "$out/f" matrix_flex 2>"$out/f/driver.log" &  # compiles: CPU-bound
wait
export GPU_CHECK_LIMIT_S="${TIMING_LIMIT_S:-150}"
bash scripts/gpu_check.sh "$out/c" "${timing[@]}" 2>"$out/c/driver.log"

"$py" - "$out" <<'PY'
import json, sys
for lane in "abfc":
    try:
        summary = json.load(open(f"{sys.argv[1]}/{lane}/gpu_check.json"))
    except (OSError, ValueError) as e:
        print(lane, "no summary:", e)
        continue
    for name, v in summary.items():
        print(f"{name:24s} exit {v['exit']:3d} {v['seconds']:4d} s rows {v['rows']}")
try:
    tests = json.load(open(f"{sys.argv[1]}/a/gpu_tests.json"))
    print("tests", tests.get("counts", tests))
    for case in tests.get("cases", []):
        if case["state"] in ("failure", "error"):
            print("  FAILED", case["test"])
except (OSError, ValueError) as e:
    print("tests: no result:", e)
PY
