"""What a measured training step becomes: ``bench_train.py``'s JSON record.

The figures of one configuration from the raw measurement (step times, counted
collective bytes and calls, memory): tokens/s, TFLOP/s and MFU per device, the
all-to-all bytes against their formula, and in simulate mode the skipped
collectives added back at the stated bandwidths (the assumptions travel in the
record). A record at a layer count that was not run (``--extrapolate-layers``)
comes from the least-squares line through the runs at several layer counts.
"""

from __future__ import annotations

import math
import statistics

import _common as C
import torch

from ulysses_dtensor.models.llama import Llama, llama_args
from ulysses_dtensor.parallel.head_chunk_plan import resolve_head_chunks
from ulysses_dtensor.parallel.ulysses import exchange_bytes_per_rank, kv_replication

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Dense peak FLOP/s per device for the MFU denominator (bf16/fp16 tensor cores).
PEAK_FLOPS_16BIT = (("H100", 989e12), ("H200", 989e12), ("A100", 312e12))

LINK_ASSUMPTION = (
    "all-to-all time = sent bytes per rank / link_gbps (+ calls x latency); "
    "default 400 GB/s per GPU per direction, NVLink-class intra-node (H100 SXM NVLink4: "
    "450 GB/s per direction nominal; NCCL all-to-all reaches less). The all-to-all is on "
    "the critical path (not overlapped)"
)
FSDP_ASSUMPTION = (
    "FSDP all-gather / reduce-scatter (and HSDP all-reduce) time = counted bytes this rank "
    "sends in a ring ((N-1) shards per all-gather / reduce-scatter, 2(N-1)/N of the buffer "
    "per all-reduce) / fsdp_gbps (+ calls x latency), same link class as the all-to-all. "
    "step_ms adds it in full (no overlap: upper bound); step_ms_fsdp_overlapped assumes "
    "FSDP2 prefetching hides it behind compute (lower bound)"
)
NOT_MODELLED = (
    "scalar all-reduces (global valid-token count, grad-norm) are skipped and not modelled; "
    "no contention between the all-to-all and FSDP traffic is modelled"
)


# --------------------------------------------------------------------------- #
# Expected figures
# --------------------------------------------------------------------------- #


def recomputed_blocks(a, n_layers: int) -> int:
    """Blocks whose forward (and so its all-to-alls) runs again in backward."""
    if a.ac == "full":
        return n_layers  # offloaded activations are a full checkpoint too
    if a.ac == "selective" and a.selective_ac != "op":
        return n_layers // int(a.selective_ac)
    return 0  # none; selective "op" saves the all-to-all outputs


def run_head_chunks(setting, batch: int, seq: int, args, sp: int, element_size: int) -> int:
    """The head chunks a run of our Llama ``args`` on ``sp`` ranks resolves to (1 without SP)."""
    if sp <= 1:
        return 1
    kv = args.n_kv_heads * kv_replication(args.n_heads, args.n_kv_heads, sp)
    return resolve_head_chunks(setting, batch, seq, args.n_heads // sp, kv // sp, args.head_dim, args.head_dim,
                               element_size)


def expected_a2a(a, args, seq: int, sp: int, element_size: int) -> dict:
    n = args.n_layers
    # The head chunks the run resolves to (backward sends the output again with them).
    chunks = run_head_chunks(getattr(a, "head_chunks", None), a.batch, seq, args, sp, element_size)
    fwd = exchange_bytes_per_rank(a.batch, seq, args.n_heads, args.n_kv_heads, args.head_dim, sp,
                                  element_size, backward=False)
    per_layer = exchange_bytes_per_rank(a.batch, seq, args.n_heads, args.n_kv_heads, args.head_dim, sp,
                                        element_size, backward=True, head_chunks=chunks)
    r = recomputed_blocks(a, n)
    expected = n * per_layer + r * fwd
    return {
        "expected_sent_bytes_per_rank": expected,
        "per_layer_bytes": per_layer,
        "recomputed_layers": r,
        "ac_factor": round(expected / (n * per_layer), 6) if per_layer else 1.0,
        "head_chunks": chunks,
        "formula": "n_layers * exchange_bytes_per_rank(batch, seq, heads, kv_heads, head_dim, sp, "
                   "element_size, head_chunks=head_chunks) + recomputed_layers * (its forward half)",
    }


def peak_flops(a, device: torch.device) -> tuple[float | None, str | None]:
    if a.peak_flops:
        return a.peak_flops, "--peak-flops"
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    if a.dtype not in ("bfloat16", "float16"):
        return None, f"no table entry for {a.dtype} on {name} (table: bf16/fp16 dense); pass --peak-flops"
    for key, value in PEAK_FLOPS_16BIT:
        if key in name:
            return value, f"table: {key} {a.dtype} dense"
    return None, f"{name} not in the peak table; pass --peak-flops"


