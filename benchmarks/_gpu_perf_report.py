"""The GPU kit's report: what ran, figures per shape and variant at full depth, the
targets, the 1-GPU check, the region breakdown, the planner check; a block for
benchmarks/RESULTS.md.

Reads what the pieces of ``scripts/gpu_perf.sh`` left in OUT (no torch import, so it
runs even when every piece failed) and writes ``OUT/summary.json`` and
``OUT/RESULTS_block.md``; prints the block. The figures, their checks and the
verdicts are ``_gpu_perf_figures.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

from _gpu_perf_figures import NVLINK_GBPS, SLOW_GBPS, piece_problem, shape_figures, target_rows

PIECES = ("env", "parity", "plan", "disk", "shape_llama", "profile_llama", "shape_qwen", "plan_check")
GIB = 2**30


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_lines(path: Path) -> list[dict]:
    out = []
    try:
        for line in path.read_text().splitlines():
            if line.strip().startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _env_lines(env: dict, pieces: dict, records: list[dict]) -> list[str]:
    if not env:
        rec = next((r for r in records if "device" in r), {})
        return [f"**env.json is missing** ({piece_problem(pieces.get('env')) or 'not written'}): no verdict "
                f"below. The shape records say: device {rec.get('device', 'unknown')}, torch "
                f"{rec.get('torch', 'unknown')}."]
    lines = [f"torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, Python "
             f"{env.get('python')}; packages {env.get('packages', {})}; {env.get('dtype')}. `auto` -> "
             f"`{env.get('auto')}`; kernels that ran a forward + backward here: "
             f"{', '.join(env.get('runs_here', [])) or 'none recorded'}."]
    kernels = env.get("kernels", {})
    dispatch = {k: v["dispatch"] for k, v in kernels.items() if v.get("dispatch")}
    if dispatch:
        lines.append("Dispatched to: " + "; ".join(f"`{k}` {', '.join(d)}" for k, d in dispatch.items()) + ".")
    refused = {k: v.get("error") for k, v in kernels.items() if v.get("runs") is False}
    if refused:
        lines.append("Did not run: " + "; ".join(f"`{k}`: {(why or '').rstrip('.')}" for k, why in refused.items())
                     + ".")
    untried = {k: v.get("not_tried") for k, v in kernels.items() if v.get("runs") is None}
    if untried:
        lines.append("Not tried here: " + "; ".join(f"`{k}`: {why}" for k, why in untried.items()) + ".")
    if not env.get("complete"):
        lines.append(f"env.json is partial ({piece_problem(pieces.get('env')) or 'the piece stopped early'}).")
    if env.get("env", {}).get("TORCH_CUDNN_SDPA_DEPRIORITIZED") or env.get("env", {}).get("LD_LIBRARY_PATH_cudnn"):
        lines.append(f"Note, cuDNN may be hidden from SDPA here: {env['env']}.")
    return lines


def _kit_lines(kit: dict, env: dict) -> list[str]:
    """The kit's settings (kit.json, written before any piece) and the allocator's."""
    alloc = env.get("allocator") or {"PYTORCH_CUDA_ALLOC_CONF": kit.get("PYTORCH_CUDA_ALLOC_CONF"),
                                      "set_by": kit.get("alloc_conf_set_by")}
    lines = [f"Allocator: PYTORCH_CUDA_ALLOC_CONF={alloc.get('PYTORCH_CUDA_ALLOC_CONF')!s} "
             f"(set by {alloc.get('set_by') or 'unknown'})."]
    if kit:
        lines.append(f"Kit: budget {kit['budget_s']} s, the last {kit['reserve_s']} s kept for the report and the "
                     f"packing; piece limits (s) " + ", ".join(f"{k} {v}" for k, v in kit["limits"].items()) + ".")
    return lines


def _shape_lines(name: str, s: dict) -> list[str]:
    if not s.get("variants"):
        return [f"### {name}: no result ({s.get('no_result')})", ""]
    lines = [f"### {s['title']}: one rank of 8 simulated (fake process group), {s['full_layers']} layers", ""]
    lines.append("Each variant's figures at full depth come from its own line through its measured layer counts "
                 "(step = intercept + ms per layer x layers); a variant measured at fewer than two has none.")
    names = list(s["variants"])
    carrier = s.get("carrier")
    if carrier is None:
        lines.append("**No variant gave a figure at this shape.**")
    elif carrier != names[0]:
        first = s["variants"][names[0]]
        lines.append(f"**`{names[0]}` gave no figure ({first['error'] or first['not_measured']}); this shape's "
                     f"figures come from `{carrier}`.**")
    for backend, why in s.get("left_out", {}).items():
        lines.append(f"- `{backend}` left out: {why}")
    lines += ["", "| variant | measured layers (ms) | line | step s (compute) | step s (400 / 300 GB/s) | "
              "tok/s/GPU (400 GB/s) | MFU compute | MFU 400 GB/s | HFU compute | peak GiB (reserved) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for vname, v in s["variants"].items():
        f = v["figures"]
        meas = ", ".join(f"{n}: {t:.0f}" for n, t in zip(v["measured_layers"], v["measured_step_ms"])) or "-"
        if f is None:
            kind = "error" if v["error"] else "not measured"
            lines.append(f"| {vname} | {meas} | {kind}: {v['error'] or v['not_measured']} | | | | | | | |")
            continue
        line, m4, m3 = f["line"], f[f"modelled_{int(NVLINK_GBPS)}"], f[f"modelled_{int(SLOW_GBPS)}"]
        res = "" if line["max_residual_ms"] is None else f", residual {line['max_residual_ms']:.1f}"
        reserved = "" if f["reserved_gib"] is None else f" ({f['reserved_gib']:.1f})"
        lines.append(f"| {vname} | {meas} | {line['intercept_ms']:.1f} + {line['ms_per_layer']:.1f} x L{res} | "
                     f"{f['compute_only']['step_s']:.2f} | {m4['step_s']:.2f} / {m3['step_s']:.2f} | "
                     f"{m4['tokens_per_s_per_gpu']:,.0f} | {_pct(f['mfu_compute'])} | {_pct(m4['mfu'])} | "
                     f"{_pct(f['hfu_compute'])} | {f['peak_gib']:.1f}{reserved} |")
    lines.append("")
    lines += _fp8_speedup_lines(s)
    lines += _disk_step_lines(s)
    if any(v["figures"] for v in s["variants"].values()):
        lines += ["Every timed step of the variants with figures had a finite loss and gradient norm, on collective "
                  "outputs given defined values (`benchmarks/_simulated_collectives.py`).", ""]
    return lines


def _fp8_speedup_lines(s: dict) -> list[str]:
    """FP8 against bf16 on the same kernel and AC: the ratio of their full-depth compute-only steps,
    each from its own line through two layer counts (no figure, no ratio)."""
    variants = s["variants"]
    base = next((n for n in variants if n.endswith(" / full AC") and n.startswith("auto")), None)
    out = []
    for name, v in variants.items():
        if "FP8" not in name:
            continue
        b = variants.get(base) if base else None
        if not (v["figures"] and b and b["figures"]):
            out.append(f"FP8: `{name}` against `{base}`: not measured (each needs a figure from two layer counts)")
            continue
        ratio = b["figures"]["compute_only"]["step_s"] / v["figures"]["compute_only"]["step_s"]
        out.append(f"FP8: `{name}` runs a full-depth step {ratio:.2f}x as fast as `{base}` (bf16), compute only")
    return out + ([""] if out else [])


def _disk_step_lines(s: dict) -> list[str]:
    """The disk tier against host offload, same kernel and shape: the ratio of their full-depth
    compute-only steps, each from its own line (no figure, no ratio)."""
    variants = s["variants"]
    disk = next((n for n in variants if n.endswith("/ disk tier")), None)
    host = next((n for n in variants if n.endswith("/ host offload")), None)
    if disk is None or host is None:
        return []
    d, h = variants[disk]["figures"], variants[host]["figures"]
    if not (d and h):
        return [f"Disk tier: `{disk}` against `{host}`: not measured (each needs a figure from two layer counts)", ""]
    ratio = d["compute_only"]["step_s"] / h["compute_only"]["step_s"]
    return [f"Disk tier: a full-depth step of `{disk}` takes {ratio:.2f}x the time of `{host}` (the offloaded layer "
            f"inputs in a file instead of host memory), compute only; peak {d['peak_gib']:.1f} against "
            f"{h['peak_gib']:.1f} GiB", ""]


def _disk_lines(disk: dict | None, piece: dict | None) -> list[str]:
    head = "### The disk tier's bandwidth (`python benchmarks/bench_disk_tier.py`, the offloader's own store)"
    if not disk:
        return [head, "", f"No result: {piece_problem(piece) or 'disk.json missing'}.", ""]
    gib = disk["bytes"] / 2**30
    return [head, "", f"{gib:.2f} GiB in {disk['layers']} layers of {disk['layer_bytes'] / 2**20:.0f} MiB from "
                      f"{disk['device']} through a {disk['staging_bytes'] / 2**20:.0f} MiB staging area, in "
                      f"`{disk['directory']}` ({disk['filesystem']}, {disk['free_bytes'] / 2**30:.0f} GiB free):",
            "",
            "| write (page cache) | write + fsync (disk) | read (cache dropped) | read back equal |",
            "|---|---|---|---|",
            f"| {disk['write_gbps']:.2f} GB/s | {disk['write_sync_gbps']:.2f} GB/s | {disk['read_gbps']:.2f} GB/s | "
            f"{'yes' if disk['read_back_equal'] else 'NO'} |", ""]


def _target_lines(shapes: dict, tiny, env_ok: bool) -> list[str]:
    lines = ["| target | variant | measured | target | verdict | peer |", "|---|---|---|---|---|---|"]
    for r in target_rows(shapes, tiny=tiny, env_ok=env_ok):
        lines.append(f"| {r['target']} | {r['variant']} | {r['shown']} | {r['goal']} | {r['verdict']} | {r['peer']} |")
    return lines


def _parity_lines(parity: dict | None, piece: dict | None) -> list[str]:
    head = "### 1-GPU check: kernels against references (real process group, world 1)"
    if not parity:
        return [head, "", f"No result: {piece_problem(piece) or 'parity.json missing'}.", ""]
    m = parity["model"]
    lines = [head, "", f"{parity['process_group']} on {parity['device']}; Llama ({m['flavor']} {m['overrides']}), "
                       f"{m['seq']} tokens, {m['dtype']}, FSDP2 + full AC; one forward + backward each "
                       f"({parity['seconds']} s in all).", ""]
    for name, c in [*parity["checks"].items(), ("perturbed float64 reference", parity["perturbed_reference"])]:
        words = {"save_attention_equals_full_ac": f"`{parity['kernel']}` + save_attention vs `{parity['kernel']}` "
                                                  "+ full AC (equal)",
                 "auto_matches_float64": f"`auto` (`{parity['auto_is']}`) vs float64 SDPA math"}.get(name, name)
        if "failed_as_it_must" in c:
            verdict = "failed, as it must" if c["failed_as_it_must"] else "PASSED: the comparison cannot tell, FAILED"
            words += f" ({c['perturbation']})"
        else:
            verdict = "passed" if c["passed"] else "FAILED"
        tol = c["tolerance"]
        lines.append(f"- {words}: loss {c['loss_rel']:.2e}, gradients {c['grad_rel']:.2e}, worst parameter "
                     f"`{c['worst_param']}` {c['worst_param_rel']:.2e} (relative; tolerance {tol['loss']:.0e} / "
                     f"{tol['grad']:.0e} / {tol['worst']:.0e}): {verdict}.")
    rr = parity["run_to_run"]
    lines += [f"- full AC run twice: gradients differ by {rr['grad_rel']:.2e} (the kernel's run-to-run noise).", ""]
    return lines


def _plan_lines(plan: dict | None, check: dict | None, tiny) -> list[str]:
    if not plan:
        return []
    if not check:
        return [f"### Planner check: planned maximum {plan['max_seq_len']:,} tokens; no measured step", ""]
    L = ["### Planner check: planned vs measured peak at the 1-GPU planned maximum", "",
         ("tiny 4-layer model on the CPU" if tiny else "4-layer Qwen3-8B-sized model (no q/k norms)")
         + f", full AC + tiled loss, one {'process' if tiny else 'GPU'}, attention `{check['attention']}`, "
         f"budget {plan['budget_gib']} GiB - {plan['headroom_gib']} GiB headroom: planned maximum "
         f"{plan['max_seq_len']:,} tokens (planned for {plan.get('target')}, from {plan.get('target_from')}; "
         f"search {plan['seconds']} s, {len(plan['tried'])} plans, CUDA context in the planner: "
         f"{plan.get('cuda_initialized')}). Planned {plan['peak_bytes'] / GIB:.2f} GiB, measured "
         f"{check['measured_bytes'] / GIB:.2f} GiB ({check['method']}): measured / planned = {check['ratio']:.3f}; "
         f"one step {check['step_s']} s"
         + (f"; OUT OF MEMORY at the planned maximum: {check['oom']}" if check.get("oom") else "") + "."]
    gap = check.get("reserved_minus_allocated_bytes")
    if gap is None:
        L.append("Reserved vs allocated: not measured here (no caching allocator on the CPU).")
    else:
        covered = "covers it" if check["headroom_covers_gap"] else "does NOT cover it"
        L.append(f"Allocator ({check.get('alloc_conf') or 'defaults'}): reserved {check['reserved_bytes'] / GIB:.2f} "
                 f"GiB at the peak, {gap / GIB:.2f} GiB beyond what was allocated; the planner's headroom of "
                 f"{check['headroom_bytes'] / GIB:.2f} GiB {covered}.")
    return L + [""]


def _section(make, *args) -> list[str]:
    """One section's lines; a section that cannot be written says why instead of stopping the
    report (the report is the one piece that must always come back)."""
    try:
        return make(*args)
    except Exception as e:  # noqa: BLE001
        return [f"(this section could not be written: {type(e).__name__}: {e})", ""]


def _shape(records: list[dict], piece: dict | None) -> dict:
    try:
        return shape_figures(records, piece)
    except Exception as e:  # noqa: BLE001 -- malformed records: say so, write the rest
        return {"no_result": f"its records could not be read ({type(e).__name__}: {e})", "variants": {}}


def report(out: Path) -> int:
    env = _read_json(out / "env.json") or {}
    kit = _read_json(out / "kit.json") or {}
    pieces = {p["piece"]: p for p in _read_lines(out / "pieces.jsonl")}
    records = {name: _read_lines(out / f"shape_{name}.jsonl") for name in ("llama", "qwen")}
    shapes = {name: _shape(recs, pieces.get(f"shape_{name}")) for name, recs in records.items()}
    # What ran: the shape records say, else the kit's settings (written before any piece); never
    # a default (a killed env piece must not turn a GPU run into a CPU one).
    tinies = [s["tiny"] for s in shapes.values() if s.get("tiny") is not None]
    tiny = any(tinies) if tinies else kit.get("tiny", env.get("tiny"))
    profiles = {name: _read_json(out / f"profile_{name}.json") for name in ("llama", "qwen")}
    plan, check = _read_json(out / "plan.json"), _read_json(out / "plan_check.json")
    parity, disk = _read_json(out / "parity.json"), _read_json(out / "disk.json")
    summary = {"kit": kit, "env": env, "tiny": tiny, "pieces": list(pieces.values()), "shapes": shapes,
               "targets": target_rows(shapes, tiny=tiny, env_ok=bool(env)), "parity": parity,
               "profiles": {k: v["table"] for k, v in profiles.items() if v}, "plan": plan, "plan_check": check,
               "disk": disk}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")

    device = env.get("device") or next((r["device"] for recs in records.values() for r in recs if "device" in r),
                                       "unknown device")
    what = " -- TINY CPU SMOKE RUN, not a measurement" if tiny else (
        " -- nothing recorded what ran" if tiny is None else "")
    date = env.get("date") or next((r["date"] for recs in records.values() for r in recs if "date" in r), "")
    L = [f"## {device}, GPU perf kit (`bash scripts/gpu_perf.sh`), {date}{what}", ""]
    L += _section(_env_lines, env, pieces, [r for recs in records.values() for r in recs])
    L += _section(_kit_lines, kit, env)
    L += ["", "Commands: `bash scripts/gpu_perf.sh OUT` (pieces: `python benchmarks/gpu_perf.py PIECE --out OUT`); "
          "pieces, exit status and seconds: " + ", ".join(
              f"{p['piece']} {p['rc']} {p['seconds']} s" for p in pieces.values())
          + ".", ""]
    L.append(f"Modelled collectives: the all-to-all and FSDP bytes counted on the step, at {NVLINK_GBPS:.0f} GB/s "
             f"per GPU per direction (NVLink-class; H100 SXM NVLink4 is 450 nominal) and at {SLOW_GBPS:.0f} GB/s, "
             "added in full (no overlap). MFU: model FLOPs `6 N + 6 L H d S` per token (causal attention, no "
             "recompute) over the table peak (989 TFLOP/s bf16 dense for H100 / H200); HFU adds the recompute "
             "(`benchmarks/_gpu_perf_figures.py`).")
    L.append("")
    for name in ("llama", "qwen"):
        L += _section(_shape_lines, name, shapes[name])
    L += ["### Targets (issue 41), at full depth, collectives modelled at 400 GB/s", ""]
    L += _section(_target_lines, shapes, tiny, bool(env)) + [""]
    L += _section(_parity_lines, parity, pieces.get("parity"))
    for name, p in profiles.items():
        if p:
            L += [f"### Where a step goes: {p['title']}, {p['layers']} layers, auto, full AC "
                  f"(torch.profiler, one step after warm-up)", "", p["markdown"], ""]
            top = p["table"].get("unmapped_backward")
            if top:
                L += ["Backward nodes mapped to no forward region (ms): "
                      + ", ".join(f"{k} {v}" for k, v in top.items()), ""]
    L += _section(_plan_lines, plan, check, tiny)
    L += _section(_disk_lines, disk, pieces.get("disk"))
    block = "\n".join(L)
    (out / "RESULTS_block.md").write_text(block + "\n")
    print(block)
    return 0
