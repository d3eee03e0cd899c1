"""Checkpoints with torch.distributed.checkpoint (DCP), safe against kills.

Layout of ``<dump_folder>/<checkpoint.folder>/``::

    step-200/            a complete checkpoint (has the COMPLETE marker)
        .metadata, __0_0.distcp, ...   model + optimizer, DCP (each rank its shards)
        train_state.json               step, data cursor, context stage, lr (global)
        model.json                     model args, source HF config, tokenizer (for export)
        rng/rank{r}.pt                 each rank's torch RNG state
        COMPLETE                       written last
    step-300.tmp/        a save in progress, or one a kill interrupted: ignored

A save writes everything into ``step-N.tmp``; after every rank has finished
(barrier) rank 0 writes ``COMPLETE`` into it and renames it to ``step-N``. A
folder is loaded only if its name is ``step-<int>`` and it holds the marker, so
a save interrupted at any point never looks complete. The folder must be on a
file system every rank sees (one shared path on multi-node runs).

Model and optimizer state go through
``torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict``, so
FSDP2 (DTensor) shards are saved as shards and loaded into whatever mesh the
resuming run has. With ``trainable_only`` (LoRA: a frozen base read from its
own files) only the parameters that train, and their optimizer state, are saved
and loaded; the frozen ones are the loading model's own.

A save first checks that every rank's weights and optimizer state are finite: a
checkpoint of NaN or inf is never written (:class:`NonFiniteError` instead).

A checkpoint that cannot be loaded (a damaged file, a model the config changed)
raises :class:`CheckpointError` on every rank, naming the folder, the rank and
the cause in one line: a torchrun restart would meet it again, so the entry
point shows it once instead of a DCP traceback per rank and attempt.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..runtime.lost_peer import is_peer_failure
from ..runtime.nonfinite import check_finite_state

__all__ = ["CheckpointManager", "CheckpointError", "COMPLETE_MARKER", "MODEL_INFO_FILE", "complete_steps",
           "load_model_weights"]

COMPLETE_MARKER = "COMPLETE"
MODEL_INFO_FILE = "model.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")


def _options(trainable_only: bool) -> StateDictOptions:
    # strict=False: the frozen parameters are not in a trainable-only checkpoint.
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


class CheckpointError(RuntimeError):
    """A complete checkpoint that cannot be loaded; the message names it and the cause."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_steps(folder: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in ``folder``, ascending."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for d in folder.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / COMPLETE_MARKER).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


@contextlib.contextmanager
def _single_process_ok():
    """Without a process group DCP saves/loads in one process; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _NoMetadataFallbackTracebacks(logging.Filter):
    """DCP (torch 2.13) logs each failed metadata read on the ROOT logger with its
    traceback, on every rank; when the load fails, CheckpointError says why in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.module == "state_dict_loader" and "metadata is not found" in record.getMessage())