def model_args(a, n_layers: int | None):
    overrides = dict(a.override)
    if n_layers is not None:
        overrides["n_layers"] = n_layers
    return llama_args(a.flavor, **overrides)


def make_record(a, args, dims, device: torch.device, seq: int, raw: dict, *, simulate: bool,
                extrapolated: dict | None = None) -> dict:
    """The JSON record of one configuration from what ``measure`` (or a fit) gave."""
    sp, world = dims.sp, dims.world_size
    with torch.device("meta"):
        flops_model = Llama(args)  # unparallelized, on meta: parameter counts and FLOPs
    step_s = raw["step_ms"] / 1e3 if extrapolated else statistics.median(raw["times"])
    tokens_global = dims.dp * a.batch * seq
    tokens_device = a.batch * seq // sp  # = tokens_global / world
    fpt = flops_model.flops_per_token(seq)
    peak, peak_src = peak_flops(a, device)

    def figures(seconds: float) -> dict:
        return {
            "step_ms": round(seconds * 1e3, 4),
            "tokens_per_s": round(tokens_global / seconds, 3),
            "tokens_per_s_per_device": round(tokens_device / seconds, 3),
            "tflops_per_device": round(fpt * tokens_device / seconds / 1e12, 6),
            "mfu": round(fpt * tokens_device / seconds / peak, 6) if peak else None,
        }

    exp = expected_a2a(a, args, seq, sp, DTYPES[a.dtype].itemsize)
    a2a_rec = {
        "sent_bytes_per_rank": raw["a2a_bytes"],
        "calls": raw["a2a_calls"],
        **exp,
        "bytes_match": raw["a2a_bytes"] == exp["expected_sent_bytes_per_rank"],
        "other_functional_collectives": raw["a2a_other"],
    }
    rec = {
        "bench": "train",
        "mode": "simulate" if simulate else "real",
        **C.env_info(device),
        "world_size": world,
        "processes": 1 if simulate else world,
        "threads_per_rank": torch.get_num_threads(),
        "communication": "skipped (fake process group); modelled below" if simulate else
                         f"real ({raw['backend']})",
        "config": {
            "flavor": a.flavor,
            "overrides": {**dict(a.override), **({"n_layers": args.n_layers} if a.layers else {})},
            "model": {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads,
                      "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim, "ffn_dim": args.ffn_dim,
                      "vocab_size": args.vocab_size, "params": flops_model.num_params(),
                      "attn_backend": args.attn_backend},
            "mesh": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "sp": sp},
            "seq": seq, "batch": a.batch, "local_seq": seq // sp,
            "tokens_per_step": tokens_global, "tokens_per_rank": tokens_device,
            "ac": a.ac, "selective_ac": a.selective_ac if a.ac == "selective" else None,
            "compile": a.compile, "compile_backend": a.compile_backend if a.compile else None,
            "dtype": a.dtype, "reduce_dtype": a.reduce_dtype, "pack_qkv": a.pack_qkv,
            "tiled_mlp": a.tiled_mlp, "mlp_tiles": a.mlp_tiles, "tiled_loss": a.tiled_loss,
            "loss_chunks": a.loss_chunks, "offload_activations": a.offload_activations,
            "save_attention": a.save_attention,
            "float8": getattr(a, "float8", None),
            "offload_dir": getattr(a, "offload_dir", None),
            "head_chunks": getattr(a, "head_chunks", None) or "auto",
            "offload_params": a.offload_params,
            "optimizer": "AdamW", "max_norm": a.max_norm, "warmup": a.warmup, "iters": a.iters,
            "clock": "process CPU seconds" if getattr(a, "cpu_clock", False) else "wall seconds",
        },
        "step_time": ({"median_ms": round(step_s * 1e3, 4)} if extrapolated else
                      {**C.summarize(raw["times"]), "times_ms": [round(t * 1e3, 3) for t in raw["times"]]}),
        "flops_per_token": fpt,
        "peak_flops": peak,
        "peak_flops_source": peak_src,
        "memory": raw["memory"],
        "all_to_all": a2a_rec,
        "fsdp": {"calls": raw["fsdp_calls"], "sent_bytes_per_rank": raw["fsdp_sent"]},
    }
    if raw.get("exchange") is not None:
        rec["exchange"] = raw["exchange"]
    if raw.get("timed_steps") is not None:
        rec["timed_steps"] = {**raw["timed_steps"],
                              "finite": all(math.isfinite(x) for v in raw["timed_steps"].values() for x in v)}
    if raw.get("collectives") is not None:
        rec["collectives"] = raw["collectives"]
    if extrapolated:
        rec["extrapolated"] = extrapolated
        a2a_rec["bytes_match"] = None  # not counted: the formula at n_layers
        a2a_rec["note"] = "not counted: formula at the extrapolated n_layers; calls from the fit"
    if not simulate:
        rec["figures"] = {**figures(step_s), "modelled": bool(extrapolated)}
    else:
        lat = a.latency_us * 1e-6
        a2a_s = raw["a2a_bytes"] / (a.link_gbps * 1e9) + raw["a2a_calls"] * lat
        fsdp_s = sum(raw["fsdp_sent"].values()) / (a.fsdp_gbps * 1e9) + sum(raw["fsdp_calls"].values()) * lat
        full = figures(step_s + a2a_s + fsdp_s)
        overlapped = figures(step_s + a2a_s)
        rec["compute_only"] = {**figures(step_s), "modelled": bool(extrapolated),
                               "note": "measured on this device, every collective skipped"
                                       + (" (extrapolated in n_layers)" if extrapolated else "")}
        rec["figures"] = {
            **full,
            "step_ms_fsdp_overlapped": overlapped["step_ms"],
            "tokens_per_s_per_device_fsdp_overlapped": overlapped["tokens_per_s_per_device"],
            "mfu_fsdp_overlapped": overlapped["mfu"],
            "modelled": True,
            "link_gbps": a.link_gbps,
            "fsdp_gbps": a.fsdp_gbps,
            "latency_us": a.latency_us,
            "compute_ms": round(step_s * 1e3, 4),
            "all_to_all_ms": round(a2a_s * 1e3, 4),
            "fsdp_ms": round(fsdp_s * 1e3, 4),
            "assumptions": [LINK_ASSUMPTION, FSDP_ASSUMPTION, NOT_MODELLED],
        }
    return rec


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((xi - mx) ** 2 for xi in xs)
    slope = sum((xi - mx) * (yi - my) for xi, yi in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _line_at(xs: list[int], ys: list[float], x: float) -> float:
    """Least-squares line through (xs, ys), evaluated at x."""
    intercept, slope = _line(xs, ys)
    return intercept + slope * x


def extrapolate(a, dims, device, seq: int, runs: dict[int, dict], *, simulate: bool) -> dict:
    """A record for ``--extrapolate-layers N`` from runs at >= 2 layer counts (same seq)."""
    n = a.extrapolate_layers
    ls = sorted(runs)
    args = model_args(a, n)
    fit = lambda f: _line_at(ls, [f(runs[k]) for k in ls], n)  # noqa: E731
    kinds = sorted({k for r in runs.values() for k in r["fsdp_sent"]})
    exp = expected_a2a(a, args, seq, dims.sp, DTYPES[a.dtype].itemsize)
    mem_keys = [k for k in ("resident_bytes", "step_peak_bytes", "peak_bytes", "max_allocated_bytes",
                            "max_reserved_bytes") if all(k in runs[x]["memory"] for x in ls)]
    mem = {k: int(round(fit(lambda r, k=k: r["memory"][k]))) for k in mem_keys}
    mem["peak_gib"] = round(mem["peak_bytes"] / 2**30, 4)
    mem["method"] = f"linear fit in n_layers of the measured {ls}"
    raw = {
        "step_ms": fit(lambda r: statistics.median(r["times"]) * 1e3),
        "a2a_bytes": exp["expected_sent_bytes_per_rank"],  # the formula, exact for any n_layers
        "a2a_calls": int(round(fit(lambda r: r["a2a_calls"]))),
        "a2a_other": {},
        "fsdp_calls": {k: int(round(fit(lambda r, k=k: r["fsdp_calls"].get(k, 0)))) for k in kinds},
        "fsdp_sent": {k: int(round(fit(lambda r, k=k: r["fsdp_sent"].get(k, 0)))) for k in kinds},
        "memory": mem,
        "backend": runs[ls[0]]["backend"],
    }
    step_ms = [statistics.median(runs[k]["times"]) * 1e3 for k in ls]
    intercept, slope = _line(ls, step_ms)
    info = {
        "n_layers": n,
        "from_n_layers": ls,
        "from_step_ms": [round(t, 4) for t in step_ms],
        # step_ms = intercept + slope * n_layers; residual: the largest distance of a measured
        # step from the line (0 by construction with two layer counts).
        "fit": {"intercept_ms": round(intercept, 4), "ms_per_layer": round(slope, 4),
                "max_residual_ms": round(max(abs(t - intercept - slope * x) for x, t in zip(ls, step_ms)), 4)},
        "modelled": True,
        "method": "step time, memory and FSDP bytes/calls: least-squares line in n_layers through the "
                  "measured runs, evaluated at n_layers (blocks are identical, so per-block cost is "
                  "constant); all-to-all bytes: the exact formula at n_layers",
    }
    return make_record(a, args, dims, device, seq, raw, simulate=simulate, extrapolated=info)
