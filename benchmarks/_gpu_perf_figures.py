"""The GPU kit's figures at full depth, their checks, and the targets' verdicts: pure
Python on the pieces' records (no torch), so that tests feed it synthetic ones.

What the report may claim:

* A variant (kernel and AC mode of a shape) has a figure at full depth only from its
  OWN line through two measured layer counts or more. One layer count, a killed
  piece, an out-of-memory run, a skip: the variant reads "not measured" with the
  reason, and so does every target built on it. :func:`fit` never makes a line
  from one point.
* A variant is an error, not a figure, when a timed step's loss or gradient norm is
  not finite, when the timed steps' numbers were not recorded or ran on collective
  outputs the fake process group left undefined, when the step does not grow with
  the layers, or when its MFU or HFU exceeds 100 %.
* A target is MET or missed only from a figure, on a GPU run (not the tiny CPU
  smoke run) whose env.json exists; otherwise the verdict says why not.

FLOPs per trained token (stated in the report):

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

import math
import statistics
from dataclasses import dataclass

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
KILLED = (124, 137)  # timeout's exit status, and SIGKILL's


@dataclass(frozen=True)
class Line:
    """``y = intercept + slope x`` through measured points; ``max_residual`` None from two."""

    intercept: float
    slope: float
    max_residual: float | None

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit(xs: list[float], ys: list[float]) -> Line | None:
    """The least-squares line; None with fewer than two distinct ``xs`` (one point is no line)."""
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    icpt = my - slope * mx
    resid = max(abs(y - icpt - slope * x) for x, y in zip(xs, ys)) if len(set(xs)) > 2 else None
    return Line(icpt, slope, resid)


def flops(model: dict, seq: int, layers: int, cfg: dict) -> dict:
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


def piece_problem(piece: dict | None) -> str | None:
    """Why a piece left no (or a partial) result, from its pieces.jsonl entry; None if it finished."""
    if piece is None:
        return "the piece did not run (no entry in pieces.jsonl)"
    if piece.get("skipped"):
        return f"the piece was skipped: {piece['skipped']}"
    if piece.get("rc") in KILLED:
        return f"the piece was killed at its time limit ({piece.get('limit')} s)"
    if piece.get("rc"):
        return f"the piece exited {piece['rc']}"
    return None


def _layers(r: dict) -> int:
    return r["config"]["model"]["n_layers"]


def _measured(recs: list[dict]) -> list[dict]:
    return sorted((r for r in recs if "step_time" in r and "extrapolated" not in r and not r.get("oom")), key=_layers)


def _numbers_problem(measured: list[dict]) -> str | None:
    """Why the timed steps' numbers cannot be trusted, or None."""
    for r in measured:
        ts = r.get("timed_steps")
        if not ts or not ts.get("loss"):
            return f"no loss recorded for its timed steps at {_layers(r)} layers: their numbers cannot be checked"
        bad = [(x, g) for x, g in zip(ts["loss"], ts.get("grad_norm") or [math.nan] * len(ts["loss"]))
               if not (math.isfinite(x) and math.isfinite(g))]
        if bad:
            return (f"non-finite loss or gradient norm in a timed step at {_layers(r)} layers "
                    f"(loss {bad[0][0]}, gradient norm {bad[0][1]})")
        coll = r.get("collectives")
        if r.get("mode") == "simulate" and (not coll or coll.get("outputs") != "defined"):
            how = coll.get("outputs") if coll else "not recorded"
            return f"its timed steps at {_layers(r)} layers ran on collective outputs not defined ({how})"
        if coll and coll.get("unknown"):
            return f"collectives whose outputs were left undefined at {_layers(r)} layers: {coll['unknown']}"
    return None


