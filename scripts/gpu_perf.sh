#!/usr/bin/env bash
# The one-call GPU kit: run it first whenever a GPU is lent (one H100 / H200, <= 7 minutes).
#
#   bash scripts/gpu_perf.sh OUT_DIR
#
# Pieces, each one process under its own time limit, each writing into OUT_DIR as it goes
# (a failed or killed piece never loses another's results):
#   env            versions, the allocator setting, the attention kernels that run here and the
#                  kernel each dispatches to (no compile: flex is left to the shapes), auto's pick
#   parity         (beside env) 1 GPU, real process group: cudnn + save_attention vs full AC equal,
#                  auto vs a float64 reference within bf16 tolerance, and a perturbed reference failing
#   plan           (in the background, CPU only, no GPU visible) the planner's 1-GPU maximum of a
#                  4-layer Qwen3-8B-sized model, for the GPU env.json names
#   shape_llama    Llama-3-8B, 32K tokens per GPU, one rank of 8 simulated: each variant (auto's kernel
#                  with full AC, then save_attention, varlen, other kernels, flex last) at two layer
#                  counts or more, its own line to full depth
#   profile_llama  one step of it cut into the library's regions (torch.profiler)
#   shape_qwen     Qwen3-8B-shaped, 128K tokens per GPU (1M on 8), likewise
#   plan_check     one real step at the planned maximum: planned vs measured peak, reserved vs allocated
#   disk           (before the shapes) the disk tier's write / fsync / read bandwidth through the
#                  offloader's own store, in OUT_DIR/pieces/disk_probe (GPU_PERF_DISK_DIR: elsewhere);
#                  the step with and without it: the shapes' host offload / disk tier variants
#   report         figures at full depth (none from one layer count), targets, the checks, the
#                  breakdown, OUT_DIR/RESULTS_block.md
# Everything ends up in OUT_DIR/gpu_perf.tar.gz (a lease brings back at most 8 files), beside
# the report (report.txt, RESULTS_block.md, summary.json), which is printed last. Without a GPU (no
# `nvidia-smi -L`, CUDA_VISIBLE_DEVICES empty, or GPU_PERF_TINY=1) every piece runs at tiny sizes on
# the CPU, side by side: the smoke run tests/test_gpu_perf.py makes.
#
# GPU_PERF_BUDGET_S (default 420) bounds the whole run; no piece runs into its last 60 s (the
# report and the packing). GPU_PERF_LIMITS overrides piece limits ("shape_qwen=120 plan=150").
# PYTORCH_CUDA_ALLOC_CONF is set to expandable_segments:True unless already set (env.json says which).
# A fla-core wheel carried in .whl/ (scripts/kernel_wheels.sh) is installed first. GPU_PERF_KEEP=1
# keeps the unpacked OUT_DIR/pieces. PYTHON picks the interpreter.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,34p "$0"; exit 2; }
top="$(mkdir -p "$1" && cd "$1" && pwd)"
out="$top/pieces"  # the pieces' files; packed and removed at the end (GPU_PERF_KEEP=1 keeps them)
rm -rf "$out" "$top/gpu_perf.tar.gz" && mkdir -p "$out"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
budget="${GPU_PERF_BUDGET_S:-420}"
reserve=60  # seconds of the budget no piece may use: the report and the packing
start=$SECONDS
# On the GPU the pieces run one after another (parity beside env, plan in the background):
# max(env, parity) + disk + shape_llama + profile_llama + shape_qwen + plan_check <= budget - reserve.
declare -A limit=([env]=30 [parity]=60 [plan]=200 [disk]=20 [shape_llama]=100 [profile_llama]=35 [shape_qwen]=115
                  [plan_check]=30)
# Long context needs the caching allocator's expandable segments (fragmentation turns a planned fit
# into an out-of-memory); the user's own setting wins. The pieces inherit it; env.json records it.
if [ -z "${PYTORCH_CUDA_ALLOC_CONF+x}" ]; then
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True GPU_PERF_ALLOC_CONF_BY="the kit"
else
    export GPU_PERF_ALLOC_CONF_BY="the user"
fi
# No GPU (or GPU_PERF_TINY=1): the CPU smoke run at tiny sizes, under generous limits.
tiny=0
if [ "${GPU_PERF_TINY:-0}" = 1 ] || [ "${CUDA_VISIBLE_DEVICES-x}" = "" ] \
        || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
    tiny=1 budget="${GPU_PERF_BUDGET_S:-1200}"
    for k in "${!limit[@]}"; do limit[$k]=300; done
