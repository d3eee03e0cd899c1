"""PLANNED longest trainable sequence per GPU count and memory feature (no GPU needed).

Every figure comes from :mod:`ulysses_dtensor.estimate`: one training step of
this trainer (build_model, AdamW, train_step) traced on rank 0 of a fake
world with fake tensors; the peak is allocated-tensor bytes, i.e. what
``torch.cuda.max_memory_allocated`` would report on the GPU, plus the
FlashAttention-2 backward workspace the trace cannot see (added from the
traced attention shapes). A length "fits" when that peak is at most
``--budget-gib - --headroom-gib`` (default 80 - 6 = 74 GiB): the headroom
stands for what is not a tensor -- the H100's 80 GB are 79.2 GiB to torch,
then the CUDA context, NCCL buffers and caching-allocator fragmentation.

    python benchmarks/max_seq_len.py                      # the full table (~30 min on 2 cores)
    python benchmarks/max_seq_len.py --models llama3_8b --gpus 8 --features baseline all   # ~1 min a row
    python benchmarks/max_seq_len.py --quick              # smoke run: debug model on 2 GPUs, seconds
    python benchmarks/max_seq_len.py --models llama3_8b --gpus 64 128 --ulysses 8 --features all+offload_params
                                                          # USP: Ulysses inside 8-GPU nodes, ring across them
    python benchmarks/max_seq_len.py --sweep qwen3_8b 1 --lengths 65536 --features all --lora 16
                                                          # LoRA adapters of rank 16 (transformers configs)
    python benchmarks/max_seq_len.py --models llama3_8b --gpus 8 --features all+offload_params --disk-gib 3500
                                                          # the disk tier: offloaded layer inputs on a local disk

One JSON object per (model, GPUs, features) on stdout; a markdown table on
stderr at the end (and in --table FILE); a PNG of planned peak vs sequence
length (--plot FILE, needs matplotlib; without it a message says so).

The search is :func:`ulysses_dtensor.estimate.find_max_seq_len`'s: every point a
step traced with each loop over the sequence at its edge pieces, extrapolated in
the block count, the limit solved for from the points (two to four per row), the
answer within --precision (default 0.5 %) of the limit; a second ceiling for host
memory (--host-budget-gib per GPU, default 240; 0: none), a third with the disk tier
(--disk-gib per GPU: the rows that offload layer inputs plan them on a local disk,
memory.offload_dir, the host then holding a staging area and the parameter state), and
the record names the one that binds.

Layout: sp = the largest divisor of the GPU count that the heads allow
(heads % sp == 0, and kv heads split or replicated: kv % sp == 0 or
sp % kv == 0), the rest dp_shard; one sequence per data-parallel rank; bf16
compute with fp32 FSDP2 master weights, fp32 gradient reduction and fp32
AdamW states (the trainer's long-context configs); full activation
checkpointing in every row (the baseline).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ulysses_dtensor.estimate import GIB, find_max_seq_len, plan_memory  # noqa: E402
from ulysses_dtensor.estimate.disk import DISK_GBPS  # noqa: E402
from ulysses_dtensor.estimate.search import HOST_BUDGET_GIB, PRECISION  # noqa: E402
from ulysses_dtensor.models.llama import FLAVORS  # noqa: E402
from ulysses_dtensor.trainer.config import load_config  # noqa: E402

FEATURES = {
    "baseline": {},
    "tiled_loss": {"tiled_loss": True},
    "tiled_mlp": {"tiled_mlp": True},
    "offload": {"offload_activations": True},
    "all": {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True},
    # Parameter shards, gradients and AdamW state in host memory (FSDP2 CPU offload).
    "offload_params": {"offload_params": True},
    "all+offload_params": {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True,
                           "offload_params": True},
}
# ALST (arXiv 2506.13996), Llama-3-8B on H100 80GB, max trainable sequence length.
ALST = {"llama3_8b": {1: 500_000, 8: 3_700_000, 32: 15_000_000}}
VOCAB = 128256
# Transformers models, planned from their config.json alone (model.implementation =
# "transformers"): the Hub configs of these checkpoints, shipped in benchmarks/model_configs/.
HF_CONFIGS = ROOT / "benchmarks" / "model_configs"
HF_MODELS = sorted(p.name for p in HF_CONFIGS.iterdir() if (p / "config.json").is_file()) if HF_CONFIGS.is_dir() else []


def heads(model: str) -> tuple[int, int]:
    """(query heads, kv heads as the exchange places them) of a flavor or a shipped HF config."""
    if model in FLAVORS:
        a = FLAVORS[model]
        return a.n_heads, a.n_kv_heads
    from transformers import AutoConfig

    from ulysses_dtensor.integrations.hf.causal_lm import causal_lm_shape

    shape = causal_lm_shape(AutoConfig.from_pretrained(HF_CONFIGS / model))
    return shape.n_heads, shape.n_kv_heads


def layout(flavor: str, gpus: int, ulysses: int = 0, tp: int = 1) -> tuple[int, int, int]:
    """(sp, dp_shard, ring) on ``gpus`` GPUs, ``tp`` of them splitting each block's weights.

    Ulysses only (``ulysses=0``): the largest sp the heads of a tp rank allow, ring 1.
    USP (``ulysses=N``): every GPU in sp (x tp), Ulysses over N, ring = gpus / (N x tp).
    """
    n_heads, n_kv = heads(flavor)
    if gpus % tp or n_heads % tp or n_kv % tp:
        raise SystemExit(f"--tp {tp} must divide the GPU count {gpus}, the heads {n_heads} and kv heads {n_kv}")
    gpus, n_heads, n_kv = gpus // tp, n_heads // tp, n_kv // tp
    if ulysses:
        if gpus % ulysses:
            raise SystemExit(f"--ulysses {ulysses} must divide the GPU count / tp, {gpus}")
        return gpus, 1, gpus // ulysses
    best = 1
    for sp in range(1, gpus + 1):
        if gpus % sp or n_heads % sp:
            continue
        if n_kv % sp == 0 or sp % n_kv == 0:
            best = sp
    return best, gpus // best, 1


def label(features: str, lora: int = 0, float8: str = "") -> str:
    """The feature set's name in records and tables (``all+lora16`` with LoRA adapters,
    ``all+fp8_rowwise`` with FP8 linear layers)."""
    return features + (f"+lora{lora}" if lora else "") + (f"+fp8_{float8}" if float8 else "")


# memory.offload_dir of the disk-tier rows: a path only (the planner never touches it).
OFFLOAD_DIR = "/local/nvme/offload"


def make_config(flavor: str, gpus: int, features: str, quick: bool = False, ulysses: int = 0, mlp_tiles: int = 0,
                tp: int = 1, lora: int = 0, head_chunks: int = 0, disk: bool = False,
                implementation: str = "transformers", float8: str = ""):
    sp, dp_shard, ring = layout(flavor, gpus, ulysses, tp)
    if flavor in HF_MODELS:
        model = ["--model.hf_path", str(HF_CONFIGS / flavor), "--model.implementation", implementation]
    else:
        model = ["--model.flavor", flavor] + ([] if quick else ["--model.vocab_size", str(VOCAB)])
    argv = [
        *model,
        "--model.attn_backend", "auto",  # planned as the kernel auto runs on the target GPU (--gpu of estimate)
        "--training.mixed_precision_param", "bfloat16",
        "--training.mixed_precision_reduce", "float32",
        "--training.global_batch_size", str(dp_shard),
        "--activation_checkpoint.mode", "full",
        "--parallelism.sp", str(sp),
        "--parallelism.dp_shard", str(dp_shard),
        "--parallelism.ring", str(ring),
        "--parallelism.tp", str(tp),
    ]
    feats = FEATURES[features]
    if quick:
        # A dim-64 model would get hundreds of automatic tiles: keep the smoke run quick.
        argv += ["--memory.mlp_tiles", "4"] if feats.get("tiled_mlp") else []
        argv += ["--memory.loss_chunks", "4"] if feats.get("tiled_loss") else []
    if mlp_tiles and feats.get("tiled_mlp"):
        argv += ["--memory.mlp_tiles", str(mlp_tiles)]
    if head_chunks:  # 0: the trainer's automatic count, which the planner traces
        argv += ["--memory.head_chunks", str(head_chunks)]
    for key, value in feats.items():
        argv += [f"--memory.{key}", "true" if value is True else str(value)]
    if disk and feats.get("offload_activations"):
        argv += ["--memory.offload_dir", OFFLOAD_DIR]
    if lora:  # adapters on every projection, the base frozen in bf16 (needs an HF config: model.hf_path)
        argv += ["--lora.rank", str(lora), "--lora.alpha", str(2 * lora)]
    if float8:  # torchao FP8 linear layers as on an H100 (not emulated); FP8 all-gathers with tensorwise
        argv += ["--float8.enable", "true", "--float8.recipe_name", float8]
        argv += ["--float8.enable_fsdp_float8_all_gather", "true"] if float8 == "tensorwise" else []
    return load_config(argv), sp, dp_shard, ring


def fmt_tokens(n: int) -> str:
    if n <= 0:
        return "0"
    if n >= 1_000_000:
        return f"{n / 1_000_000:.2f}M"
    return f"{n / 1000:.0f}K"


def stamp() -> dict:
    return {
        "planned_for": "GPU, 80 GB class (H100); traced on CPU with fake tensors",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def run_one(flavor, gpus, features, ns, log) -> dict:
    disk = bool(ns.disk_gib)
    cfg, sp, dp_shard, ring = make_config(flavor, gpus, features, ns.quick, ns.ulysses, ns.mlp_tiles, ns.tp,
                                          ns.lora, ns.head_chunks, disk, ns.implementation, ns.float8)
    features = label(features, ns.lora, ns.float8)
    usp = f" = ring {ring} x ulysses {sp // ring}" if ring > 1 else ""
    tp = f" x tp {ns.tp}" if ns.tp > 1 else ""
    log(f"{flavor} on {gpus} GPU(s) (sp {sp}{usp} x dp_shard {dp_shard}{tp}), {features}:")
    cpu = time.process_time()
    res = find_max_seq_len(
        cfg, gpus, budget_gib=ns.budget_gib, headroom_gib=ns.headroom_gib,
        host_budget_gib=ns.host_budget_gib or None, precision=ns.precision / 100,
        granularity=ns.granularity, rows=1, device="cuda", layers=ns.layers, loops=ns.loops,
        guess=tuple(ns.guess) if ns.guess else None,
        confirm=ns.confirm is not None and (not ns.confirm or features in ns.confirm),
        log=log, disk_budget_gib=ns.disk_gib or None, disk_gbps=ns.disk_gbps,
    )
    cpu = time.process_time() - cpu
    best, nxt = res.best, res.next_up
    rec = {
        "bench": "max_seq_len",
        **stamp(),
        "model": flavor,
        "gpus": gpus,
        "sp": sp,
        "dp_shard": dp_shard,
        "ring": ring,
        "ulysses": sp // ring,
        "tp": ns.tp,
        "features": features,
        "implementation": ns.implementation if flavor in HF_MODELS else None,
        "mlp_tiles": ns.mlp_tiles or "auto",
        "head_chunks": ns.head_chunks or "auto",
        "budget_gib": ns.budget_gib,
        "headroom_gib": ns.headroom_gib,
        "host_budget_gib": res.host_budget_gib,
        "disk_tier": res.disk_tier,
        "disk_budget_gib": res.disk_budget_gib,
        "planned_max_seq_len": res.max_seq_len,
        "precision": round(res.precision, 5),
        "limit_below": res.limit_below,
        "limit_planned": res.limit_planned,
        "binding": res.binding,
        "search_unit": res.unit,
        "boundary_full_trace": res.confirmed,
        "seconds": round(res.seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "traces": res.traces,
        "alst": ALST.get(flavor, {}).get(gpus),
        "tried": res.plans,
        "tried_host_bytes": res.host_bytes,
        "tried_disk_bytes": res.disk_bytes,
    }
    for name, plan in (("best", best), ("next_up", nxt)):
        if plan is not None:
            rec[name] = {
                "seq_len": plan.seq_len,
                "peak_bytes": plan.peak_bytes,
                "peak_gib": round(plan.peak_gib, 3),
                "phase": plan.peak_phase,
                "host_gib": round(plan.host_bytes / GIB, 2),
                "disk_gib": round(plan.disk_bytes / GIB, 2),
                "staging_gib": round(plan.staging_bytes / GIB, 2),
                "step_time_modelled": plan.step_time,
                "extrapolated": plan.trace["extrapolated"],
                "breakdown_gib": {k: round(v / GIB, 3) for k, v in plan.breakdown.items()},
                "kinds_gib": {k: round(v / GIB, 3) for k, v in plan.kinds.items()},
            }
    log(f"  -> {res.answer()}; {res.binding} memory binds ({res.traces} traces, {res.seconds:.0f} s, "
        f"{cpu:.0f} s of CPU)")
    return rec


def verify(flavor, gpus, features, seq_len, ns, log) -> dict:
    """Extrapolated (4/5/6-layer traces) vs full trace at one length."""
    cfg, sp, dp_shard, _ = make_config(flavor, gpus, features, ns.quick, ns.ulysses, ns.mlp_tiles, ns.tp, ns.lora,
                                       ns.head_chunks, bool(ns.disk_gib), ns.implementation, ns.float8)
    unit = (ns.granularity or 1024) * sp
    seq_len = max(unit, seq_len // unit * unit)
    full = plan_memory(cfg, gpus, seq_len, rows=1, layers="full", loops=ns.loops)
    ext = plan_memory(cfg, gpus, seq_len, rows=1, layers="extrapolate", loops=ns.loops)
    rec = {
        "bench": "max_seq_len_verify_extrapolation",
        **stamp(),
        "model": flavor, "gpus": gpus, "features": features, "seq_len": seq_len,
        "full_gib": round(full.peak_gib, 4), "extrapolated_gib": round(ext.peak_gib, 4),
        "rel_error": (ext.peak_bytes - full.peak_bytes) / full.peak_bytes,
        "full_seconds": round(full.trace["seconds"], 1), "extrapolated_seconds": round(ext.trace["seconds"], 1),
        "extrapolated_from": ext.trace["layers_traced"],
    }
    log(f"verify {flavor} {gpus} GPUs {features} at {fmt_tokens(seq_len)}: full {full.peak_gib:.3f} GiB, "
        f"extrapolated {ext.peak_gib:.3f} GiB ({rec['rel_error']:+.2e})")
    return rec


def sweep(flavor, gpus, features, lengths, ns, log) -> list[dict]:
    """Planned peak at fixed lengths (for the memory-vs-length plot)."""
    out = []
    cfg, sp, dp_shard, _ = make_config(flavor, gpus, features, ns.quick, ns.ulysses, ns.mlp_tiles, ns.tp, ns.lora,
                                       ns.head_chunks, bool(ns.disk_gib), ns.implementation, ns.float8)
    features = label(features, ns.lora, ns.float8)
    for seq_len in lengths:
        unit = (ns.granularity or 1024) * sp
        seq_len = max(unit, seq_len // unit * unit)
        plan = plan_memory(cfg, gpus, seq_len, rows=1, layers=ns.layers, loops=ns.loops)
        rec = {
            "bench": "max_seq_len_sweep", **stamp(), "model": flavor, "gpus": gpus, "sp": sp,
            "dp_shard": dp_shard, "features": features, "seq_len": seq_len,
            "peak_gib": round(plan.peak_gib, 3), "phase": plan.peak_phase,
            "host_gib": round(plan.host_bytes / GIB, 2), "extrapolated": plan.trace["extrapolated"],
            "seconds": round(plan.trace["seconds"], 1),
            "breakdown_gib": {k: round(v / GIB, 3) for k, v in plan.breakdown.items()},
        }
        log(f"sweep {flavor} {gpus} GPUs {features} {fmt_tokens(seq_len)}: {plan.peak_gib:.2f} GiB")
        out.append(rec)
    return out


def _variant(features: str) -> tuple[int, str]:
    """(LoRA rank, FP8 recipe) of a :func:`label`."""
    lora, fp8 = re.search(r"\+lora(\d+)", features), re.search(r"\+fp8_(\w+)", features)
    return int(lora[1]) if lora else 0, fp8[1] if fp8 else ""


def table(records: list[dict], ns) -> str:
    rows = [r for r in records if r["bench"] == "max_seq_len"]
    order = list(FLAVORS) + HF_MODELS
    models = sorted({r["model"] for r in rows}, key=lambda m: order.index(m) if m in order else len(order))
    # Columns: by LoRA rank, then FP8 recipe, then the feature sets' order.
    variants = sorted({_variant(r["features"]) for r in rows})
    feats = [label(f, n, fp8) for n, fp8 in variants for f in FEATURES
             if any(r["features"] == label(f, n, fp8) for r in rows)]
    out = [
        f"PLANNED max trainable sequence (tokens; one sequence per dp rank; peak allocated-tensor "
        f"bytes <= {ns.budget_gib:g} - {ns.headroom_gib:g} = {ns.budget_gib - ns.headroom_gib:g} GiB per GPU"
        + (f"; host memory <= {ns.host_budget_gib:g} GiB per GPU, (host): that ceiling binds"
           if ns.host_budget_gib else "")
        + (f"; offloaded layer inputs on a disk of {ns.disk_gib:g} GiB per GPU, (disk): that ceiling binds"
           if getattr(ns, "disk_gib", 0) else "") + ")",
        "",
        "| model | GPUs | sp x dp_shard | " + " | ".join(feats) + " | ALST (published) |",
        "| --- | --- | --- | " + " | ".join("---" for _ in feats) + " | --- |",
    ]
    for m in models:
        # One row per layout: Ulysses only and USP (ring > 1) side by side.
        for g, ring, tp in sorted({(r["gpus"], r.get("ring", 1), r.get("tp", 1)) for r in rows if r["model"] == m}):
            cell = {r["features"]: r for r in rows
                    if r["model"] == m and r["gpus"] == g and r.get("ring", 1) == ring and r.get("tp", 1) == tp}
            any_r = next(iter(cell.values()))
            alst = ALST.get(m, {}).get(g)
            sp = f"{any_r['sp']} ({ring} ring x {any_r['sp'] // ring} ulysses)" if ring > 1 else any_r["sp"]
            if any_r.get("tp", 1) > 1:
                sp = f"{sp} x tp {any_r['tp']}"
            out.append(
                f"| {m} | {g} | {sp} x {any_r['dp_shard']} | "
                + " | ".join(_cell(cell[f]) if f in cell else "-" for f in feats)
                + f" | {fmt_tokens(alst) if alst else '-'} |"
            )
    return "\n".join(out)


def _cell(rec: dict) -> str:
    """A table cell: the planned length, marked when host memory or the disk is the ceiling that binds."""
    return fmt_tokens(rec["planned_max_seq_len"]) + (f" ({rec['binding']})" if rec.get("binding") in ("host", "disk")
                                                     else "")


def plot(records: list[dict], path: str, ns, log) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"no plot: matplotlib is not installed (pip install matplotlib); {path} not written")
        return
    swept = [r for r in records if r["bench"] == "max_seq_len_sweep"]
    searched = [r for r in records if r["bench"] == "max_seq_len"]
    # One panel per (model, GPUs): the sweep's points if any, else the search's.
    order = list(FLAVORS)
    # One panel per (model, GPUs): the sweep's points where there is a sweep, else the search's.
    groups = sorted({(r["model"], r["gpus"]) for r in swept}
                    | {(r["model"], r["gpus"]) for r in searched if r["planned_max_seq_len"] > 0})
    groups.sort(key=lambda mg: (order.index(mg[0]) if mg[0] in order else 99, mg[1]))
    if not groups:
        log("no plot: nothing fits")
        return
    ncols = min(3, len(groups))
    nrows = -(-len(groups) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.5 * nrows), squeeze=False)
    limit = ns.budget_gib - ns.headroom_gib
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, (m, g) in zip(axes.flat, groups):
        curves: dict[str, list] = {}
        from_sweep = any((r["model"], r["gpus"]) == (m, g) for r in swept)
        if from_sweep:
            for r in swept:
                if (r["model"], r["gpus"]) == (m, g):
                    curves.setdefault(r["features"], []).append((r["seq_len"], r["peak_gib"]))
        else:
            for r in searched:
                if (r["model"], r["gpus"]) == (m, g):
                    curves[r["features"]] = [(s_, b / GIB) for s_, b, _ in r["tried"]]
        for feats, pts in curves.items():
            pts.sort()
            best = next((r["planned_max_seq_len"] for r in searched
                         if (r["model"], r["gpus"], r["features"]) == (m, g, feats)), None)
            label = feats + (f" (max {fmt_tokens(best)})" if best else "")
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        ax.axhline(limit, color="k", ls="--", lw=1, label=f"{ns.budget_gib:g} GiB - {ns.headroom_gib:g} GiB headroom")
        alst = ALST.get(m, {}).get(g)
        if alst:
            ax.axvline(alst / 1e6, color="gray", ls=":", lw=1, label=f"ALST published ({fmt_tokens(alst)})")
        sp = next((r["sp"] for r in swept + searched if (r["model"], r["gpus"]) == (m, g)), "?")
        ax.set_xlabel("sequence length (M tokens)")
        ax.set_ylabel("PLANNED peak per GPU (GiB, allocated tensors)")
        ax.set_ylim(0, 2.2 * limit)
        ax.set_title(f"{m}, {g} GPUs (sp {sp}), PLANNED" + ("" if from_sweep else ": search points"))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot written: {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["llama3_8b", "llama3_70b"],
                   help=f"this package's flavors, or transformers configs of benchmarks/model_configs: {HF_MODELS}")
    p.add_argument("--gpus", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--features", nargs="+", choices=list(FEATURES),
                   help="feature sets to plan (default: all of them; --quick: baseline and all)")
    p.add_argument("--budget-gib", type=float, default=80.0)
    p.add_argument("--headroom-gib", type=float, default=6.0)
    p.add_argument("--host-budget-gib", type=float, default=HOST_BUDGET_GIB,
                   help=f"host memory per GPU (offloaded activations, parameter state), GiB (default "
                        f"{HOST_BUDGET_GIB:g}: an 8-GPU node with 2 TiB; 0: no host ceiling)")
    p.add_argument("--disk-gib", type=float, default=0.0,
                   help="the disk tier: rows that offload layer inputs plan them on a local disk "
                        f"(memory.offload_dir = {OFFLOAD_DIR}, not touched) with this many GiB per GPU "
                        "(default 0: host memory only)")
    p.add_argument("--disk-gbps", type=float, default=DISK_GBPS,
                   help=f"with --disk-gib: the disk's GB/s per GPU for the MODELLED step time (default {DISK_GBPS:g})")
    p.add_argument("--precision", type=float, default=100 * PRECISION,
                   help=f"percent: the limit lies within this above the answer (default {100 * PRECISION:g})")
    p.add_argument("--granularity", type=int, default=None,
                   help="search multiples of this many tokens per sp rank instead, the next one up planned not to fit")
    p.add_argument("--loops", choices=("edges", "all"), default="edges",
                   help="trace each loop over the sequence at its edge pieces (default) or every piece")
    p.add_argument("--ulysses", type=int, default=0, metavar="N",
                   help="USP layout: every GPU in sp, Ulysses over N GPUs (a node), ring attention "
                        "across the GPUs / N groups (0: Ulysses only, sp = the most the heads allow)")
    p.add_argument("--guess", nargs=2, type=int, metavar=("LO", "HI"),
                   help="two lengths (tokens) expected to straddle the answer: planned first, they "
                        "seed the search (e.g. from a neighbouring layout's result)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="LoRA adapters of this rank on every projection (lora.alpha = 2 x rank), the base "
                        "frozen: transformers configs only (0: full fine-tuning)")
    p.add_argument("--float8", choices=("rowwise", "rowwise_with_gw_hp", "tensorwise"), default="",
                   help="FP8 linear layers of this torchao recipe ([float8], traced eagerly with the casts' "
                        "temporaries; tensorwise with FP8 all-gathers); needs the float8 extra")
    p.add_argument("--implementation", choices=("transformers", "auto"), default="transformers",
                   help="transformers configs: transformers' model class (default), or auto: this package's Llama "
                        "where it loads the checkpoint (Llama 3.x, Mistral, Qwen2/2.5/3), as the trainer's configs do")
    p.add_argument("--layers", choices=("auto", "full", "extrapolate"), default="auto")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel degree: N GPUs of each node split every block's weights; sp from the rest")
    p.add_argument("--mlp-tiles", type=int, default=0, metavar="N",
                   help="plan with N MLP tiles per layer (memory.mlp_tiles) instead of the automatic count "
                        "(tiles about dim^2/ffn tokens long, hundreds per layer at long context, each traced): "
                        "larger tiles can only add to the peak, so the planned length is a lower bound of the "
                        "automatic one, and a config with memory.mlp_tiles = N trains exactly what was planned")
    p.add_argument("--head-chunks", type=int, default=0, metavar="N",
                   help="plan with N head chunks (memory.head_chunks; 1: none) instead of the trainer's automatic "
                        "count (0, the default: one query head per chunk at long context)")
    p.add_argument("--confirm", nargs="*", metavar="FEATURES", default=None,
                   help="re-plan the boundary with every layer traced, for these feature sets (none given: all)")
    p.add_argument("--no-confirm", nargs="*", metavar="FEATURES", default=None,
                   help="the default now (the boundary stays extrapolated; the 5-layer check runs at the answer)")
    p.add_argument("--verify", action="store_true",
                   help="also compare extrapolated and full traces at a quarter of each model's longest fit")
    p.add_argument("--table", help="also write the markdown table here")
    p.add_argument("--plot", help="write a PNG of planned peak vs sequence length")
    p.add_argument("--quick", action="store_true", help="smoke run: debug model, 2 GPUs, tiny budget")
    p.add_argument("--from-jsonl", nargs="+", metavar="FILE",
                   help="no planning: rebuild the table (and --plot) from saved JSON lines")
    p.add_argument("--sweep", nargs=2, metavar=("MODEL", "GPUS"),
                   help="only plan fixed lengths (--lengths) for every feature set, for the plot")
    p.add_argument("--lengths", nargs="+", type=int,
                   default=[131072, 262144, 524288, 1048576, 2097152, 4194304])
    ns = p.parse_args(argv)
    if ns.features is None and not ns.quick:
        ns.features = list(FEATURES)
    if ns.quick:
        ns.models, ns.gpus = ["debug"], [2]
        ns.features = ns.features or ["baseline", "all"]
        ns.budget_gib, ns.headroom_gib, ns.granularity = 0.02, 0.0, 64
        ns.host_budget_gib = 0.0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    records = []
    t0 = time.perf_counter()
    if ns.from_jsonl:
        for path in ns.from_jsonl:
            records += [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith("{")]
        text = table(records, ns)
        print(text)
        if ns.table:
            Path(ns.table).write_text(text + "\n")
        if ns.plot:
            plot(records, ns.plot, ns, log)
        return 0
    if ns.sweep:
        flavor, gpus = ns.sweep[0], int(ns.sweep[1])
        for feats in ns.features:
            for rec in sweep(flavor, gpus, feats, ns.lengths, ns, log):
                print(json.dumps(rec), flush=True)
                records.append(rec)
        if ns.plot:
            plot(records, ns.plot, ns, log)
        log(f"total {time.perf_counter() - t0:.0f} s")
        return 0
    for flavor in ns.models:
        for gpus in ns.gpus:
            for feats in ns.features:
                rec = run_one(flavor, gpus, feats, ns, log)
                print(json.dumps(rec), flush=True)
                records.append(rec)
        if ns.verify:
            fits = [r for r in records if r["model"] == flavor and r["planned_max_seq_len"] > 0]
            if fits:
                r = max(fits, key=lambda r: (r["gpus"], r["features"] == "all"))
                rec = verify(flavor, r["gpus"], r["features"], r["planned_max_seq_len"] // 4, ns, log)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    text = table(records, ns)
    log("\n" + text + f"\n\ntotal {time.perf_counter() - t0:.0f} s")
    if ns.table:
        Path(ns.table).write_text(text + "\n")
    if ns.plot:
        plot(records, ns.plot, ns, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
