"""The GPU kit's report: figures per shape, kernel and AC mode at full depth, the targets,
the region breakdown, the planner check, and a block for benchmarks/RESULTS.md.

Reads what the pieces of ``scripts/gpu_perf.sh`` left in OUT (no torch import, so it
runs even when every piece failed) and writes ``OUT/summary.json`` and
``OUT/RESULTS_block.md``; prints the block.

FLOPs per trained token (stated in the output):

* model FLOPs, for MFU (``Llama.flops_per_token``): ``6 N + 6 L H d S`` -- N the
  parameters without the embedding, L layers, H query heads of width d, S the
  sequence; the attention term is causal (half of ``12 L H d S``); no recompute;
* hardware FLOPs, for HFU: the model FLOPs plus what full activation
  checkpointing recomputes: each block's forward, ``2 P + 2 H d S`` per layer
  (P the block's matmul weights), without the attention term under
  ``save_attention``; the tiled MLP recomputes each tile once more (``2 x 3 D F``
  per layer, D the model width, F the MLP width); the tiled loss recomputes the
  output head (``2 D V``, V the vocabulary).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

NVLINK_GBPS = 400.0  # per GPU per direction, NVLink-class (H100 SXM NVLink4: 450 nominal; NCCL reaches less)
SLOW_GBPS = 300.0
TARGETS = {
    "qwen": {"what": "step time at 1M tokens on 8", "key": "step_s", "op": "<=", "value": 270.0,
             "peer": "TRL (torch ring CP 8, cuDNN, 8 x H100): 380 s/step"},
    "llama": {"what": "tokens/s per GPU at 256K on 8", "key": "tokens_per_s_per_gpu", "op": ">=", "value": 1400.0,
              "peer": "torchtitan (CP 8, 8 x H100): 548 tokens/s/GPU"},
    "llama_mfu": {"what": "MFU (compute only) at 32K per GPU", "key": "mfu_compute", "op": ">=", "value": 0.40,
                  "peer": "ours on the first H200 run: 23.6 %"},
}
PIECES = ("env", "plan", "shape_llama", "profile_llama", "shape_qwen", "plan_check")


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


def _fit(xs, ys):
    """(intercept, slope, max residual) of the least-squares line; slope 0 with one point."""
    if len(set(xs)) < 2:
        return ys[0], 0.0, None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    icpt = my - slope * mx
    return icpt, slope, max(abs(y - icpt - slope * x) for x, y in zip(xs, ys))


def _flops(model: dict, seq: int, layers: int, cfg: dict) -> dict:
    """Per-token FLOPs at ``layers`` (module docstring): model, and hardware with recompute."""
    D, H, KV, d, F, V = (model[k] for k in ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size"))
    block = D * H * d * 2 + D * KV * d * 2 + 3 * D * F  # q, o; k, v; w1, w2, w3
    attn_fwd = 2 * H * d * seq  # causal, per layer
    model_fpt = 6 * (layers * block + D * V) + 3 * layers * attn_fwd
    extra = 0
    if cfg.get("ac") == "full":
        extra += layers * (2 * block + (0 if cfg.get("save_attention") else attn_fwd))
        if cfg.get("tiled_mlp"):
            extra += layers * 2 * 3 * D * F
    if cfg.get("tiled_loss"):
        extra += 2 * D * V
    return {"model": model_fpt, "hardware": model_fpt + extra}


def _per_layer(recs: list[dict]) -> list[dict]:
    return sorted((r for r in recs if "step_time" in r and "extrapolated" not in r),
                  key=lambda r: r["config"]["model"]["n_layers"])


def shape_figures(records: list[dict]) -> dict:
    """Every variant of one shape at full depth (fitted or modelled from the auto fit)."""
    if not records:
        return {}
    kit0 = records[0]["kit"]
    n_full = kit0["full_layers"]
    groups: dict = {}
    for r in records:
        groups.setdefault((r["kit"]["kernel"], r["kit"]["ac"]), []).append(r)
    base = _per_layer(groups.get(("auto", "full"), []))
    fit = None
    if base:
        ls = [r["config"]["model"]["n_layers"] for r in base]
        step_fit = _fit(ls, [r["step_time"]["median_ms"] for r in base])
        mem_fit = _fit(ls, [r["memory"]["peak_bytes"] for r in base])
        fsdp_fit = _fit(ls, [sum(r["fsdp"]["sent_bytes_per_rank"].values()) for r in base])
        fit = {"layers": ls, "step_ms": [r["step_time"]["median_ms"] for r in base],
               "intercept_ms": round(step_fit[0], 3), "ms_per_layer": round(step_fit[1], 3),
               "max_residual_ms": None if step_fit[2] is None else round(step_fit[2], 3),
               "mem_per_layer_bytes": int(mem_fit[1]),
               "fsdp_bytes_at_full_depth": int(fsdp_fit[0] + fsdp_fit[1] * n_full)}
    out = {"title": kit0["title"], "full_layers": n_full, "auto_is": kit0.get("auto_is"), "fit": fit,
           "variants": {}, "skipped": {}, "errors": {}}
    for (kernel, ac), recs in groups.items():
        name = f"{kernel} / {'full AC' if ac == 'full' else 'save_attention'}"
        skipped = [r["skipped"] for r in recs if "skipped" in r]
        errors = [r["error"] for r in recs if "error" in r] + [r["error"] for r in recs if r.get("oom")]
        if skipped:
            out["skipped"][name] = skipped[0]
        if errors:
            out["errors"][name] = errors[0]
        measured = _per_layer(recs)
        if not measured or fit is None:  # nothing to scale to full depth without auto's fit
            continue
        r1 = measured[0]
        cfg, model = r1["config"], r1["config"]["model"]
        l1 = model["n_layers"]
        if (kernel, ac) == ("auto", "full"):
            step_ms = fit["intercept_ms"] + fit["ms_per_layer"] * n_full
            how = f"line through {fit['layers']} layers"
        else:  # the auto fit's intercept (embedding, head, optimizer) and this kernel's own layer cost
            own = (r1["step_time"]["median_ms"] - fit["intercept_ms"]) / l1
            step_ms = fit["intercept_ms"] + own * n_full
            how = f"{l1} layer(s) measured; per-layer cost from it, the rest from auto's fit"
        peak = r1["memory"]["peak_bytes"] + (n_full - l1) * fit["mem_per_layer_bytes"]
        a2a = r1["all_to_all"]["sent_bytes_per_rank"] * n_full / l1  # the exchange's bytes are per layer
        fsdp = fit["fsdp_bytes_at_full_depth"]
        tokens = cfg["tokens_per_rank"]
        fl = _flops(model, cfg["seq"], n_full, cfg)
        peak_flops = r1.get("peak_flops")
        step_s = step_ms / 1e3

        def figs(seconds):
            return {"step_s": round(seconds, 3), "tokens_per_s_per_gpu": round(tokens / seconds, 1),
                    "mfu": round(fl["model"] * tokens / seconds / peak_flops, 4) if peak_flops else None}

        v = {"how": how, "measured_layers": [r["config"]["model"]["n_layers"] for r in measured],
             "measured_step_ms": [r["step_time"]["median_ms"] for r in measured],
             "compute_only": figs(step_s),
             "hfu_compute": round(fl["hardware"] * tokens / step_s / peak_flops, 4) if peak_flops else None,
             "peak_gib": round(peak / 2**30, 2),
             "all_to_all_bytes": int(a2a), "fsdp_bytes": int(fsdp),
             "flops_per_token": fl}
        for bw in (NVLINK_GBPS, SLOW_GBPS):
            comm = (a2a + fsdp) / (bw * 1e9)
            v[f"modelled_{int(bw)}"] = {**figs(step_s + comm), "comm_s": round(comm, 3)}
        v["mfu_compute"] = v["compute_only"]["mfu"]
        out["variants"][name] = v
    return out


def _target_lines(shapes: dict, tiny: bool) -> list[str]:
    lines = ["| target | variant | measured | target | | peer |", "|---|---|---|---|---|---|"]
    for key, t in TARGETS.items():
        shape = shapes.get(key.split("_")[0], {})
        for name, v in shape.get("variants", {}).items():
            val = v["mfu_compute"] if t["key"] == "mfu_compute" else v[f"modelled_{int(NVLINK_GBPS)}"][t["key"]]
            if val is None:
                verdict, shown = "n/a", "n/a"
            else:
                met = val <= t["value"] if t["op"] == "<=" else val >= t["value"]
                verdict = "n/a (tiny CPU run)" if tiny else ("MET" if met else "missed")
                shown = f"{100 * val:.1f} %" if t["key"] == "mfu_compute" else f"{val:,.1f}"
            mfu = t["key"] == "mfu_compute"
            goal = f"{t['op']} {100 * t['value']:.0f} %" if mfu else f"{t['op']} {t['value']:,.0f}"
            lines.append(f"| {t['what']} | {name} | {shown} | {goal} | {verdict} | {t['peer']} |")
    return lines


def _shape_lines(s: dict) -> list[str]:
    lines = [f"### {s['title']}: one rank of 8 simulated (fake process group), {s['full_layers']} layers", ""]
    fit = s.get("fit")
    if fit:
        res = "n/a (two layer counts)" if fit["max_residual_ms"] is None or len(fit["layers"]) < 3 else \
            f"{fit['max_residual_ms']:.1f} ms"
        lines.append(f"Layer fit (auto, full AC): step = {fit['intercept_ms']:.1f} ms + {fit['ms_per_layer']:.1f} ms "
                     f"x layers, from {fit['layers']} layers ({', '.join(f'{t:.1f}' for t in fit['step_ms'])} ms); "
                     f"largest residual {res}. `auto` ran `{s['auto_is']}`.")
        lines.append("")
    lines += ["| kernel / AC | measured layers (ms) | step s (compute) | step s (400 / 300 GB/s) | "
              "tok/s/GPU (400 GB/s) | MFU compute | MFU 400 GB/s | HFU compute | peak GiB |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, v in sorted(s.get("variants", {}).items(), key=lambda kv: kv[1]["compute_only"]["step_s"]):
        m4, m3 = v[f"modelled_{int(NVLINK_GBPS)}"], v[f"modelled_{int(SLOW_GBPS)}"]
        pct = lambda x: "n/a" if x is None else f"{100 * x:.1f} %"  # noqa: E731
        meas = ", ".join(f"{n}: {t:.0f}" for n, t in zip(v["measured_layers"], v["measured_step_ms"]))
        lines.append(f"| {name} | {meas} | {v['compute_only']['step_s']:.2f} | {m4['step_s']:.2f} / "
                     f"{m3['step_s']:.2f} | {m4['tokens_per_s_per_gpu']:,.0f} | {pct(v['mfu_compute'])} | "
                     f"{pct(m4['mfu'])} | {pct(v['hfu_compute'])} | {v['peak_gib']:.1f} |")
    for kind in ("skipped", "errors"):
        for name, why in s.get(kind, {}).items():
            lines.append(f"\n{name}: {kind[:-1] if kind == 'errors' else 'skipped'}: {why}")
    lines.append("")
    return lines


def report(out: Path, budget_s: float | None = None) -> int:
    env = _read_json(out / "env.json") or {}
    tiny = bool(env.get("tiny", True))
    pieces = _read_lines(out / "pieces.jsonl")
    shapes = {name: shape_figures(_read_lines(out / f"shape_{name}.jsonl")) for name in ("llama", "qwen")}
    profiles = {name: _read_json(out / f"profile_{name}.json") for name in ("llama", "qwen")}
    plan, check = _read_json(out / "plan.json"), _read_json(out / "plan_check.json")
    summary = {"env": env, "pieces": pieces, "shapes": shapes,
               "profiles": {k: v["table"] for k, v in profiles.items() if v}, "plan": plan, "plan_check": check}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")

    L = [f"## {env.get('device', 'unknown device')}, GPU perf kit (`bash scripts/gpu_perf.sh`), "
         f"{env.get('date', '')}" + (" -- TINY CPU SMOKE RUN, not a measurement" if tiny else ""), ""]
    L.append(f"torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, Python "
             f"{env.get('python')}; packages {env.get('packages', {})}; {env.get('dtype')}. Kernels that ran a "
             f"forward + backward here: {', '.join(env.get('runs_here', [])) or 'none recorded'}; `auto` -> "
             f"`{env.get('auto')}`; our `sdpa` dispatches to `{env.get('sdpa_kernel')}`.")
    refused = {k: v.get("error") for k, v in env.get("kernels", {}).items() if not v.get("runs")}
    if refused:
        L.append("Did not run: " + "; ".join(f"`{k}`: {(why or '').rstrip('.')}" for k, why in refused.items()) + ".")
    if env.get("env", {}).get("TORCH_CUDNN_SDPA_DEPRIORITIZED") or env.get("env", {}).get("LD_LIBRARY_PATH_cudnn"):
        L.append(f"Note, cuDNN may be hidden from SDPA here: {env['env']}.")
    L += ["", "Commands: `bash scripts/gpu_perf.sh OUT` (pieces: `python benchmarks/gpu_perf.py PIECE --out OUT`); "
          "pieces, exit status and seconds: " + ", ".join(
              f"{p['piece']} {p['rc']} {p['seconds']} s" for p in pieces) + ".", ""]
    L.append(f"Modelled collectives: the all-to-all and FSDP bytes counted on the step, at {NVLINK_GBPS:.0f} GB/s "
             f"per GPU per direction (NVLink-class; H100 SXM NVLink4 is 450 nominal) and at {SLOW_GBPS:.0f} GB/s, "
             "added in full (no overlap). MFU: model FLOPs `6 N + 6 L H d S` per token (causal attention, no "
             "recompute) over the table peak (989 TFLOP/s bf16 dense for H100 / H200); HFU adds the recompute "
             "(`benchmarks/_gpu_perf_report.py`).")
    L.append("")
    for name in ("llama", "qwen"):
        if shapes[name]:
            L += _shape_lines(shapes[name])
        else:
            L += [f"### {name}: no result (see the pieces above)", ""]
    L += ["### Targets (issue 41), at full depth, collectives modelled at 400 GB/s", ""]
    L += _target_lines(shapes, tiny) + [""]
    for name, p in profiles.items():
        if p:
            L += [f"### Where a step goes: {p['title']}, {p['layers']} layers, auto, full AC "
                  f"(torch.profiler, one step after warm-up)", "", p["markdown"], ""]
            top = p["table"].get("unmapped_backward")
            if top:
                L += ["Backward nodes mapped to no forward region (ms): "
                      + ", ".join(f"{k} {v}" for k, v in top.items()), ""]
    if plan and check:
        gib = 2**30
        L += ["### Planner check: planned vs measured peak at the 1-GPU planned maximum", "",
              ("tiny 4-layer model on the CPU" if tiny else "4-layer Qwen3-8B-sized model (no q/k norms)")
              + f", full AC + tiled loss, one {'process' if tiny else 'GPU'}, attention `{check['attention']}`, "
              f"budget {plan['budget_gib']} GiB - {plan['headroom_gib']} GiB headroom: planned maximum "
              f"{plan['max_seq_len']:,} tokens (search {plan['seconds']} s, {len(plan['tried'])} plans). "
              f"Planned {plan['peak_bytes'] / gib:.2f} GiB, measured {check['measured_bytes'] / gib:.2f} GiB "
              f"({check['method']}): measured / planned = {check['ratio']:.3f}; one step {check['step_s']} s"
              + (f"; OUT OF MEMORY at the planned maximum: {check['oom']}" if check.get("oom") else "")
              + (f"; allocator reserved {check['reserved_bytes'] / gib:.2f} GiB" if check.get("reserved_bytes")
                 else "") + ".", ""]
    elif plan:
        L += [f"### Planner check: planned maximum {plan['max_seq_len']:,} tokens; no measured step", ""]
    block = "\n".join(L)
    (out / "RESULTS_block.md").write_text(block + "\n")
    print(block)
    return 0
