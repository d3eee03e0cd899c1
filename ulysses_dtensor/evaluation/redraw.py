"""Redraw the evaluation PNGs from an ``eval.jsonl``:

    python -m ulysses_dtensor.evaluation.redraw eval.jsonl OUT_DIR [--step N]

(needs matplotlib: ``pip install 'ulysses-dtensor[plot]'``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .plots import plot_heatmap, plot_position_loss
from .report import read_jsonl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Redraw the evaluation PNGs from an eval.jsonl.")
    ap.add_argument("jsonl")
    ap.add_argument("out_dir")
    ap.add_argument("--step", type=int, default=-1, help="which evaluation (default: the newest)")
    a = ap.parse_args(argv)
    rows = read_jsonl(a.jsonl, a.step)
    if not rows:
        print(f"{a.jsonl}: no rows for step {a.step}", file=sys.stderr)
        return 2
    step = rows[0]["step"]
    if any(r["kind"] == "retrieval" for r in rows):
        print(plot_heatmap(rows, Path(a.out_dir) / f"heatmap_step{step}.png"))
    if any(r["kind"] == "position_loss" for r in rows):
        print(plot_position_loss(rows, Path(a.out_dir) / f"loss_by_position_step{step}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