def _not_measured(recs: list[dict], measured: list[dict], piece: dict | None) -> str:
    ooms = [r for r in recs if r.get("oom")]
    if ooms:
        return f"out of memory at {_layers(ooms[0])} layers"
    skipped = [r["skipped"] for r in recs if "skipped" in r]
    if skipped:
        return f"skipped: {skipped[0]}"
    why = piece_problem(piece)
    if measured:
        return (f"one layer count only ({_layers(measured[0])}); a line to full depth needs two"
                + (f": {why}" if why else ""))
    return why or "no record"


def variant_figures(recs: list[dict], piece: dict | None = None) -> dict:
    """One variant's status and, with two layer counts or more, its figures at full depth."""
    kit = recs[0]["kit"]
    n_full = kit["full_layers"]
    out = {"kernel": kit.get("kernel"), "ac": kit.get("ac"), "figures": None, "error": None, "not_measured": None}
    errors = [r["error"] for r in recs if "error" in r and not r.get("oom")]
    measured = _measured(recs)
    out["measured_layers"] = [_layers(r) for r in measured]
    out["measured_step_ms"] = [r["step_time"]["median_ms"] for r in measured]
    if errors:
        out["error"] = errors[0]
        return out
    problem = _numbers_problem(measured)
    if problem:
        out["error"] = problem
        return out
    ls = out["measured_layers"]
    step = fit(ls, out["measured_step_ms"])
    if step is None:
        out["not_measured"] = _not_measured(recs, measured, piece)
        return out
    if step.slope <= 0:
        out["error"] = (f"the step did not grow with the layers ({step.slope:.1f} ms per layer from {ls} layers): "
                        "the timing noise is larger than a layer")
        return out
    mem = fit(ls, [r["memory"]["peak_bytes"] for r in measured])
    reserved = fit(ls, [r["memory"]["max_reserved_bytes"] for r in measured]) \
        if all("max_reserved_bytes" in r["memory"] for r in measured) else None
    fsdp = fit(ls, [sum(r["fsdp"]["sent_bytes_per_rank"].values()) for r in measured])
    r1 = measured[0]
    cfg, model = r1["config"], r1["config"]["model"]
    a2a = r1["all_to_all"]["sent_bytes_per_rank"] * n_full / _layers(r1)  # the exchange's bytes are per layer
    fsdp_bytes = fsdp.at(n_full)
    tokens = cfg["tokens_per_rank"]
    fl = flops(model, cfg["seq"], n_full, cfg)
    peak_flops = r1.get("peak_flops")
    step_s = step.at(n_full) / 1e3

    def figs(seconds):
        return {"step_s": round(seconds, 3), "tokens_per_s_per_gpu": round(tokens / seconds, 1),
                "mfu": round(fl["model"] * tokens / seconds / peak_flops, 4) if peak_flops else None}

    v = {"line": {"layers": ls, "step_ms": out["measured_step_ms"], "intercept_ms": round(step.intercept, 3),
                  "ms_per_layer": round(step.slope, 3),
                  "max_residual_ms": None if step.max_residual is None else round(step.max_residual, 3)},
         "compute_only": figs(step_s),
         "hfu_compute": round(fl["hardware"] * tokens / step_s / peak_flops, 4) if peak_flops else None,
         "peak_gib": round(mem.at(n_full) / 2**30, 2), "mem_per_layer_gib": round(mem.slope / 2**30, 3),
         "reserved_gib": None if reserved is None else round(reserved.at(n_full) / 2**30, 2),
         "all_to_all_bytes": int(a2a), "fsdp_bytes": int(fsdp_bytes), "flops_per_token": fl}
    for bw in (NVLINK_GBPS, SLOW_GBPS):
        comm = (a2a + fsdp_bytes) / (bw * 1e9)
        v[f"modelled_{int(bw)}"] = {**figs(step_s + comm), "comm_s": round(comm, 3)}
    v["mfu_compute"] = v["compute_only"]["mfu"]
    over = [(k, x) for k, x in (("MFU", v["mfu_compute"]), ("HFU", v["hfu_compute"])) if x is not None and x > 1]
    if over:
        out["error"] = (f"{over[0][0]} {100 * over[0][1]:.1f} % at full depth is over 100 %: impossible, the "
                        f"measurement is wrong (line {step.intercept:.1f} ms + {step.slope:.1f} ms x layers)")
        return out
    if not all(math.isfinite(x) for x in (step_s, v["peak_gib"], v["compute_only"]["tokens_per_s_per_gpu"])):
        out["error"] = "a figure at full depth is not finite"
        return out
    out["figures"] = v
    return out


