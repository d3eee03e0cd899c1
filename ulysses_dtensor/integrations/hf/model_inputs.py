"""A batch -> this sp rank's keyword arguments and labels for a transformers model."""

from __future__ import annotations

from typing import Mapping

from torch import Tensor

from ulysses_dtensor.parallel.batch import shard_batch
from ulysses_dtensor.parallel.loss import IGNORE_INDEX
from ulysses_dtensor.parallel.mesh import ring_degree

from .attention_function import DOCUMENT_IDS_KWARG
from .positions import slice_positions, text_positions

__all__ = ["SEQ_LEN_KWARG", "shard_hf_batch"]

# Model keyword argument carrying the unpadded length of the whole sequence
# (shard_hf_batch sets it): the tokens past it are padding, which MoE routers
# must not count. Consumed by the model's pre-hook, never passed down.
SEQ_LEN_KWARG = "sp_seq_len"


def shard_hf_batch(
    batch: Mapping[str, Tensor],
    sp_mesh=None,
    *,
    pad_token_id: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[dict[str, Tensor], Tensor]:
    """This sp rank's model keyword arguments and labels for a transformers model.

    ``batch``: ``input_ids`` (B, S); optional ``labels`` aligned with the inputs
    (token t's own id, or ``ignore_index``), ``position_ids`` restarting at 0
    per packed document -- (B, S), or multimodal rope ids (3, B, S) / (4, B, S)
    (:mod:`.positions`), sliced on the last dim -- and an ``attention_mask``
    that must be all ones (padding is done here, at the end, ignored by the loss).
    The padding repeats each row's last token (``pad_token_id=None``): a padding id
    whose embedding row is zero (transformers zero-inits ``padding_idx``) would feed
    zeros into a norm without an epsilon (Gemma-3n's altup magnitudes), whose
    backward is NaN -- and NaN times the padding's zero weight is still NaN.

    Returns ``(inputs, labels)``: ``inputs`` has ``input_ids`` and GLOBAL
    ``position_ids`` for this rank's ``S_pad/sp`` tokens, :data:`SEQ_LEN_KWARG`
    (S, so that padding is known), plus :data:`DOCUMENT_IDS_KWARG` (the whole
    sequence's document ids) when rows hold several documents; ``labels`` are
    shifted on the full sequence before slicing (see
    :func:`~ulysses_dtensor.parallel.batch.shard_batch`), for
    ``sp_cross_entropy(model(**inputs).logits, labels, pmesh.loss)``.
    """
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "shard_hf_batch: attention_mask has zeros (padding inside the batch); Ulysses SP needs "
            "packed rows: concatenate documents and give position_ids restarting at 0 per document"
        )
    batch = dict(batch)
    multimodal = None
    if batch.get("position_ids") is not None:
        batch["position_ids"], multimodal = text_positions(batch["position_ids"])
    local = shard_batch(batch, sp_mesh, pad_token_id=pad_token_id, ignore_index=ignore_index)
    inputs = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
    seq = batch["input_ids"].shape[1]
    if multimodal is not None:
        sp_rank, sp_size = (0, 1) if sp_mesh is None else (sp_mesh.get_local_rank(), sp_mesh.size())
        inputs["position_ids"] = slice_positions(multimodal, local["input_ids"].shape[1] * sp_size, sp_rank, sp_size,
                                                 ring_degree(sp_mesh))
    inputs[SEQ_LEN_KWARG] = seq
    if local["document_ids"] is not None:
        inputs[DOCUMENT_IDS_KWARG] = local["document_ids"]
    return inputs, local["labels"]
