"""Packed documents: ids, segments and ``cu_seqlens``, and a per-batch cache.

Packed documents are described by ``document_ids`` of shape ``(batch, seq)``. A
document is a maximal run of equal ids inside a row (rows always end a
document), so a dense mask, a flex block mask and varlen ``cu_seqlens`` all see
the same segmentation. Pure tensor code: runs on any device, no host sync
except where a Python int is asked for. It sits in ``attention/``, the lowest
block that needs it, so that the kernels, the exchange and ring (``parallel/``),
the batch slicing and the token mixers all import it downward.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

__all__ = [
    "cached_for_documents",
    "cu_seqlens",
    "cu_seqlens_from_document_ids",
    "document_ids_from_position_ids",
    "segment_ids",
]


def document_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    """(B, S) positions restarting at 0 per document -> (B, S) int64 document ids.

    A document starts at the first token of a row, where the position is 0, or
    where the position does not follow its left neighbour by exactly 1.
    """
    if position_ids.dim() != 2:
        raise ValueError(
            f"position_ids must have shape (batch, seq); got {tuple(position_ids.shape)}"
        )
    pos = position_ids.long()
    starts = pos == 0
    starts[:, 1:] |= pos[:, 1:] != pos[:, :-1] + 1
    starts[:, 0] = True
    return starts.long().cumsum(dim=1) - 1


def segment_ids(document_ids: Tensor) -> Tensor:
    """Renumber to 0, 1, 2, ... per row, one id per run of equal document ids.

    Makes the dense mask / flex mask (which compare ids) agree with cu_seqlens
    (which cut at id changes) for any input, without a host sync to validate it.
    """
    changes = document_ids[:, 1:] != document_ids[:, :-1]
    seg = torch.zeros(document_ids.shape, dtype=torch.long, device=document_ids.device)
    seg[:, 1:] = changes.long().cumsum(dim=1)
    return seg


def cu_seqlens(document_ids: Tensor) -> Tensor:
    """int32 cumulative document lengths over the flattened batch (no host sync)."""
    b, s = document_ids.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_idx = starts.flatten().nonzero().flatten()
    end = torch.tensor([b * s], dtype=start_idx.dtype, device=start_idx.device)
    return torch.cat([start_idx, end]).to(torch.int32)


def cu_seqlens_from_document_ids(document_ids: Tensor) -> tuple[Tensor, int]:
    """(B, S) document ids -> (cu_seqlens int32 of shape (num_docs + 1,), max_seqlen).

    The batch is flattened into one packed sequence; a row boundary always ends a
    document, so documents never span rows. ``max_seqlen`` is a Python int, which
    costs one host sync on CUDA.
    """
    if document_ids.dim() != 2:
        raise ValueError(
            f"document_ids must have shape (batch, seq); got {tuple(document_ids.shape)}"
        )
    cu = cu_seqlens(document_ids)
    return cu, int((cu[1:] - cu[:-1]).max().item())


# A model calls attention once per layer with the same document_ids tensor; the
# derived structures (flex block mask, cu_seqlens + max_seqlen, which needs a host
# sync, the ring's chunk edges) are built once per batch and reused. Keyed on the
# tensor object and its version counter, so an in-place edit or a new batch
# invalidates the entry; within a batch one value per ``extra`` key, so layers
# that alternate patterns (sliding and full: gpt-oss, Gemma3) build each once.
DOC_CACHE: dict[str, tuple] = {}


def cached_for_documents(kind: str, document_ids: Tensor, extra: tuple, build):
    if torch.compiler.is_compiling():
        return build()
    hit = DOC_CACHE.get(kind)
    if hit is None or hit[0]() is not document_ids or hit[1] != document_ids._version:
        hit = (weakref.ref(document_ids), document_ids._version, {})
        DOC_CACHE[kind] = hit
    values = hit[2]
    if extra not in values:
        values[extra] = build()
    return values[extra]
