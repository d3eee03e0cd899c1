"""Per-step training metrics: console line, ``metrics.jsonl``, optional TensorBoard and
Weights & Biases.

Three kinds of figure, and the field names say which:

* the same on every mesh (1 process or any dp x sp): ``loss`` (token mean over
  the whole global batch: the sum of every rank's share), ``grad_norm`` (of the
  full gradients), ``lr``, ``seq_len``, ``batch_size`` (sequences of the global
  batch) and ``tokens_seen`` (tokens of the global batches so far, each counted
  once: not multiplied by sp, not divided by dp);
* per device, named ``*_per_device``: ``tps_per_device`` (the global tokens/s
  over the world size) and ``peak_memory_gib_per_device`` (the highest peak of
  any one device: CUDA max allocated, or on CPU the process's max resident set);
* timing: ``step_time``, ``time``, ``tps`` (global tokens/s), ``mfu``, and with
  sp > 1 (eager) rank 0's time in the Ulysses all-to-alls (``exchange_ms``,
  split ``exchange_fwd_ms`` / ``exchange_bwd_ms``) and its share of the step's
  wall time (``exchange_share``); see :mod:`ulysses_dtensor.parallel.comm_timing`.

From the global tokens of the step (``batch_size x seq_len``), its wall time and
the world size::

    tps            = batch_size * seq_len / step_time
    tps_per_device = tps / world_size
    mfu            = tps_per_device * flops_per_token(seq_len) / peak_flops

A step skipped because its loss or gradient norm was not finite (its update not
applied, see :mod:`ulysses_dtensor.runtime.nonfinite`) has a row too, with
``skipped: true`` and ``skip_reason`` (what was not finite, on which ranks); its
``loss`` / ``grad_norm`` are null when not finite (JSON has no NaN).

With ``metrics.enable_wandb`` rank 0 also logs each row to a Weights & Biases run (the
same fields and values, nulls left out, at the row's step), named after the job's dump
folder with the config attached; ``WANDB_PROJECT`` (default ``ulysses_dtensor``),
``WANDB_ENTITY``, ``WANDB_NAME`` (or torchtitan's ``WANDB_RUN_NAME``), ``WANDB_MODE``
(``offline``: files only, under the dump folder's ``wandb/``) are read as wandb reads them.

``flops_per_token`` is the model's (matmuls + causal attention at the step's
sequence length, forward and backward). Peaks are dense bf16: H100 and H200
989e12, A100 312e12; elsewhere (CPU) MFU is null unless ``metrics.peak_flops``
is set.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["MetricsLogger", "drop_rows_after", "peak_flops_for", "peak_memory_gib", "progress_bar"]

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
TENSORBOARD_MSG = (
    "metrics.enable_tensorboard=true needs the 'tensorboard' package: pip install tensorboard"
)
WANDB_PROJECT = "ulysses_dtensor"  # when WANDB_PROJECT is not set


def peak_flops_for(device: torch.device, override: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: ``override`` if set, else a known GPU's bf16 peak."""
    if override:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_FLOPS.items():
            if key in name:
                return value
    return None


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory on ``device``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def progress_bar(step: int, total: int, width: int = 20) -> str:
    done = min(width, int(width * step / max(total, 1)))
    return "[" + "#" * done + "." * (width - done) + "]"


