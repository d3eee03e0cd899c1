"""Workers that torchrun restarts (``--max_restarts``): a process group that starts clean.

Since torch 2.5 torchrun's agent shares its own TCPStore with its workers
(``TORCHELASTIC_USE_AGENT_STORE=True``), and that store outlives them: a
restarted attempt reads the keys the failed one wrote (gloo's peer addresses,
NCCL's unique id) and connects to processes that are gone ("Gloo connectFullMesh
failed ... Connection refused"; pytorch/pytorch#135712, #167288). Two cures:

* one agent (``--standalone``, ``--nnodes 1``): the process group's keys go under
  a prefix per attempt, ``TORCHELASTIC_RESTART_COUNT``, which the one agent raises
  at every restart (:func:`process_group_store`);
* several agents: each agent counts its own restarts, and a restart for a
  membership change (a peer node re-joining) is not counted; seen here with two
  agents, the restarted attempt ran as attempt 0 on one node and 1 on the
  other, so no worker can name the attempt. Started with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the launchers in ``scripts/`` set
  it), the agents give the workers of every rendezvous round a new store, on a
  new port, served by that round's rank 0; :func:`restart_store_problem` says
  when that setting is missing.

Either way every key of the group's start (the default group's and each
sub-group's, gloo's addresses as NCCL's unique ids) lives in a store no earlier
attempt wrote: it holds for any backend.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

__all__ = ["restart_attempt", "max_restarts", "process_group_store", "restart_store_problem",
           "shown_in_earlier_attempt"]


def restart_attempt() -> int:
    """This agent's restart count: 0 in the first attempt (and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def max_restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))


def _shares_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _agents() -> int:
    return int(os.environ.get("GROUP_WORLD_SIZE", 1))


def process_group_store(timeout: timedelta) -> tuple[dist.Store, int, int] | None:
    """(store, rank, world size) for ``init_process_group`` under one torchrun agent
    that shares its store: torchrun's env rendezvous, keys under this attempt's
    prefix. None elsewhere (``init_process_group``'s own env rendezvous is right)."""
    if not _shares_agent_store() or _agents() != 1:
        return None
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"attempt_{restart_attempt()}", store), rank, world


def restart_store_problem() -> str | None:
    """Why a restart of this job could not start its process group, or None."""
    if max_restarts() == 0 or not _shares_agent_store() or _agents() == 1:
        return None
    return (f"torchrun may restart this job (max_restarts={max_restarts()}) but its {_agents()} agents "
            f"share their store with the workers, where a restarted attempt finds the failed one's "
            f"addresses and cannot start; start every agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            f"(scripts/multinode_torchrun.sh and scripts/slurm_multinode.sbatch set it)")


def shown_in_earlier_attempt(message: str) -> bool:
    """Whether an earlier attempt of this torchrun agent printed ``message``; records it.

    A failure no restart can fix (a config error, a checkpoint that cannot be
    loaded) repeats in every attempt: it is shown once, and the repeats say so in
    a few words. The record is a file in the agent's log folder of this run,
    ``<log_dir>/<run_id>/`` (it holds ``attempt_<k>/<local_rank>/error.json``, the
    path torchrun gives as ``TORCHELASTIC_ERROR_FILE``): it lives exactly as long
    as the run. Outside torchrun nothing is recorded.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or not Path(error_file).parents[1].name.startswith("attempt_"):
        return False
    record = Path(error_file).parents[2] / "ulysses_dtensor_reported.txt"
    line = " ".join(message.split())
    try:
        if record.is_file() and line in record.read_text().splitlines():
            return True
        with open(record, "a") as fh:
            fh.write(line + "\n")
    except OSError:  # a read-only log folder: show every time
        pass
    return False
