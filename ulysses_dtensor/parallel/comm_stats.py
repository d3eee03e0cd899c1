"""Count collectives and the bytes they move, for tests and benchmarks.

A TorchDispatchMode sees every functional collective (forward and the ones
autograd issues in backward) with its real input tensor, so counts and byte
totals come from what actually ran, not from a formula. Point-to-point
transfers are seen when they go through a functional ``all_to_all_single``
with uneven splits (what ring attention does): the bytes sent are those of
every split but this rank's own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.distributed as dist
from torch._ops import HigherOrderOperator
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that only wait for or describe a collective; not traffic.
_NOT_TRAFFIC = {"wait_tensor", "_wrap_tensor_autograd"}


@dataclass
class CollectiveRecord:
    op: str
    input_bytes: int
    group_size: int
    # all_to_all_single: bytes of the chunk this rank keeps (its own split).
    # Ring attention's point-to-point transfers are all-to-alls whose splits
    # are all zero but the next rank's, so they keep nothing.
    kept_bytes: int | None = None
    group_name: str = ""  # which process group (tells apart collectives of several meshes)

    @property
    def sent_bytes(self) -> int:
        """Bytes that leave this rank (the chunk kept locally by an all-to-all is free)."""
        if self.op == "all_to_all_single":
            if self.kept_bytes is not None:
                return self.input_bytes - self.kept_bytes
            return self.input_bytes * (self.group_size - 1) // self.group_size
        return self.input_bytes


@dataclass
class CollectiveCounter(TorchDispatchMode):
    records: list[CollectiveRecord] = field(default_factory=list)

    # Let higher-order ops (FlexAttention's kernel) through: without this a
    # dispatch mode makes them raise. They are passed on untouched.
    supports_higher_order_operators = True

    def __post_init__(self):
        super().__init__()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile compile under the counter (FlexAttention compiles
        # itself even in eager; compiled blocks): dynamo otherwise refuses to
        # trace while a user dispatch mode is active. Compiled code still calls
        # the collectives through the dispatcher, where they are counted.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if func.namespace == "_c10d_functional":
            name = func._overloadpacket.__name__
            if name not in _NOT_TRAFFIC:
                tensor = args[0]
                tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                group = _as_group(kwargs.get("group_name", args[-1]))
                kept = _kept_bytes(name, tensor, args, group) if name == "all_to_all_single" else None
                self.records.append(CollectiveRecord(name, nbytes, group.size(), kept, group.group_name))
        return func(*args, **kwargs)

    def counts(self) -> dict[str, int]:
        return dict(Counter(r.op for r in self.records))

    def sent_bytes(self, op: str | None = None) -> int:
        return sum(r.sent_bytes for r in self.records if op is None or r.op == op)

    def input_bytes(self, op: str | None = None) -> int:
        return sum(r.input_bytes for r in self.records if op is None or r.op == op)


def _kept_bytes(name, tensor, args, group) -> int | None:
    """Bytes of this rank's own split of an all_to_all_single (None: even splits)."""
    splits = args[2] if len(args) > 2 else None
    if not splits or tensor.shape[0] == 0:
        return None
    rank = dist.get_rank(group)
    row_bytes = tensor.numel() * tensor.element_size() // tensor.shape[0]
    return int(splits[rank]) * row_bytes


def _as_group(group):
    # Functional collectives pass a group name; some paths pass the group itself.
    return _resolve_process_group(group) if isinstance(group, str) else group
