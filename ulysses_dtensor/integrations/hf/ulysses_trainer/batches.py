"""A collated Trainer batch -> what :func:`~ulysses_dtensor.integrations.hf.shard_hf_batch` takes,
and the evaluation outputs back to whole sequences.

Collators a Trainer script uses, and what becomes of their keys:

* ``input_ids``, ``labels`` (aligned with the inputs, ``-100`` where no target), or a
  collator's ``shift_labels`` (already shifted: unshifted here, as transformers'
  loss would use them);
* ``position_ids`` restarting at 0 per packed document (transformers'
  ``DataCollatorWithFlattening``, TRL's padding-free and packed batches): the
  documents, kept apart in attention, the recurrences and the loss;
* ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``: the same documents again,
  dropped (rebuilt from ``position_ids`` for the whole sequence);
* ``attention_mask``: all ones, or right padding (rows of real tokens then padding,
  TRL's and transformers' padded collators), dropped, the padding's labels ignored:
  causal attention keeps real tokens from seeing later padding, and MoE routers are
  given each row's length (``row_lengths``), as transformers' router loss reads the mask. Left padding, holes
  and custom (4-D) masks are refused: a rank's slice would need the mask's meaning.

Any other key is refused by name (an image, ``token_type_ids``, ...): the model's
text path runs on a slice of the sequence.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from ulysses_dtensor.parallel.batch import shard_batch
from ulysses_dtensor.parallel.loss import IGNORE_INDEX
from ulysses_dtensor.parallel.ring_layout import layout_indices

from .refusals import UlyssesTrainerError

__all__ = ["FLATTENING_KEYS", "ROW_LENGTHS", "check_same_batch", "count_targets", "gather_sequence", "sp_batch"]

FLATTENING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_MODEL_KEYS = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")
ROW_LENGTHS = "row_lengths"  # sp_batch's key for the real tokens of right-padded rows


def sp_batch(inputs: Mapping, *, need_labels: bool) -> dict[str, Tensor]:
    """``input_ids`` (B, S), ``labels`` aligned with them (when the batch has targets),
    ``position_ids`` (when given) and :data:`ROW_LENGTHS` (right-padded rows: each row's
    real tokens), or ValueError naming the key that cannot run under SP."""
    unknown = [k for k in inputs if k not in _MODEL_KEYS + FLATTENING_KEYS]
    if unknown:
        raise UlyssesTrainerError(
            f"batch key {unknown[0]!r} is not supported by UlyssesHFTrainer: the model runs its text path on a slice "
            f"of the sequence, from {', '.join(_MODEL_KEYS)} (plus a flattening collator's "
            f"{', '.join(FLATTENING_KEYS)}); drop it from the dataset or the collator")
    ids = inputs.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise UlyssesTrainerError(f"batch input_ids must be a (batch, seq) tensor, got "
                                  f"{tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__}")
    labels = inputs.get("labels")
    if inputs.get("shift_labels") is not None:  # transformers' loss scores these as they are
        shifted = inputs["shift_labels"]
        labels = torch.full_like(shifted, IGNORE_INDEX)
        labels[:, 1:] = shifted[:, :-1]
    positions = inputs.get("position_ids")
    if positions is None and any(k in inputs for k in FLATTENING_KEYS):
        raise UlyssesTrainerError(
            "batch has flattened-sequence keys (cu_seq_lens_q, seq_idx, ...) but no position_ids: "
            "the documents would be unknown; return position_ids from the collator")
    for name, t in (("labels", labels), ("position_ids", positions)):
        if t is not None and tuple(t.shape) != tuple(ids.shape):
            raise UlyssesTrainerError(
                f"batch {name} has shape {tuple(t.shape)}, input_ids {tuple(ids.shape)}: they must match")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        if tuple(mask.shape) != tuple(ids.shape):
            raise UlyssesTrainerError(
                f"batch attention_mask of shape {tuple(mask.shape)} (a custom mask) is not supported "
                "under SP: its meaning would have to travel with each rank's slice; pack documents "
                "with position_ids instead")
        real = mask.bool()
        if not bool((real == real.long().cumprod(dim=1).bool()).all()):
            raise UlyssesTrainerError(
                "batch attention_mask has padding on the left or inside rows: under SP only right "
                "padding (real tokens first) runs; set the tokenizer's padding_side='right' or use a "
                "padding-free collator (DataCollatorWithFlattening, TRL's padding_free=True)")
        if labels is not None:
            labels = labels.masked_fill(~real, IGNORE_INDEX)
        lengths = real.sum(dim=1)
    if need_labels and labels is None:
        raise UlyssesTrainerError(
            "the training batch has no labels: give the collator labels (-100 where no target), as "
            "DataCollatorForLanguageModeling(mlm=False) and TRL's collators do")
    batch = {"input_ids": ids}
    if labels is not None:
        batch["labels"] = labels
    if positions is not None:
        batch["position_ids"] = positions
    if mask is not None and not bool(mask.all()):
        batch[ROW_LENGTHS] = lengths  # MoE routers leave each row's padding out
    return batch


def count_targets(batch: Mapping[str, Tensor]) -> Tensor:
    """The tokens with a target in ``batch`` (:func:`sp_batch`'s), shifted exactly as
    ``shard_hf_batch`` shifts them: on the whole sequence, none across a document edge."""
    whole = shard_batch(batch, sp_rank=0, sp_size=1, ring=1, pad=False)
    return (whole["labels"] != IGNORE_INDEX).sum()


def check_same_batch(batch: Mapping[str, Tensor], group, size: int) -> None:
    """ValueError unless every rank of the sp ``group`` holds this same batch (a signature
    of a few integers per tensor is compared: one small all-gather)."""
    if size == 1:
        return
    parts = []
    for t in batch.values():
        flat = t.reshape(-1).long()
        weights = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
        parts += [torch.tensor(flat.numel(), device=flat.device), flat.sum(), (flat * weights).sum()]
    mine = torch.stack(parts)
    seen = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(seen, mine, group=group)
    differ = [r for r, s in enumerate(seen) if not torch.equal(s, seen[0])]
    if differ:
        raise UlyssesTrainerError(
            f"the sp ranks of one group received different batches (sp rank {differ[0]} differs from sp rank 0): "
            "every sp rank must read the same samples and split the sequence. The dataset or the collator differs "
            "per process (split by rank itself, or random per process); let the trainer shard the data")


def gather_sequence(local: Tensor, group, size: int, ring: int, seq_len: int) -> Tensor:
    """(B, S_pad/sp, ...) of every sp rank -> (B, seq_len, ...) in the sequence's own order
    (the ring's load-balanced layout undone, the padding cut)."""
    if size > 1:
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts, dim=1)
    if ring > 1:
        order = layout_indices(local.shape[1], ring, local.device)
        whole = torch.empty_like(local)
        whole[:, order] = local
        local = whole
    return local[:, :seq_len]
