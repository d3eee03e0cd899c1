#!/usr/bin/env python
"""Plot loss and throughput from a trainer's metrics.jsonl.

    python scripts/plot_metrics.py outputs/debug_model/metrics.jsonl loss.png

Needs matplotlib: pip install 'ulysses-dtensor[plot]'. Context-length stage
changes are drawn as dotted vertical lines.
"""

from __future__ import annotations

import argparse
import json
import sys


def read_rows(path: str) -> list[dict]:
    rows = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    if not rows:
        raise SystemExit(f"{path}: no metric rows")
    return rows


def smooth(values: list[float | None], alpha: float = 0.1) -> list[float | None]:
    out, ema = [], None
    for v in values:
        if v is not None:
            ema = v if ema is None else alpha * v + (1 - alpha) * ema
        out.append(ema)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="metrics.jsonl written by ulysses_dtensor.train")
    ap.add_argument("out", help="output image, e.g. metrics.png")
    ap.add_argument("--smooth", type=float, default=0.1, help="EMA weight of the smoothed loss")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_metrics.py needs matplotlib: pip install 'ulysses-dtensor[plot]'",
              file=sys.stderr)
        return 2

    rows = read_rows(args.metrics)
    steps = [r["step"] for r in rows]
    loss = [r.get("loss") for r in rows]
    tps = [r.get("tps") for r in rows]
    changes = [r["step"] for a, r in zip(rows, rows[1:]) if r["seq_len"] != a["seq_len"]]

    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax_loss.plot(steps, loss, alpha=0.35, label="loss")
    ax_loss.plot(steps, smooth(loss, args.smooth), label=f"EMA ({args.smooth})")
    ax_loss.set_ylabel("loss (global token mean)")
    ax_loss.legend()
    ax_tps.plot(steps, tps, label="tokens/s (global)")
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_xlabel("step")
    for ax in (ax_loss, ax_tps):
        for s in changes:
            ax.axvline(s, linestyle=":", color="gray")
        ax.grid(alpha=0.3)
    for s in changes:
        seq = next(r["seq_len"] for r in rows if r["step"] == s)
        ax_loss.annotate(f"seq {seq}", (s, ax_loss.get_ylim()[1]), fontsize=8,
                         xytext=(3, -12), textcoords="offset points")
    fig.suptitle(args.metrics)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
