"""The all-to-all share of step time in ``bench_train.py`` records, and the side-by-side record.

``exchange_record``: per timed step, rank 0's time in the Ulysses exchanges
(:class:`ulysses_dtensor.parallel.comm_timing.ExchangeTimer`: CUDA events, or wall clock
on CPU) and its share of that rank's step time. ``compare_record`` (``--compare``):
the configurations of one run side by side.
"""

from __future__ import annotations

import statistics

import _common as C
import torch
import torch.distributed as dist

from ulysses_dtensor.parallel.comm_timing import ExchangeTimer


def exchange_record(timers: list[ExchangeTimer], local_times: list[float], device: torch.device) -> dict:
    """This rank's all-to-all time per timed step and its share of the step (rank 0 reports)."""
    if not timers:
        return {"measured": False, "reason": "--compile: compiled blocks cannot carry the timer"}
    reads = [t.read() for t in timers]
    shares = [r["total_s"] / t for r, t in zip(reads, local_times)]
    return {
        "measured": True,
        "method": ("CUDA events around each all-to-all and its wait, read after the step"
                   if device.type == "cuda" else "wall clock around each all-to-all and its wait (gloo)"),
        "rank": dist.get_rank(),
        "calls_per_step": reads[0]["calls"],
        "median_ms": round(statistics.median(r["total_s"] for r in reads) * 1e3, 4),
        "forward_median_ms": round(statistics.median(r["forward_s"] for r in reads) * 1e3, 4),
        "backward_median_ms": round(statistics.median(r["backward_s"] for r in reads) * 1e3, 4),
        "share_of_step": round(statistics.median(shares), 6),
        "shares": [round(x, 6) for x in shares],
    }


def compare_record(records: list[dict]) -> dict:
    """The configurations of one real run side by side (same model and length)."""
    rows = []
    for r in records:
        if r.get("mode") != "real" or "figures" not in r:
            continue
        ex = r.get("exchange", {})
        rows.append({
            "sp": r["config"]["mesh"]["sp"], "world_size": r["world_size"], "seq": r["config"]["seq"],
            "n_layers": r["config"]["model"]["n_layers"],
            "step_ms": r["figures"]["step_ms"], "tokens_per_s": r["figures"]["tokens_per_s"],
            "tokens_per_s_per_device": r["figures"]["tokens_per_s_per_device"],
            "peak_gib": r["memory"]["peak_gib"],
            "exchange_ms": ex.get("median_ms"), "exchange_share": ex.get("share_of_step"),
        })
    return {"bench": "train_compare", **C.env_info(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
            "note": "one row per configuration of this run; exchange = Ulysses all-to-all time per step "
                    "on rank 0 (forward + backward) and its share of rank 0's step time",
            "rows": rows}
