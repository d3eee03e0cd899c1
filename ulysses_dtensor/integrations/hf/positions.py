"""Multimodal rope position ids (Qwen2.5-VL, Qwen3-VL) for ``shard_hf_batch``.

Their text models take ``position_ids`` of shape ``(3, B, S)`` (temporal,
height, width; all three equal the text position on text tokens) or
``(4, B, S)`` with the text positions first. Under SP they are sliced on the
LAST dim, keeping the global values, and padding continues every row, as for
2-D positions; packed documents are read off the text positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ulysses_dtensor.parallel.ring_layout import layout_indices

__all__ = ["slice_positions", "text_positions"]


def text_positions(position_ids: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(text positions (B, S), the multimodal ids or None)`` of a batch's position ids."""
    if position_ids.dim() == 2:
        return position_ids, None
    if position_ids.dim() != 3 or position_ids.shape[0] not in (3, 4):
        raise ValueError(
            f"position_ids must be (batch, seq), or (3, batch, seq) / (4, batch, seq) multimodal rope ids; "
            f"got shape {tuple(position_ids.shape)}"
        )
    if position_ids.shape[0] == 3 and not bool((position_ids == position_ids[:1]).all()):
        raise ValueError(
            "position_ids of shape (3, batch, seq) differ between their rows (vision tokens), so the packed "
            "documents cannot be read off them; give (4, batch, seq) with the text positions first"
        )
    return position_ids[0], position_ids


def slice_positions(position_ids: Tensor, padded: int, sp_rank: int, sp_size: int, ring: int = 1) -> Tensor:
    """Pad ``(..., B, S)`` ids to ``padded`` (continuing each row), lay them out for a
    ring (``ring > 1``, as ``shard_batch`` does the tokens) and keep this rank's slice
    of the last dim."""
    extra = padded - position_ids.shape[-1]
    if extra:
        tail = position_ids[..., -1:] + 1 + torch.arange(extra, device=position_ids.device)
        position_ids = torch.cat([position_ids, tail], dim=-1)
    if ring > 1:
        position_ids = position_ids[..., layout_indices(padded, ring, position_ids.device)]
    local = padded // sp_size
    return position_ids[..., sp_rank * local : (sp_rank + 1) * local].contiguous()
