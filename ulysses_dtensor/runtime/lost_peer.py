"""A peer rank that died or stopped answering: bounded waits, and one line that says so.

A collective waits for every rank of its group. When one rank dies, hangs or
loses its network, the others wait: 30 minutes on gloo, 10 on NCCL, on every
device of the job. Two pieces bound that wait and name it.

:func:`set_collective_timeout` sets the timeout of every process group that
exists: the default group, and each sub-group a ``DeviceMesh`` made (sub-groups
do NOT inherit the timeout given to ``init_process_group``: measured here, a
mesh's gloo group kept the 30-minute default). gloo applies it to each
collective started afterwards, NCCL's watchdog to each collective it watches, so
a caller can give the phases that legitimately wait long (start-up, checkpoint
saves, evaluation) a longer bound than the steps between them.

:func:`peer_lost` turns a collective that failed that way (timed out, or its
peer's connection closed) into a :class:`PeerLostError` of one line naming where
it happened and the collective, instead of a backend traceback on every rank.
On NCCL a timed-out collective is ended by the watchdog, which by default
(torchrun sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``) terminates the process
after logging the collective: the bound holds there too, and the line is NCCL's.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.distributed_c10d import (
    _rank_not_in_group,
    _set_pg_timeout,
    _world,
)

__all__ = ["PeerLostError", "is_peer_failure", "peer_lost", "set_collective_timeout"]

# torch > 2.13 has it public (pytorch PR #187387); 2.13 has the same function private.
_set_timeout = getattr(dist, "set_timeout", None) or _set_pg_timeout

# What gloo, NCCL and the c10d store say when a peer is gone or silent.
_LOST = re.compile(r"timed out|timeout|connection (?:closed|reset|refused)|broken pipe|"
                   r"communicator was aborted|connectFullMesh", re.IGNORECASE)


class PeerLostError(RuntimeError):
    """A collective failed because a peer rank died or stopped answering (a one-line message)."""


def set_collective_timeout(seconds: float) -> None:
    """Bound every collective of every existing process group of this rank by ``seconds``."""
    timeout = timedelta(seconds=seconds)
    for group in list(_world.pg_map):
        if not _rank_not_in_group(group):
            _set_timeout(timeout, group)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective (or store) that timed out or lost its peer."""
    if isinstance(exc, CheckpointException):  # DCP gathers every rank's failure into one
        return any(is_peer_failure(e) for e, _ in exc.failures.values())
    # gloo raises plain RuntimeErrors, NCCL and the store torch.distributed.DistError's subclasses of it.
    return isinstance(exc, RuntimeError) and bool(_LOST.search(str(exc)))


def peer_lost(exc: BaseException, where: str, timeout: str | None = None) -> PeerLostError:
    """The one-line error for ``exc``; ``where``: "at step 10 (training step)";
    ``timeout``: the setting that bounded the wait, e.g. "comm.train_timeout_seconds=300"."""
    detail = _backend_words(exc)
    if re.search(r"timed out|timeout", detail, re.IGNORECASE):
        cause = f"no answer from a peer rank within {timeout or 'the timeout'}"
    else:
        cause = "a peer rank's process is gone"
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "0")
    return PeerLostError(f"lost a peer rank: rank {rank} {where}, in {_collective(exc)}: {cause} [{detail}]")


def _backend_words(exc: BaseException) -> str:
    """The backend's own sentence, without its source path and advice."""
    if isinstance(exc, CheckpointException):
        exc = next(e for e, _ in exc.failures.values() if is_peer_failure(e))
    line = next((ln for ln in str(exc).splitlines() if _LOST.search(ln)), str(exc).strip() or type(exc).__name__)
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line.strip())
    return line.split(". ")[0][:200]


def _collective(exc: BaseException) -> str:
    """The innermost torch.distributed function the failure went through (the collective
    or the wait on it), else the innermost Python function."""
    name, last = None, "a collective"
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        last = code.co_name
        if "torch/distributed/" in code.co_filename.replace(os.sep, "/") and code.co_name != "wrapper":
            name = code.co_name
        tb = tb.tb_next
    return name or last