def shape_figures(records: list[dict], piece: dict | None = None) -> dict:
    """Every variant of one shape: figures, or why not; the plan's left-out backends."""
    plans = [r["plan"] for r in records if "plan" in r]
    plan = plans[0] if plans else {}
    kits = [r for r in records if "kit" in r]
    if not kits and not plan:
        return {"no_result": piece_problem(piece) or "no record", "variants": {}}
    groups: dict[str, list[dict]] = {}
    for name in plan.get("variants", []):
        groups[name] = []
    for r in kits:
        groups.setdefault(r["kit"]["variant"], []).append(r)
    first = kits[0]["kit"] if kits else {}
    out = {"title": plan.get("title") or first.get("title"), "full_layers": plan.get("full_layers") or
           first.get("full_layers"), "auto_is": plan.get("auto_is") or first.get("auto_is"),
           "tiny": plan.get("tiny", first.get("tiny")), "left_out": plan.get("left_out", {}),
           "layers_planned": plan.get("layers", {}), "piece_problem": piece_problem(piece), "variants": {}}
    for name, recs in groups.items():
        if recs:
            out["variants"][name] = variant_figures(recs, piece)
        else:
            out["variants"][name] = {"figures": None, "error": None, "measured_layers": [], "measured_step_ms": [],
                                     "not_measured": "not reached: " + (piece_problem(piece) or "no record")}
    out["carrier"] = next((n for n, v in out["variants"].items() if v["figures"]), None)
    return out


def verdict(value: float | None, target: dict, *, tiny: bool | None, env_ok: bool) -> str:
    """MET / missed only for a figure of a GPU run whose env.json exists."""
    if tiny or tiny is None:
        return "n/a (tiny CPU run)" if tiny else "n/a (no record says what ran)"
    if value is None:
        return "not measured: no peak FLOP/s known for this device (MFU needs one)"
    if not env_ok:
        return "error: env.json is missing (the env piece did not finish): the device and versions behind the " \
               "figure are unrecorded, no verdict"
    met = value <= target["value"] if target["op"] == "<=" else value >= target["value"]
    return "MET" if met else "missed"


def target_rows(shapes: dict, *, tiny: bool | None, env_ok: bool) -> list[dict]:
    """One row per target and variant of its shape: the figure and its verdict, or why none."""
    rows = []
    for key, t in TARGETS.items():
        mfu = t["key"] == "mfu_compute"
        goal = f"{t['op']} {100 * t['value']:.0f} %" if mfu else f"{t['op']} {t['value']:,.0f}"
        shape = shapes.get(key.split("_")[0]) or {}
        base = {"target": t["what"], "goal": goal, "peer": t["peer"]}
        if not shape.get("variants"):
            why = shape.get("no_result") or "no record"
            rows.append({**base, "variant": "-", "shown": "-", "verdict": f"not measured: {why}"})
            continue
        for name, v in shape["variants"].items():
            f = v["figures"]
            if f is None:
                kind = "error" if v["error"] else "not measured"
                rows.append({**base, "variant": name, "shown": "-", "verdict": f"{kind}: {v['error'] or v['not_measured']}"})
                continue
            value = f["mfu_compute"] if mfu else f[f"modelled_{int(NVLINK_GBPS)}"][t["key"]]
            shown = "-" if value is None else (f"{100 * value:.1f} %" if mfu else f"{value:,.1f}")
            rows.append({**base, "variant": name, "shown": shown, "value": value,
                         "verdict": verdict(value, t, tiny=tiny, env_ok=env_ok)})
    return rows
