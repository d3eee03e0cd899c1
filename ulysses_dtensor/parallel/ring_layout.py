"""The ring's sequence layout: causal load balancing, and packed documents' edges.

Ring attention over ``ring`` ranks cuts the sequence into ``2 * ring`` equal
chunks and gives ring rank ``r`` chunks ``r`` and ``2*ring-1-r`` (head and
tail, mirrored), so every rank does the same causal work.
:func:`layout_indices` is that order (PyTorch's ``_HeadTailLoadBalancer``);
``shard_batch`` applies it to a batch after shifting the labels and before
slicing, so ring rank r's Ulysses group holds its two chunks, in order.

:class:`Documents` is what the ring needs to know about packed documents: in
the original order two different chunks share at most one document, found
at their facing edges, so attention between them is a slice over a slice; a
chunk against itself runs over its document runs. Both are read to the host
once per batch, never per layer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

from ..attention.documents import segment_ids

__all__ = ["Documents", "layout_indices", "layout_position_ids", "original_segment_ids", "seq_multiple"]


def seq_multiple(sp: int, ring: int) -> int:
    """What a sequence length must be a multiple of: sp slices and 2*ring chunks."""
    return sp if ring == 1 else math.lcm(sp, 2 * ring)


def layout_indices(seq_len: int, ring: int, device=None) -> Tensor:
    """(seq_len,) int64: slot i of the ring layout holds original token ``idx[i]``.

    Ring rank r's block is ``[chunk r, chunk 2*ring-1-r]`` of ``2*ring`` equal
    chunks; blocks follow each other in ring-rank order. ``ring=1``: identity.
    """
    if ring == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * ring):
        raise ValueError(
            f"the ring layout needs a sequence length divisible by 2*ring={2 * ring}, got "
            f"{seq_len}; pad it (shard_batch pads to a multiple of lcm(sp, 2*ring))"
        )
    return _HeadTailLoadBalancer(seq_len, ring, device)._generate_indices()[0].long()


def layout_position_ids(local_len: int, sp_rank: int, sp_size: int, ring: int, device=None) -> Tensor:
    """(local_len,) global positions of sp rank ``sp_rank``'s slots (one document per row)."""
    idx = layout_indices(local_len * sp_size, ring, device)
    return idx[sp_rank * local_len : (sp_rank + 1) * local_len]


def original_segment_ids(document_ids: Tensor, ring: int) -> Tensor:
    """Layout-order document ids -> segment ids in ORIGINAL order (0, 1, 2, ... per row).

    A document is a run of equal ids in the original order (as everywhere in
    this package); the layout splits runs, so runs are found on the restored
    order. The result is non-decreasing along each row.
    """
    s = document_ids.shape[1]
    idx = layout_indices(s, ring, document_ids.device)
    original = torch.empty_like(document_ids)
    original[:, idx] = document_ids
    return segment_ids(original)


class Documents:
    """Packed documents as the ring needs them: per chunk, per row, who is at its edges.

    ``seg`` (B, S): segment ids in original order, non-decreasing along a row;
    chunk ``p`` is tokens ``[p*C, (p+1)*C)``. Two different chunks share at most
    ONE document (a document spanning from one to the other covers everything
    between), found at their facing edges: with the key chunk earlier, the
    query chunk's leading run and the key chunk's trailing run. So a pair of
    different chunks is plain attention of a row prefix/suffix over a
    suffix/prefix: no mask. The edge runs are read to the host once per batch
    (one ``tolist``), the varlen runs of every chunk at their first use (one
    ``nonzero`` and one ``tolist``); every layer after reuses them.
    """

    def __init__(self, seg: Tensor, chunks: int):
        b, s = seg.shape
        self.seg = seg
        self.chunks = chunks
        self.c = s // chunks
        x = seg.view(b, chunks, self.c)
        first, last = x[..., 0], x[..., -1]
        lead = (x == first[..., None]).sum(-1)
        trail = (x == last[..., None]).sum(-1)
        self.first, self.last, self.lead, self.trail = torch.stack([first, last, lead, trail]).tolist()
        self._runs = None

    def chunk(self, p: int) -> Tensor:
        return self.seg[:, p * self.c : (p + 1) * self.c]

    def runs(self, p: int) -> tuple[Tensor, int]:
        """Chunk p's document runs over its flattened rows, as varlen takes them:
        (int32 cu_seqlens of shape (runs + 1,), the longest run)."""
        if self._runs is None:
            self._runs = _chunk_runs(self.seg, self.chunks)
        return self._runs[p]

    def shared(self, pq: int, pk: int) -> list[tuple[int, slice, slice]]:
        """(row, query rows, key rows) that attend between two different chunks."""
        out = []
        for b in range(len(self.first)):
            if pk < pq and self.first[b][pq] == self.last[b][pk]:
                out.append((b, slice(0, self.lead[b][pq]), slice(self.c - self.trail[b][pk], self.c)))
            elif pk > pq and self.last[b][pq] == self.first[b][pk]:
                out.append((b, slice(self.c - self.trail[b][pq], self.c), slice(0, self.lead[b][pk])))
        return out


def _chunk_runs(seg: Tensor, chunks: int) -> list[tuple[Tensor, int]]:
    """Every chunk's (cu_seqlens, longest run) at once: two host syncs in all."""
    b, s = seg.shape
    n = b * (s // chunks)  # tokens of one chunk over all rows
    x = seg.view(b, chunks, -1).transpose(0, 1)  # (chunks, B, C)
    starts = torch.ones(x.shape, dtype=torch.bool, device=seg.device)
    starts[..., 1:] = x[..., 1:] != x[..., :-1]  # a row's first token starts a run
    chunk_of, pos = starts.reshape(chunks, n).nonzero().unbind(1)  # sorted by chunk, then position
    # A run ends where the next one starts, or at the end of its chunk.
    end = torch.full_like(pos, n)
    same_chunk = chunk_of[1:] == chunk_of[:-1]
    end[:-1] = torch.where(same_chunk, pos[1:], n)
    longest = torch.zeros(chunks, dtype=pos.dtype, device=seg.device).scatter_reduce_(0, chunk_of, end - pos, "amax")
    counts, longest = torch.stack([starts.reshape(chunks, n).sum(1), longest]).tolist()
    tail = torch.tensor([n], dtype=pos.dtype, device=seg.device)
    return [
        (torch.cat([p, tail]).to(torch.int32), m) for p, m in zip(torch.split(pos, counts), longest)
    ]
