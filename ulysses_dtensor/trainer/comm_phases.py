"""Which ``[comm]`` timeout bounds each phase of a run, and the line a lost peer prints.

Phases that may wait long for a slow peer, legitimately, run under
``comm.init_timeout_seconds``: start-up (process group, data check, mesh, model,
checkpoint load), the first step after a start or restart (compilation, lazy
communicator set-up), checkpoint saves, evaluation and the final barrier. Every
other step runs under ``comm.train_timeout_seconds``. The timeout is switched on
every process group at the phase boundary (:func:`set_collective_timeout`;
gloo and NCCL both read it per collective), not per collective: a few calls a
step, nothing in the hot path.

A collective that fails because a peer died or went silent, anywhere in the
run, leaves :meth:`CommPhases.lost_peer_as_error` as one :class:`PeerLostError`
naming the step and phase; the entry point prints it and exits non-zero, so
torchrun restarts the job or stops it.
"""

from __future__ import annotations

import contextlib

from torch.distributed.checkpoint.api import CheckpointException

from ..runtime.lost_peer import (
    PeerLostError,
    is_peer_failure,
    peer_lost,
    set_collective_timeout,
)
from .config_schema import Comm

__all__ = ["CommPhases"]


class CommPhases:
    """Tracks the run's phase; sets its timeout when the run owns the process group."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.sets_timeouts = False  # a caller's process group keeps the caller's timeouts
        self.phase, self.step, self.long = "start-up", None, True

    def enter(self, phase: str, step: int | None = None, *, long: bool = False) -> None:
        """From here on, ``phase`` (of ``step``); also covers process groups made since the last call."""
        self.phase, self.step, self.long = phase, step, long
        if self.sets_timeouts:
            set_collective_timeout(self.comm.init_timeout_seconds if long else self.comm.train_timeout_seconds)

    @contextlib.contextmanager
    def lost_peer_as_error(self):
        try:
            yield
        except PeerLostError:  # already one line (its words would match a timeout)
            raise
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            if is_peer_failure(e):
                raise peer_lost(e, self._where(), self._timeout_key()) from e
            raise

    def _where(self) -> str:
        return f"during {self.phase}" if self.step is None else f"at step {self.step} ({self.phase})"

    def _timeout_key(self) -> str | None:
        if not self.sets_timeouts:
            return None
        key = "init_timeout_seconds" if self.long else "train_timeout_seconds"
        return f"comm.{key}={getattr(self.comm, key)}"