fi
for kv in ${GPU_PERF_LIMITS:-}; do limit[${kv%%=*}]=${kv#*=}; done
# The kit's own settings, first (the report quotes them; a lease that dies here still says them).
json_str() { local v=${1//\\/\\\\}; printf '"%s"' "${v//\"/\\\"}"; }
{
    printf '{"budget_s": %s, "reserve_s": %s, "tiny": %s, "limits": {' "$budget" "$reserve" "$([ "$tiny" = 1 ] && echo true || echo false)"
    sep=""; for k in env parity plan disk shape_llama profile_llama shape_qwen plan_check; do
        printf '%s"%s": %s' "$sep" "$k" "${limit[$k]}"; sep=", "; done
    printf '}, "PYTORCH_CUDA_ALLOC_CONF": %s, "alloc_conf_set_by": %s}\n' \
        "$(json_str "$PYTORCH_CUDA_ALLOC_CONF")" "$(json_str "$GPU_PERF_ALLOC_CONF_BY")"
} >"$out/kit.json"
# On exit, whatever happened: a lease brings back at most 8 files, so OUT_DIR keeps four:
# the tarball of every piece's output and log, the report, its RESULTS.md block and summary.
finish() {
    tar czf "$top/gpu_perf.tar.gz" -C "$top" pieces
    for f in RESULTS_block.md summary.json report.txt; do [ -f "$out/$f" ] && cp "$out/$f" "$top/"; done
    [ "${GPU_PERF_KEEP:-0}" = 1 ] || rm -rf "$out"
}
trap finish EXIT

# The hybrid mixers' GPU kernels: fla-core's wheel carried in .whl/ (scripts/kernel_wheels.sh;
# name .whl in the device run's carry), installed where fla does not import already.
PYTHON="$py" source "$repo/scripts/kernel_wheels.sh" 2>>"$out/wheels.log"

# run NAME LIMIT CMD...: CMD under min(LIMIT, what is left of the budget), logged, status recorded.
run() {
    local name=$1 lim=$2; shift 2
    local left=$((budget - (SECONDS - start) - reserve))
    [ "$lim" -le "$left" ] || lim=$left
    if [ "$lim" -lt 5 ]; then
        echo "{\"piece\": \"$name\", \"rc\": null, \"seconds\": 0, \"limit\": 0, \"skipped\": \"no time left\"}" >>"$out/pieces.jsonl"
        echo "gpu_perf: $name skipped: no time left" >&2; return
    fi
    echo "gpu_perf: $name (limit ${lim} s) ..." >&2
    local t0=$SECONDS
    GPU_PERF_PIECE_LIMIT=$lim timeout -k 5 "$lim" "$@" >"$out/$name.log" 2>&1; local rc=$?
    echo "{\"piece\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit\": $lim}" >>"$out/pieces.jsonl"
    echo "gpu_perf: $name exit $rc in $((SECONDS - t0)) s" >&2
}
kit=("$py" benchmarks/gpu_perf.py)
[ "$tiny" = 0 ] || kit+=(--tiny)

# parity beside env: neither times anything that matters, and both are done before the timed pieces.
( run parity "${limit[parity]}" "${kit[@]}" parity --out "$out" ) &
parity_pid=$!
run env "${limit[env]}" "${kit[@]}" env --out "$out"
budget_gib=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1])).get('memory_gib') or 80)" "$out/env.json" 2>/dev/null || echo 80)
# The planner only computes on the CPU: it runs beside the GPU pieces and sees no GPU (no CUDA
# context beside them); the GPU it plans for comes from env.json.
( export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4; run plan "${limit[plan]}" "${kit[@]}" plan --out "$out" --budget-gib "$budget_gib" ) &
plan_pid=$!
export GPU_PERF_DISK_DIR="${GPU_PERF_DISK_DIR:-$out/disk_probe}"
disk() { run disk "${limit[disk]}" "${kit[@]}" disk --out "$out"; }
shape_llama() { run shape_llama "${limit[shape_llama]}" "${kit[@]}" shape --shape llama --out "$out"; }
profile_llama() { run profile_llama "${limit[profile_llama]}" "${kit[@]}" profile --shape llama --out "$out"; }
shape_qwen() { run shape_qwen "${limit[shape_qwen]}" "${kit[@]}" shape --shape qwen --out "$out"; }
if [ "$tiny" = 1 ]; then  # the CPU smoke run times nothing that matters: side by side
    pids=()
    for piece in disk shape_llama profile_llama shape_qwen; do $piece & pids+=($!); done
    wait "${pids[@]}" "$parity_pid"
else                      # on the GPU one at a time, so that no piece's timing disturbs another's
    wait "$parity_pid"
    disk; shape_llama; profile_llama; shape_qwen
fi
wait "$plan_pid" 2>/dev/null  # the planner's limit bounds this wait
run plan_check "${limit[plan_check]}" "${kit[@]}" plan_check --out "$out"
"$py" benchmarks/gpu_perf.py report --out "$out" 2>"$out/report.log" | tee "$out/report.txt"
echo "gpu_perf: done in $((SECONDS - start)) s; everything in $top/gpu_perf.tar.gz" >&2
