"""Turn an HF-style batch into this sp rank's slice.

Order matters: labels are shifted on the FULL sequence before slicing, so the
target of the last token of a slice (the first token of the next slice) is not
lost. Position ids stay global, so rotary embeddings on a slice equal those on
the full sequence. Document ids are kept whole: after the all-to-all every rank
attends over the full sequence and builds the same document mask.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..attention.documents import document_ids_from_position_ids
from .loss import IGNORE_INDEX
from .mesh import divisors, ring_degree
from .ring_layout import layout_indices, seq_multiple


def shift_labels(labels: Tensor, document_ids: Tensor | None, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``out[:, t] = labels[:, t+1]``; ignore at the row end and at each document's last token."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    if document_ids is not None:
        boundary = document_ids[:, 1:] != document_ids[:, :-1]
        out[:, :-1].masked_fill_(boundary, ignore_index)
    return out


def shard_batch(
    batch: Mapping[str, Tensor],
    sp_mesh: DeviceMesh | None = None,
    *,
    sp_rank: int | None = None,
    sp_size: int | None = None,
    ring: int | None = None,
    pad_token_id: int | None = 0,
    ignore_index: int = IGNORE_INDEX,
    pad: bool = True,
) -> dict[str, Tensor | None]:
    """Pad, shift, and slice a batch for one sp rank.

    Args:
        batch: ``input_ids`` (B, S); optional ``labels`` (B, S) aligned with the
            inputs (``labels[t]`` is token t's own id, or ``ignore_index``);
            optional ``position_ids`` (B, S) that restart at 0 at each packed
            document.
        sp_mesh: the 1-D sp mesh; or give ``sp_rank`` and ``sp_size``.
        ring: ring-attention degree inside sp (``sp = ring x ulysses``); > 1
            lays the sequence out for the ring before slicing. None: the ring
            degree of ``sp_mesh`` (``ParallelMesh.sp`` carries it), else 1.
        pad: pad S up to a multiple of sp (of lcm(sp, 2*ring) with a ring;
            pad labels ignored). With ``pad=False`` another S is an error.
        pad_token_id: the id the padding carries; None repeats each row's last token.

    Returns ``input_ids``, ``labels`` (shifted), ``position_ids`` (global
    positions) for this rank's ``S_pad / sp`` tokens, and ``document_ids``
    (B, S_pad) for the whole sequence (in ring layout order when ring > 1),
    or ``None`` when every row is a single document (plain causal attention
    then needs no mask).
    """
    if sp_mesh is not None:
        sp_rank, sp_size = sp_mesh.get_local_rank(), sp_mesh.size()
    sp_rank = 0 if sp_rank is None else sp_rank
    sp_size = 1 if sp_size is None else sp_size
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must be in [0, sp_size={sp_size})")
    ring = ring_degree(sp_mesh) if ring is None else ring
    if not isinstance(ring, int) or ring < 1 or sp_size % ring:
        raise ValueError(f"ring={ring!r} must divide sp={sp_size}; valid: {divisors(sp_size)}")

    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    labels = batch.get("labels")
    labels = input_ids if labels is None else labels
    position_ids = batch.get("position_ids")
    for name, t in (("labels", labels), ("position_ids", position_ids)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
            )

    bsz, seq = input_ids.shape
    document_ids = None
    if position_ids is not None:
        if (position_ids < 0).any():
            raise ValueError("position_ids must be >= 0 (they restart at 0 for each document)")
        document_ids = document_ids_from_position_ids(position_ids)
        if bool((document_ids == 0).all()):
            document_ids = None  # one document per row: no mask needed
    else:
        position_ids = torch.arange(seq, device=input_ids.device).expand(bsz, seq)
    labels = shift_labels(labels, document_ids, ignore_index)

    unit = seq_multiple(sp_size, ring)
    padded = -(-seq // unit) * unit
    if padded != seq:
        if not pad:
            what = f"sp={sp_size}" if ring == 1 else f"lcm(sp={sp_size}, 2*ring={2 * ring})"
            raise ValueError(
                f"sequence length {seq} is not divisible by {what}; pad to "
                f"{padded} (pad=True) or use a length that is a multiple of {unit}"
            )
        extra = padded - seq
        if pad_token_id is None:
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(bsz, extra)], dim=1)
        else:
            input_ids = _pad(input_ids, extra, pad_token_id)
        labels = _pad(labels, extra, ignore_index)
        # Pads continue the positions; causal attention keeps real tokens from
        # seeing them. With documents, pads form one more document of their own.
        tail = position_ids[:, -1:] + 1 + torch.arange(extra, device=position_ids.device)
        position_ids = torch.cat([position_ids, tail], dim=1)
        if document_ids is not None:
            document_ids = torch.cat(
                [document_ids, (document_ids[:, -1:] + 1).expand(bsz, extra)], dim=1
            )

    if ring > 1:
        idx = layout_indices(padded, ring, input_ids.device)
        input_ids, labels, position_ids = input_ids[:, idx], labels[:, idx], position_ids[:, idx]
        if document_ids is not None:
            document_ids = document_ids[:, idx]

    local = padded // sp_size
    sl = slice(sp_rank * local, (sp_rank + 1) * local)
    return {
        "input_ids": input_ids[:, sl].contiguous(),
        "labels": labels[:, sl].contiguous(),
        "position_ids": position_ids[:, sl].contiguous(),
        "document_ids": document_ids,
    }


def _pad(t: Tensor, extra: int, value: int) -> Tensor:
    return torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)
