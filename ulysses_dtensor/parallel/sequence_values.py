"""Per-token values of a sequence-sharded model joined over the sp ranks: whole sequences,
or per-sequence sums and means, on every rank of the group.

Policy-gradient and preference losses are functions of whole sequences: a sequence's
log-probability is the sum over all its tokens, GRPO normalises by each sequence's
token count, GSPO's importance ratio is a per-sequence mean. Under sequence
parallelism each rank holds the per-token values of its slice
(:mod:`~ulysses_dtensor.memory.token_logprobs`); these blocks join them.

The convention is **whole values, own gradients**: every sp rank of a group gets the
same whole value (the sum, or the gathered sequence), but its gradient flows only into
this rank's own tokens. Each rank then computes the loss of the whole sequences (the
same number on every sp rank), and since the total derivative is the sum of the
partial ones, the gradients summed over the sp ranks -- which FSDP2 does when the
parameters are sharded over ``dp_shard x sp`` with a divide factor of 1 -- are the
loss's gradient, exactly. (With ``dp`` data-parallel groups each computing its own
loss, divide each rank's loss by ``dp`` for their mean.) No collective runs in
backward. :func:`~ulysses_dtensor.parallel.loss.sp_cross_entropy` follows the other
convention (each rank returns a share, the shares sum to the loss); both give the
same gradients.

* :func:`sp_gather_tokens`: ``(B, S/sp, ...)`` slices -> ``(B, S, ...)`` on every rank
  (the ring's load-balanced layout undone);
* :func:`sp_sequence_sums`: per-sequence sums of per-token values (and token counts)
  over the whole sequence; :func:`sp_sequence_means` divides them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .mesh import ring_degree
from .ring_layout import layout_indices

__all__ = ["own_gradient", "sp_gather_tokens", "sp_sequence_means", "sp_sequence_sums"]


def own_gradient(local: Tensor, whole: Tensor) -> Tensor:
    """``whole``'s value with ``local``'s gradient: ``local + (whole - local)`` with the
    difference detached (``whole`` is ``local`` reduced with the other ranks')."""
    return local + (whole - local).detach()


def _group(mesh: DeviceMesh | None):
    return None if mesh is None or mesh.size() == 1 else mesh.get_group()


def sp_gather_tokens(local: Tensor, sp_mesh: DeviceMesh | None, seq_len: int | None = None) -> Tensor:
    """This rank's ``(B, S_pad/sp, ...)`` slice of per-token values -> the whole
    ``(B, seq_len, ...)`` sequence on every rank of ``sp_mesh`` (the slices in sequence
    order, the ring layout undone, the padding cut; ``seq_len`` None: keep it all).
    Only this rank's slice carries gradients (see the module doc)."""
    group = _group(sp_mesh)
    if group is None:
        whole = local
    else:
        size = sp_mesh.size()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.detach().contiguous(), group=group)
        parts[sp_mesh.get_local_rank()] = local
        whole = torch.cat(parts, dim=1)
    ring = ring_degree(sp_mesh)
    if ring > 1:
        order = layout_indices(whole.shape[1], ring, whole.device)
        whole = whole.index_select(1, torch.argsort(order))  # slot order -> sequence order
    return whole if seq_len is None else whole[:, :seq_len]


def sp_sequence_sums(values: Tensor, sp_mesh: DeviceMesh | None, *, sequence_ids: Tensor | None = None,
                     num_sequences: int | None = None, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-sequence sums of ``values`` ``(B, s_local)`` over the whole sequences, and
    their token counts, on every rank of ``sp_mesh``: ``(num_sequences,)`` float32 each.

    ``sequence_ids`` ``(B, s_local)``: the sequence each local token belongs to (``-1``:
    none, e.g. padding), for packed rows; None: each row is one sequence
    (``num_sequences = B``). ``mask``: the tokens that count (bool or 0/1). The sums
    carry this rank's gradients (see the module doc); the counts none."""
    b = values.shape[0]
    if sequence_ids is None:
        sequence_ids = torch.arange(b, device=values.device)[:, None].expand_as(values)
        num_sequences = b if num_sequences is None else num_sequences
    elif num_sequences is None:
        raise ValueError("sp_sequence_sums: give num_sequences with sequence_ids (every rank the same number)")
    if sequence_ids.shape != values.shape:
        raise ValueError(f"sequence_ids {tuple(sequence_ids.shape)} must match values {tuple(values.shape)}")
    keep = sequence_ids >= 0
    if mask is not None:
        keep = keep & mask.bool()
    ids = sequence_ids.masked_fill(~keep, 0).reshape(-1)
    weight = keep.reshape(-1).to(torch.float32)
    local = torch.zeros(num_sequences, dtype=torch.float32, device=values.device).index_add(
        0, ids, values.reshape(-1).float() * weight)
    counts = torch.zeros(num_sequences, dtype=torch.float32, device=values.device).index_add(0, ids, weight)
    group = _group(sp_mesh)
    if group is None:
        return local, counts
    both = torch.cat([local.detach(), counts])
    dist.all_reduce(both, group=group)
    return own_gradient(local, both[:num_sequences]), both[num_sequences:]


def sp_sequence_means(values: Tensor, sp_mesh: DeviceMesh | None, **kwargs) -> Tensor:
    """Per-sequence means (:func:`sp_sequence_sums` divided by the counts; 0 for a
    sequence without tokens)."""
    sums, counts = sp_sequence_sums(values, sp_mesh, **kwargs)
    return sums / counts.clamp(min=1.0)
