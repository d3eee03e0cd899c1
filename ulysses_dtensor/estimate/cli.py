"""Command line: ``python -m ulysses_dtensor.estimate``."""

from __future__ import annotations

import argparse
import json
import sys

from .planner import plan_memory
from .search import find_max_seq_len

_EPILOG = """\
Every other --section.key value is a config override, as for the trainer
(e.g. --parallelism.sp 8 --memory.tiled_loss true --model.vocab_size 128256).

The figure is allocated-tensor bytes (torch.cuda.max_memory_allocated), not
nvidia-smi: keep --headroom-gib for the caching allocator, CUDA context and NCCL.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ulysses_dtensor.estimate",
        description="Per-rank peak memory of one training step, traced on fake tensors.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--config", help="trainer TOML config")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to simulate (default: dp_replicate*dp_shard*sp of the config, dp_shard=-1 as 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's longest stage)")
    p.add_argument("--rows", type=int, default=None,
                   help="sequences per dp rank in the step (default: from the config; 1 with --max-seq-len)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="plan for GPUs (default) or CPU")
    p.add_argument("--layers", choices=("full", "extrapolate", "auto"), default=None,
                   help="full trace, or 4/5/6-layer traces extrapolated linearly in the layer count; "
                        "auto (default): whichever traces fewer ops")
    p.add_argument("--foreach", choices=("true", "false"), default=None, help="AdamW foreach (default: torch's choice)")
    p.add_argument("--max-seq-len", action="store_true", help="search the longest sequence that fits the budget")
    p.add_argument("--budget-gib", type=float, default=80.0, help="device memory in GiB (default 80)")
    p.add_argument("--headroom-gib", type=float, default=6.0,
                   help="kept free for allocator fragmentation, CUDA context, NCCL (default 6)")
    p.add_argument("--granularity", type=int, default=1024, help="search step in tokens per sp rank (default 1024)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    from ..trainer.config import ConfigError, load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    ns, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(rest + (["--config", ns.config] if ns.config else []))
        foreach = None if ns.foreach is None else ns.foreach == "true"
        if ns.max_seq_len:
            log = None if ns.json else (lambda s: print(s, file=sys.stderr, flush=True))
            res = find_max_seq_len(
                cfg, ns.world_size, budget_gib=ns.budget_gib, headroom_gib=ns.headroom_gib,
                granularity=ns.granularity, rows=ns.rows or 1, device=ns.device,
                layers=ns.layers or "auto", foreach=foreach, log=log,
            )
            if ns.json:
                print(json.dumps(res.to_dict()))
                return 0
            limit = ns.budget_gib - ns.headroom_gib
            print(
                f"PLANNED longest sequence that fits {ns.budget_gib:g} GiB - {ns.headroom_gib:g} GiB "
                f"headroom = {limit:g} GiB of allocated tensors per rank: {res.max_seq_len:,} tokens "
                f"(search step {res.unit:,} tokens; "
                f"{'boundary planned with full traces' if res.confirmed else 'boundary planned on extrapolated traces'}; "
                f"{res.seconds:.0f} s)"
            )
            if res.best is not None:
                print(res.best.format())
            if res.next_up is not None:
                print(f"next step up, {res.next_up.seq_len:,} tokens: {res.next_up.peak_gib:.2f} GiB > {limit:g} GiB")
            return 0
        plan = plan_memory(
            cfg, ns.world_size, ns.seq_len, rows=ns.rows, device=ns.device,
            layers=ns.layers or "auto", foreach=foreach,
        )
        print(json.dumps(plan.to_dict()) if ns.json else plan.format())
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