def _fmt_count(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def drop_rows_after(path: Path, step: int) -> int:
    """Drop the rows of ``path`` (JSON lines with a ``step``) past ``step``; return how many.

    A run resumed from the checkpoint of ``step`` trains the later steps again:
    the rows a killed attempt logged for them are replaced, never doubled.
    """
    if not path.exists():
        return 0
    keep, dropped = [], 0
    with open(path) as fh:
        for line in fh:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
                else:
                    dropped += 1
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    with open(path, "w") as fh:
        fh.writelines(keep)
    return dropped


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` of any rank (a collective when the world has several)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class MetricsLogger:
    """Rank 0 writes. Every rank calls :meth:`log` each step (with its own
    numbers): the per-device memory is a maximum over the ranks.

    A run that continues a dump folder (``resume_step`` > 0, or rows there from an
    attempt that died before its first checkpoint) drops the rows past
    ``resume_step`` and marks its first row with ``resumed_from_step`` and
    ``rows_replaced`` (how many rows of the steps it trains again were dropped):
    where a restart happened, and nothing logged twice.
    """

    def __init__(
        self,
        dump_folder: str | os.PathLike,
        *,
        rank: int,
        world_size: int,
        total_steps: int,
        device: torch.device,
        flops_per_token=None,
        log_freq: int = 1,
        peak_flops: float = 0.0,
        enable_tensorboard: bool = False,
        show_progress: bool = True,
        resume_step: int = 0,
        wandb_run: dict | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.total_steps = total_steps
        self.device = device
        self.flops_per_token = flops_per_token
        self.log_freq = log_freq
        self.peak_flops = peak_flops_for(device, peak_flops)
        self.show_progress = show_progress
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        self._resume_mark: dict = {}
        if rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replaced = drop_rows_after(self.path, resume_step)
        if resume_step or replaced:
            self._resume_mark = {"resumed_from_step": resume_step, "rows_replaced": replaced}
        if enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(TENSORBOARD_MSG) from None
            # purge_step hides the events a killed attempt wrote for the steps trained again.
            purge = {"purge_step": resume_step + 1} if self._resume_mark else {}
            self.tb = SummaryWriter(log_dir=str(Path(dump_folder) / "tb"), **purge)
        if wandb_run is not None:
            self.wandb = _start_wandb(Path(dump_folder), **wandb_run)

    def log(
        self,
        *,
        step: int,
        seq_len: int,
        batch_size: int,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens_seen: int,
        step_tokens: int,
        step_time: float,
        extra: dict | None = None,
    ) -> dict | None:
        memory = max_over_ranks(peak_memory_gib(self.device), self.device)
        if self.rank != 0:
            return None
        tps = step_tokens / step_time if step_time > 0 else float("nan")
        per_device = tps / self.world_size
        mfu = None
        if self.peak_flops and self.flops_per_token is not None:
            mfu = per_device * self.flops_per_token(seq_len) / self.peak_flops
        row = {
            "step": step,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_seen": tokens_seen,
            "tps": tps,
            "tps_per_device": per_device,
            "mfu": mfu,
            "peak_memory_gib_per_device": memory,
            "step_time": step_time,
            "time": time.time(),
        }
        if extra:
            row.update(extra)
        row.update(self._resume_mark)
        self._resume_mark = {}
        written = _finite(row)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(written) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in written.items() if k != "step" and v is not None}, step=step)
        if self.tb is not None:
            for key in ("loss", "grad_norm", "lr", "tps", "tps_per_device", "mfu",
                        "peak_memory_gib_per_device", "seq_len", "exchange_ms", "exchange_share"):
                if row.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", row[key], step)
        if row.get("skipped"):
            print(f"step {step}/{self.total_steps} skipped (update not applied), non-finite: {row['skip_reason']}",
                  flush=True)
        elif step % self.log_freq == 0 or step == self.total_steps:
            print(self.format(row), flush=True)
        return row

    def format(self, row: dict) -> str:
        bar = f"{progress_bar(row['step'], self.total_steps)} " if self.show_progress else ""
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        a2a = f" a2a {100 * row['exchange_share']:.1f}%" if row.get("exchange_share") is not None else ""
        return (
            f"{bar}step {row['step']:>{len(str(self.total_steps))}}/{self.total_steps} "
            f"seq {row['seq_len']} loss {row['loss']:.4f} gnorm {row['grad_norm']:.3f} "
            f"lr {row['lr']:.2e} tok/s {_fmt_count(row['tps'])} "
            f"({_fmt_count(row['tps_per_device'])}/dev) mfu {mfu} "
            f"mem {row['peak_memory_gib_per_device']:.2f}GiB/dev seen {_fmt_count(row['tokens_seen'])}{a2a}"
        )

    def close(self, failed: bool = False) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if failed else 0)
            self.wandb = None


def _start_wandb(dump_folder: Path, *, name: str, config: dict, notes: str = ""):
    """A wandb run for this job (rank 0): its files under the dump folder."""
    import wandb  # checked by the config (metrics.enable_wandb): installed

    return wandb.init(
        project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
        name=os.environ.get("WANDB_NAME") or os.environ.get("WANDB_RUN_NAME") or name,  # torchtitan's, wandb's
        notes=notes or None,
        config=config,
        dir=str(dump_folder),
    )


def _finite(row: dict) -> dict:
    """JSON has no NaN/inf: write them as null."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
    }
