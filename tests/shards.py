"""Parity shard by shard: a rank's part of a reference tensor, cut without a collective."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["reference_part"]


def reference_part(full, like):
    """The part of the single-process reference tensor ``full`` that ``like`` holds on this rank.

    A parity test can compare each rank's shards (``like.to_local()``) with
    these parts: together the ranks compare every element, with no all-gather
    per parameter (about 90 a mesh for the debug Llama, each a collective of
    every rank). DTensor's own placement rules cut the part, so FSDP's uneven and
    strided shards and TP's come out as the ranks hold them. A plain tensor is
    returned whole.
    """
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
