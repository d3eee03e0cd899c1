"""Counting the plain ``c10d`` collectives of a training step (FSDP2's all-gathers and
reduce-scatters): calls, and the bytes this rank sends, for ``bench_train.py``'s records
and the modelled communication of a simulated step."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FsdpTraffic"]


class FsdpTraffic(TorchDispatchMode):
    """Counts ``c10d::*`` collectives (what FSDP2 issues) and the bytes this rank sends.

    Per op, bytes that leave this rank in a ring over the op's group of N:
    all-gather: N-1 input shards; reduce-scatter: N-1 output shards;
    all-reduce: 2(N-1)/N of the buffer; anything else: its input. The
    functional collectives (the Ulysses all-to-all) are left to
    ``CollectiveCounter``.
    """

    # op name -> (index of the tensor that sizes it, kind)
    _OPS = {
        "_allgather_base_": (1, "all_gather"),
        "allgather_into_tensor_coalesced_": (1, "all_gather"),
        "_reduce_scatter_base_": (0, "reduce_scatter"),
        "reduce_scatter_tensor_coalesced_": (0, "reduce_scatter"),
        "allreduce_": (0, "all_reduce"),
        "allreduce_coalesced_": (0, "all_reduce"),
    }

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.sent: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            name = func._overloadpacket.__name__
            if name not in ("barrier", "monitored_barrier_"):
                idx, kind = self._OPS.get(name, (0, name))
                nbytes = sum(t.numel() * t.element_size() for t in _tensors(args[idx] if len(args) > idx else []))
                n = _group_size(args)
                if kind in ("all_gather", "reduce_scatter"):
                    sent = nbytes * (n - 1)
                elif kind == "all_reduce":
                    sent = 2 * nbytes * (n - 1) // n
                else:
                    sent = nbytes
                self.calls[kind] = self.calls.get(kind, 0) + 1
                self.sent[kind] = self.sent.get(kind, 0) + sent
        return func(*args, **kwargs)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _group_size(args) -> int:
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, torch.ScriptObject):
            with contextlib.suppress(Exception):
                return dist.ProcessGroup.unbox(a).size()
    return dist.get_world_size()
