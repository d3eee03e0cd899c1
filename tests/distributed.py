"""Run a function on N CPU ranks (gloo) from a test.

Each rank is a spawned process; an exception on any rank fails the test with
that rank's traceback. A FileStore rendezvous avoids port clashes between
tests, and the timeout turns a collective hang into a failure.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ulysses_dtensor.runtime import exit_process, finish_together

TIMEOUT = datetime.timedelta(seconds=180)


def _entry(rank: int, world_size: int, store_path: str, fn, args) -> None:
    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,
    )
    with finish_together():
        fn(rank, world_size, *args)
    exit_process(0)  # done and flushed: skip the teardown that can abort (see runtime)


def run_ranks(world_size: int, fn, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    ``fn`` must be a module-level function (it is pickled by reference).
    """
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _entry,
            args=(world_size, store, fn, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
