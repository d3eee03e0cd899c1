"""Process-group lifetime shared by the trainer, examples, benchmarks and tests."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


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
