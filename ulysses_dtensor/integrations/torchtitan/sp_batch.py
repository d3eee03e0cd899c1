"""torchtitan's batch -> this sp rank's slice, with global positions and global attention masks.

torchtitan's text datasets already shift labels WITHIN each document
(``input = tokens[:-1]``, ``label = tokens[1:]`` per document), so every label
is aligned with its input before anything is sliced: the rule of our
:func:`~ulysses_dtensor.parallel.batch.shard_batch` (shift before slicing) holds by
construction, and this step only pads and slices. The rest follows
``shard_batch``:

* pad the sequence to a multiple of sp (of sp x tp under tensor parallelism:
  torchtitan's sequence parallelism and its MoE split each sp slice again over
  the tp ranks); pad labels are ignored. Pad positions restart at 0 (a
  document of their own) so they stay inside torchtitan's rope cache, which it
  sizes to ``training.seq_len``;
* positions stay GLOBAL (rank r holds positions ``r*S/P ...`` or the packed
  documents' own), so rope on a slice equals rope on the whole sequence;
* attention masks are built from the WHOLE sequence's positions and passed
  unchanged to every rank: after the all-to-all each rank attends over every
  token. For :class:`~.attention.UlyssesInnerAttention` they are document ids;
  for torchtitan's Flex / Varlen modules its own ``get_attention_masks``;
  torchtitan's SDPA takes none (causal only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.models.common.attention import FlexAttention, VarlenAttention

from ulysses_dtensor.attention import document_ids_from_position_ids

from .attention import UlyssesInnerAttention

__all__ = ["global_attention_masks", "shard_for_sp"]


def global_attention_masks(model: nn.Module, positions: Tensor) -> Any:
    """The masks ``model``'s inner attention takes, for the whole ``(B, S)`` sequence."""
    config = getattr(model, "config", None)
    attention = getattr(config, "first_attention", None)
    inner = getattr(attention, "inner_attention", None)
    if isinstance(inner, UlyssesInnerAttention.Config):
        document_ids = document_ids_from_position_ids(positions)
        # One document per row: plain causal attention, no mask to build.
        return None if bool((document_ids == 0).all()) else document_ids
    if isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)):
        return model.get_attention_masks(positions=positions)
    return None


def shard_for_sp(
    inputs: Tensor,
    labels: Tensor,
    extra_kwargs: dict[str, Any],
    *,
    model: nn.Module,
    sp_mesh: DeviceMesh | None = None,
    sp_rank: int | None = None,
    sp_size: int | None = None,
    tp_size: int = 1,
    pad_token_id: int = 0,
) -> tuple[Tensor, Tensor, dict[str, Any], int]:
    """Pad, build global masks, slice: what the model forward and the loss take on this rank.

    Args:
        inputs, labels: ``(B, S)`` token ids and next-token labels (as
            torchtitan's dataloader yields them, ``IGNORE_INDEX`` = ignored).
        extra_kwargs: model forward kwargs; ``positions`` ``(B, S)`` restarting
            at 0 per packed document (``arange`` when absent).
        model: the (parallelized) decoder, for its inner attention's mask kind.
        sp_mesh: the 1-D sp mesh (torchtitan's ``cp`` mesh), or give
            ``sp_rank`` and ``sp_size``; ``None`` for no sequence split.
        tp_size: torchtitan's tensor-parallel degree (the tp ranks of an sp
            rank share its slice; the slice length is made divisible by it).

    Returns ``(inputs, labels, extra_kwargs, real_tokens)``: this rank's
    ``(B, S_pad / sp)`` slices, kwargs with local ``positions`` and global
    ``attention_masks``, and the number of non-pad tokens in the slice.
    """
    if sp_mesh is not None:
        sp_rank, sp_size = sp_mesh.get_local_rank(), sp_mesh.size()
    sp_rank = 0 if sp_rank is None else sp_rank
    sp_size = 1 if sp_size is None else sp_size
    if inputs.dim() != 2 or labels.shape != inputs.shape:
        raise ValueError(
            f"inputs and labels must both be (batch, seq); got inputs {tuple(inputs.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    extra = dict(extra_kwargs)
    if extra.pop("attention_masks", None) is not None:
        raise ValueError(
            "attention_masks are built here from the global positions; pass positions only"
        )
    bsz, seq = inputs.shape
    positions = extra.get("positions")
    if positions is None:
        positions = torch.arange(seq, device=inputs.device).expand(bsz, seq)
    elif positions.shape != inputs.shape:
        raise ValueError(
            f"positions shape {tuple(positions.shape)} must equal inputs shape {tuple(inputs.shape)}"
        )

    multiple = sp_size * tp_size
    padded = -(-seq // multiple) * multiple
    if padded != seq:
        extra_len = padded - seq
        inputs = torch.cat([inputs, inputs.new_full((bsz, extra_len), pad_token_id)], dim=1)
        labels = torch.cat([labels, labels.new_full((bsz, extra_len), IGNORE_INDEX)], dim=1)
        pad_pos = torch.arange(extra_len, device=positions.device, dtype=positions.dtype)
        positions = torch.cat([positions, pad_pos.expand(bsz, extra_len)], dim=1)

    masks = global_attention_masks(model, positions)
    local = padded // sp_size
    lo, hi = sp_rank * local, (sp_rank + 1) * local
    extra["positions"] = positions[:, lo:hi].contiguous()
    if masks is not None:
        extra["attention_masks"] = masks
    real_tokens = bsz * max(0, min(hi, seq) - lo)
    return inputs[:, lo:hi].contiguous(), labels[:, lo:hi].contiguous(), extra, real_tokens