@contextlib.contextmanager
def _dcp_load_quietly():
    with _single_process_ok():
        root, quiet = logging.getLogger(), _NoMetadataFallbackTracebacks()
        root.addFilter(quiet)
        try:
            yield
        finally:
            root.removeFilter(quiet)


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    """Save every ``interval`` steps and at the last step; keep the newest ``keep_latest_k``.

    ``train_state`` is a JSON-able dict of global (rank-independent) trainer
    state: it is written once, by rank 0.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        interval: int,
        keep_latest_k: int = 0,
        enable: bool = True,
        trainable_only: bool = False,
    ):
        if interval < 1:
            raise ValueError(f"checkpoint.interval={interval} must be >= 1")
        if keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k={keep_latest_k} must be >= 0")
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.enable = enable
        self.options = _options(trainable_only)

    # ------------------------------------------------------------- queries
    def path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (rank 0 decides, all ranks agree)."""
        steps = complete_steps(self.folder) if _rank() == 0 else None
        latest = [steps[-1] if steps else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(latest, src=0)
        return latest[0]

    def should_save(self, step: int, last_step: int) -> bool:
        return self.enable and (step % self.interval == 0 or step == last_step)

    # ---------------------------------------------------------------- save
    def save(
        self, step: int, model: torch.nn.Module, optimizer, train_state: dict, model_info: dict | None = None
    ) -> Path:
        """Save collectively (every rank calls it); returns the final folder.

        ``model_info`` (JSON-able: model args, source HF config, tokenizer) goes
        to ``model.json``, what ``python -m ulysses_dtensor.export`` reads.
        """
        rank = _rank()
        tmp = self.folder / f"step-{step}.tmp"
        final = self.path(step)
        # Never a checkpoint of NaN / inf: every rank checks its shards first (NonFiniteError).
        check_finite_state(model, optimizer, what=f"checkpoint {final}")
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        _barrier()

        model_sd, optim_sd = get_state_dict(model, optimizer, options=self.options)
        with _single_process_ok():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
        if rank == 0:
            _fsync_write(tmp / "train_state.json", json.dumps(train_state, indent=1))
            if model_info is not None:
                _fsync_write(tmp / MODEL_INFO_FILE, json.dumps(model_info, indent=1))
        _barrier()  # every rank's files are written

        if rank == 0:
            _fsync_write(tmp / COMPLETE_MARKER, f"step {step}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune(step)
        _barrier()  # nobody runs ahead of the rename
        return final

    def _prune(self, current: int) -> None:
        for d in self.folder.iterdir():
            m = _TMP_DIR.match(d.name)
            if m and int(m.group(1)) <= current:
                shutil.rmtree(d, ignore_errors=True)  # left by a killed save
        if self.keep_latest_k:
            for old in complete_steps(self.folder)[: -self.keep_latest_k]:
                shutil.rmtree(self.path(old), ignore_errors=True)

    # ---------------------------------------------------------------- load
    def load(self, step: int, model: torch.nn.Module, optimizer) -> dict:
        """Load the checkpoint of ``step`` into model/optimizer; return its train_state.

        Raises :class:`CheckpointError` on every rank when any rank fails to load it.
        """
        path = self.path(step)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER})")
        state, problem = None, None
        try:
            state = self._load(path, model, optimizer)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            if is_peer_failure(e):
                raise
            problem = _cause(e)
        problems = [problem]
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank learns every rank's verdict
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        bad = [(r, p) for r, p in enumerate(problems) if p is not None]
        if bad:
            rank, cause = bad[0]
            on = f" (on rank {rank})" if len(problems) > 1 and len(bad) < len(problems) else ""
            raise CheckpointError(
                f"{path} cannot be loaded{on}: {cause}; it is the newest complete checkpoint of "
                f"{self.folder}, so every restart meets it again: move it out of that folder to resume "
                f"from the one before, or start the job in another job.dump_folder"
            )
        return state

    def _load(self, path: Path, model: torch.nn.Module, optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self.options)
        state = {"model": model_sd, "optim": optim_sd}
        with _dcp_load_quietly():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=self.options
        )
        rng = path / "rng" / f"rank{_rank()}.pt"
        if rng.is_file():  # absent when resuming on more ranks than saved
            _set_rng_state(torch.load(rng, weights_only=True))
        with open(path / "train_state.json") as fh:
            return json.load(fh)


def _cause(exc: BaseException) -> str:
    """One line for why a load failed: the first failing rank's exception under DCP's wrapper."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = exc.failures[min(exc.failures)][0]
    words = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {words[:300]}" if words else type(exc).__name__


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module, *, trainable_only: bool = False) -> None:
    """Load only the model state of the checkpoint folder ``path`` (every rank calls it).

    For evaluation: no optimizer is built, and DCP reshards the saved shards
    into whatever mesh ``model`` is parallelized on. ``trainable_only``: the
    checkpoint of a LoRA run (its adapters; the base is the model's own).
    """
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER})")
    options = _options(trainable_only)
    state = {"model": get_model_state_dict(model, options=options)}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=options)
