"""Process-group lifetime shared by the trainer, examples, benchmarks and tests."""

from __future__ import annotations

import contextlib
import os
import sys

import torch.distributed as dist


def process_group_backend(device_type: str, cpu_collectives: bool = False) -> str:
    """gloo on CPU, nccl on CUDA; ``cpu_collectives`` adds gloo beside nccl for CPU
    tensors (host-offloaded parameters meet in the gradient-norm reduction)."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


@contextlib.contextmanager
def finish_together():
    """Destroy the process group on exit; after a barrier when the body succeeded.

    A rank that tears down its gloo group while a peer is still exchanging
    with it aborts the peer ("terminate called without an active
    exception"). After an error the barrier is skipped: the peers may never
    reach it, and the error should surface rather than a timeout.
    """
    try:
        yield
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """Flush and end a finished rank's process without interpreter teardown.

    Seen here on loaded CPU machines (about 1 spawn in 100, 0 in 30 when
    idle): a rank that finished its work and destroyed its process group
    still aborted during interpreter shutdown with "terminate called without
    an active exception", when C++ worker threads of the gloo groups were torn
    down. The mechanism described upstream (pytorch/pytorch PR 179291, not
    merged): gloo worker threads can still hold finished work objects whose
    tensors are released during interpreter finalization, and that release
    needs the GIL of an interpreter being torn down. That turns a finished
    job into a failure. A rank whose work is done
    and flushed has nothing left for the teardown to do, so it skips it.
    Only for ``__main__`` entry points and spawned workers, never in library
    code.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
