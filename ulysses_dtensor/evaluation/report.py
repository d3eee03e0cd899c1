"""Where evaluation results go: JSON lines, TensorBoard scalars, PNGs, a console line.

``<folder>/eval.jsonl`` gets one JSON object per row of an
:class:`~.runner.EvalResult`, appended (one evaluation after another):

* ``retrieval``: one per (task, length, depth): ``accuracy`` (fraction of
  samples whose every answer token was the argmax), ``mean_logprob``, and per
  sample ``correct``, ``needle_index``, ``answer``, ``answer_tokens``;
* ``retrieval_mean``: per (task, length), over the depths;
* ``position_loss``: one per (length, bucket): ``start``, ``end``, ``tokens``,
  ``loss`` (mean next-token loss of the predicting positions in the bucket);
* ``loss``: per length, over all buckets;
* ``eval``: the run: lengths, tasks, forward passes per rank, seconds, mesh.

TensorBoard (when a writer is given): ``eval/<task>/len<L>/accuracy`` and
``.../mean_logprob``, ``eval/loss/len<L>`` and
``eval/loss/len<L>/pos_<start>-<end>``. PNGs (with matplotlib):
``heatmap_step<N>.png`` and ``loss_by_position_step<N>.png``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .runner import EvalResult

__all__ = ["write_jsonl", "write_tensorboard", "write_plots", "summary_line", "read_jsonl"]


def _clean(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def write_jsonl(result: EvalResult, folder: str | Path) -> Path:
    path = Path(folder) / "eval.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for row in result.rows:
            fh.write(json.dumps(_clean(row)) + "\n")
    return path


def read_jsonl(path: str | Path, step: int | None = None) -> list[dict]:
    """Rows of an ``eval.jsonl`` (of one step, or of the newest step when ``step=-1``)."""
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if step == -1 and rows:
        step = max(r["step"] for r in rows)
    return rows if step is None else [r for r in rows if r["step"] == step]


def write_tensorboard(result: EvalResult, writer) -> None:
    step = result.step
    for r in result.of_kind("retrieval_mean"):
        writer.add_scalar(f"eval/{r['task']}/len{r['length']}/accuracy", r["accuracy"], step)
        writer.add_scalar(f"eval/{r['task']}/len{r['length']}/mean_logprob", r["mean_logprob"], step)
    for r in result.of_kind("loss"):
        if r["loss"] is not None:
            writer.add_scalar(f"eval/loss/len{r['length']}", r["loss"], step)
    for r in result.of_kind("position_loss"):
        if r["loss"] is not None:
            writer.add_scalar(f"eval/loss/len{r['length']}/pos_{r['start']}-{r['end']}", r["loss"], step)
    writer.add_scalar("eval/seconds", result.seconds, step)
    writer.flush()


def write_plots(result: EvalResult, folder: str | Path) -> list[Path]:
    """The heat map and loss-by-position PNGs; [] when matplotlib is missing."""
    try:
        from .plots import plot_heatmap, plot_position_loss
    except ImportError:
        return []
    folder = Path(folder)
    out = []
    if result.of_kind("retrieval"):
        out.append(plot_heatmap(result.rows, folder / f"heatmap_step{result.step}.png"))
    if result.of_kind("position_loss"):
        out.append(plot_position_loss(result.rows, folder / f"loss_by_position_step{result.step}.png"))
    return out


def summary_line(result: EvalResult, step_seconds: float | None = None) -> str:
    """One console line: per length the loss and each task's accuracy."""
    parts = []
    for r in result.of_kind("loss"):
        if r["loss"] is not None:
            parts.append(f"loss@{r['length']} {r['loss']:.4f}")
    for r in result.of_kind("retrieval_mean"):
        parts.append(f"{r['task']}@{r['length']} {100 * r['accuracy']:.0f}%")
    cost = f" = {result.seconds / step_seconds:.1f} train steps" if step_seconds else ""
    return f"eval step {result.step}: " + ", ".join(parts) + f" ({result.seconds:.1f}s{cost})"
