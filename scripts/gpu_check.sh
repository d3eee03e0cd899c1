#!/usr/bin/env bash
# Validate on a machine with a GPU what only a GPU can show: the `gpu`-marked
# tests (attention backends, compile on CUDA, ...), every attention backend x
# pattern x head dim x dtype and the ring with packed documents against a float64
# reference (what ran, row by row), the local attention backends side by side, and
# the training-step benchmarks recorded in benchmarks/RESULTS.md.
#
#   bash scripts/gpu_check.sh OUT_DIR                 # every piece, in order
#   bash scripts/gpu_check.sh OUT_DIR tests attn      # some pieces
#   bash scripts/gpu_check.sh --list                  # the pieces and what they run
#
# Each piece runs under a 10-minute limit (GPU_CHECK_LIMIT_S) and writes its JSON
# into OUT_DIR (<piece>.jsonl, or gpu_tests.json); OUT_DIR/gpu_check.json sums up
# every piece (exit status, seconds, file, rows per status). Uses the active Python (PYTHON to
# override); run scripts/run_tests.sh once first if it lacks this package.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="${PYTHON:-python}"
limit="${GPU_CHECK_LIMIT_S:-600}"
bench_8b="--mode simulate --device cuda --flavor llama3_8b --world 8 --sp 8 --ac full --tiled-loss --tiled-mlp"

# name|command (OUT is the output folder). Commands mirror benchmarks/RESULTS.md.
PIECES=(
  "tests|$py -m pytest -m gpu -v --durations=15 -p no:cacheprovider -rs --continue-on-collection-errors \${GPU_TESTS_ARGS:-} --junitxml=\$OUT/gpu_tests.xml tests"
  "matrix|$py scripts/gpu_attention_matrix.py local --backends sdpa varlen flash_attn cudnn fa4 auto"
  "matrix_flex|$py scripts/gpu_attention_matrix.py local --backends flex --dtypes bfloat16"
  "matrix_flex_fp32|$py scripts/gpu_attention_matrix.py local --backends flex --dtypes float32"
  "ring_documents|$py scripts/gpu_attention_matrix.py ring"
  "smoke|$py benchmarks/bench_train.py --quick --mode simulate --device cuda && $py benchmarks/bench_train.py --quick --mode real --sp 1 --device cuda"
  "attn|for b in sdpa cudnn flex varlen flash_attn fa4 auto; do $py benchmarks/bench_attention.py --device cuda --sp 1 --seq 8192 32768 131072 --heads 32 --kv-heads 8 --head-dim 128 --backend \$b --deepspeed off --warmup 2 --iters 5; done"
  "train_8b_32k_eager|$py benchmarks/bench_train.py $bench_8b --local-seq 32K --warmup 1 --iters 3"
  "train_8b_32k_compile|$py benchmarks/bench_train.py $bench_8b --local-seq 32K --compile --warmup 2 --iters 3"
  "train_8b_128k_eager|$py benchmarks/bench_train.py $bench_8b --local-seq 128K --layers 2 4 --extrapolate-layers 32 --warmup 1 --iters 2"
  "train_8b_128k_compile|$py benchmarks/bench_train.py $bench_8b --local-seq 128K --layers 2 4 --extrapolate-layers 32 --compile --warmup 2 --iters 2"
)

if [ "${1:-}" = "--list" ] || [ $# -lt 1 ]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR [piece ...]; pieces (each <= ${limit} s):"
    for p in "${PIECES[@]}"; do printf '  %-22s %s\n' "${p%%|*}" "${p#*|}"; done
    [ "${1:-}" = "--list" ]; exit $?
fi
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
export OUT OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $py; nothing to check" >&2
    exit 2
fi
"$py" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)" >&2

wanted=("$@")
summary="$OUT/gpu_check.json"
echo "{" >"$summary.tmp"
first=1
for p in "${PIECES[@]}"; do
    name="${p%%|*}"; cmd="${p#*|}"
    if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " =~ " $name " ]]; then continue; fi
    out="$OUT/$name.jsonl"; [ "$name" = tests ] && out="$OUT/gpu_tests.json"
    echo "gpu_check: $name (limit ${limit} s) ..." >&2
    start=$SECONDS
    if [ "$name" = tests ]; then
        timeout "$limit" bash -c "$cmd" >"$OUT/gpu_tests.log" 2>&1; rc=$?
        "$py" - "$OUT/gpu_tests.xml" "$out" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    json.dump({"error": str(e)}, open(sys.argv[2], "w")); sys.exit(0)
cases = []
for c in root.iter("testcase"):
    state = "passed"
    for tag in ("failure", "error", "skipped"):
        if c.find(tag) is not None:
            state = tag
    cases.append({"test": f"{c.get('classname')}::{c.get('name')}", "state": state, "seconds": float(c.get("time", 0))})
counts = {s: sum(x["state"] == s for x in cases) for s in ("passed", "failure", "error", "skipped")}
json.dump({"counts": counts, "cases": cases}, open(sys.argv[2], "w"), indent=1)
EOF
    else
        timeout "$limit" bash -c "$cmd" >"$out" 2>"$OUT/$name.log"; rc=$?
    fi
    secs=$((SECONDS - start))
    # JSON-line pieces: how many rows of each status (matrix rows: passed / refused / failed).
    rows=null
    [ "$name" = tests ] || rows=$("$py" - "$out" <<'EOF'
import collections, json, sys
counts = collections.Counter()
try:
    for line in open(sys.argv[1]):
        try:
            counts[json.loads(line).get("status", "record")] += 1
        except (ValueError, AttributeError):
            counts["not_json"] += 1
except OSError:
    pass
print(json.dumps(dict(counts)))
EOF
)
    echo "gpu_check: $name exit $rc in ${secs} s -> $out $rows" >&2
    [ $first = 1 ] || echo "," >>"$summary.tmp"
    first=0
    printf '  "%s": {"exit": %d, "seconds": %d, "file": "%s", "timed_out": %s, "rows": %s}' \
        "$name" "$rc" "$secs" "$(basename "$out")" "$([ $rc = 124 ] && echo true || echo false)" "$rows" >>"$summary.tmp"
done
printf '\n}\n' >>"$summary.tmp"
mv "$summary.tmp" "$summary"
echo "gpu_check: summary in $summary" >&2
