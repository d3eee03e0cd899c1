"""PNG plots of evaluation rows (needs matplotlib: ``pip install 'ulysses-dtensor[plot]'``).

* :func:`plot_heatmap`: per retrieval task, accuracy on a grid of eval length
  (rows) x needle depth (columns, 0% = right after the instruction, 100% = just
  before the question). Green is retrieved, red is missed.
* :func:`plot_position_loss`: mean next-token loss per position bucket against
  the bucket's position (log x axis), one line per eval length.

``python -m ulysses_dtensor.evaluation.redraw eval.jsonl OUT_DIR [--step N]``
redraws them from an ``eval.jsonl``.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_heatmap", "plot_position_loss"]


def plot_heatmap(rows: list[dict], path: str | Path) -> Path:
    cells = [r for r in rows if r["kind"] == "retrieval"]
    tasks = list(dict.fromkeys(r["task"] for r in cells))
    lengths = sorted({r["length"] for r in cells})
    depths = sorted({r["depth"] for r in cells})
    step = cells[0]["step"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(1.0 + 0.55 * len(depths) * len(tasks) + 1.5,
                                                     1.6 + 0.45 * len(lengths)), squeeze=False)
    image = None
    for ax, task in zip(axes[0], tasks):
        grid = [[math.nan] * len(depths) for _ in lengths]
        for r in cells:
            if r["task"] == task:
                grid[lengths.index(r["length"])][depths.index(r["depth"])] = r["accuracy"]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.0%}" if value not in (0.0, 1.0) else f"{value:.0f}",
                            ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(depths)), [f"{100 * d:.0f}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)), [_fmt_tokens(n) for n in lengths], fontsize=8)
        ax.set_xlabel("needle depth (%)")
        ax.set_title(f"{task}, step {step}", fontsize=10)
    axes[0][0].set_ylabel("eval length (tokens)")
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.03, label="accuracy (teacher-forced)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_position_loss(rows: list[dict], path: str | Path) -> Path:
    buckets = [r for r in rows if r["kind"] == "position_loss" and r["loss"] is not None]
    step = buckets[0]["step"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for length in sorted({r["length"] for r in buckets}):
        mine = sorted((r for r in buckets if r["length"] == length), key=lambda r: r["start"])
        # x: the bucket's geometric middle (its first position for the bucket at 0)
        xs = [math.sqrt(max(r["start"], 1) * r["end"]) for r in mine]
        ax.plot(xs, [r["loss"] for r in mine], marker="o", label=f"eval length {_fmt_tokens(length)}")
        for x, r in zip(xs, mine):
            ax.annotate(_fmt_tokens(r["tokens"]), (x, r["loss"]), fontsize=6, xytext=(0, 4),
                        textcoords="offset points", ha="center", color="gray")
    ax.set_xscale("log")
    ax.set_xlabel("position in document (tokens of context), log scale")
    ax.set_ylabel("mean next-token loss")
    ax.set_title(f"held-out loss by position, step {step} (gray: tokens per bucket)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _fmt_tokens(n: float) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{int(n) >> 10}K"
    return str(int(n))
