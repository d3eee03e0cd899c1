"""Local (single-rank) attention backends behind one call.

This is what runs inside Ulysses sequence parallelism after the all-to-all: each
rank holds the FULL sequence for a subset of heads, so any ordinary attention
kernel can be used unchanged, and every per-head attention pattern -- a sliding
window in global positions, soft-capped logits, attention sinks, a value head
dim of its own (MLA) -- is a matter of the local kernel honouring it. The
layout everywhere is ``(batch, seq, heads, head_dim)``, the layout q/k/v have as
they leave their projections; backends that want SDPA's ``(batch, heads, seq,
head_dim)`` get a transposed view internally.

Packed documents are described by ``document_ids`` of shape ``(batch, seq)``
(:mod:`~ulysses_dtensor.parallel.documents`): every backend -- dense mask, flex block
mask, varlen ``cu_seqlens`` -- sees the same segmentation, one document per run
of equal ids, even if an id value repeats later in the row.

Backends (modules of this package):

* ``auto``       the default: :func:`default_backend` for the tensors' device and
                 dtype (``sdpa`` on CPU; on CUDA in 16-bit ``flash_attn`` if
                 installed, else ``varlen``, else ``sdpa``), moved on to ``flex``
                 (CUDA) / ``sdpa`` when that kernel cannot express the pattern,
                 and to ``sdpa`` when it cannot take the tensors (a head dim
                 over 256).
* ``sdpa``       torch SDPA (:mod:`.dense`); CPU and CUDA, forward and backward.
                 Documents and windows use a dense (B, 1, S, S) boolean mask;
                 soft-capping and sinks an explicit-scores path.
* ``flex``       FlexAttention (:mod:`.flex`): block mask, score_mod, sinks via
                 its log-sum-exp; compiled on CUDA, forward only on CPU.
* ``varlen``     ``torch.nn.attention.varlen.varlen_attn`` (:mod:`.packed`);
                 CUDA, 16-bit, head dims up to 256; windows; no soft-capping or
                 sinks.
* ``flash_attn`` the flash-attn package, imported lazily (:mod:`.packed`); CUDA,
                 16-bit, head dims up to 256; windows and soft-capping; no sinks.

Pattern semantics: :mod:`.pattern`. Feature support per backend:
:data:`.select.SUPPORTS`; the tensors each kernel takes: :func:`.select.kernel_refusal`.
"""

from ..parallel.documents import (
    cu_seqlens_from_document_ids,
    document_ids_from_position_ids,
)
from .dense import _repeat_kv
from .local import LocalAttention, local_attention
from .select import (
    BACKENDS,
    FEATURES,
    _has_varlen,
    _import_flash_attn,
    check_backend,
    default_backend,
)

__all__ = [
    "BACKENDS",
    "FEATURES",
    "check_backend",
    "default_backend",
    "document_ids_from_position_ids",
    "cu_seqlens_from_document_ids",
    "local_attention",
    "LocalAttention",
]
