"""Rank 0 of a test world compiles each graph first; its peers then load the result.

The ranks of a test world are processes on one machine that share one TMPDIR,
so inductor's on-disk caches (FxGraphCache, AOTAutogradCache) are shared. Left
alone, every rank generates and builds the same C++ kernels at the same time:
half a minute of CPU per rank for the debug model's block on 2 cores, the
largest single cost of the suite's one inductor test. Here a peer waits at the
start of each of its compilations until rank 0 has finished the same one, then
finds it in the caches (about a second). Every rank still traces its own graph
and runs the compiled code it loaded, and each waits after every collective
that precedes its compile, so no collective is held up by the turn.

Only for the CPU test worlds (one machine). A cluster's ranks do not share a
disk cache; nothing in the library relies on this.
"""

from __future__ import annotations

import contextlib
import datetime
import uuid

import torch.distributed as dist
from torch._dynamo.callback import callback_handler

# Rank 0's compile of the debug block takes about 50 s on an idle 2-core
# machine; twice that under the suite's load still fits.
WAIT = datetime.timedelta(seconds=600)

__all__ = ["rank_zero_compiles_first"]


@contextlib.contextmanager
def rank_zero_compiles_first():
    """Within the block, rank r > 0 starts its k-th compilation only once rank 0 ended its k-th.

    Every rank of the world enters the block (it broadcasts its key) and must
    compile the same graphs in the same order, as a symmetric SPMD step does: a
    rank that compiles more than rank 0 waits ``WAIT`` and fails.
    """
    rank = dist.get_rank()
    tag = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(tag, src=0)  # keys of this block only: the pool's store outlives tasks
    store = dist.PrefixStore(f"compile_turns/{tag[0]}/", dist.distributed_c10d._get_default_store())
    started, ended = [0], [0]

    def on_start(_args) -> None:
        if rank != 0:
            store.wait([str(started[0])], WAIT)
        started[0] += 1

    def on_end(_args) -> None:
        # Also after a failed compile: the peers then fail on their own.
        if rank == 0:
            store.set(str(ended[0]), "done")
        ended[0] += 1

    callback_handler.register_start_callback(on_start)
    callback_handler.register_end_callback(on_end)
    try:
        yield
    finally:
        callback_handler.remove_start_callback(on_start)
        callback_handler.remove_end_callback(on_end)
