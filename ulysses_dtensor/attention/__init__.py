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
(:mod:`~.documents`): every backend -- dense mask, flex block
mask, varlen ``cu_seqlens`` -- sees the same segmentation, one document per run
of equal ids, even if an id value repeats later in the row.

Backends (modules of this package):

* ``auto``       the default: the kernel table (:mod:`.kernel_table`) picks per
                 call, from the case (documents, window, soft-cap, sinks, head
                 dims, dtype) and the machine (:mod:`.capabilities`: GPU
                 generation, torch and cuDNN versions, installed packages).
                 ``sdpa`` on CPU; on Hopper / sm100 plain causal ``cudnn``;
                 documents and windows on FlashAttention (``fa4`` on sm100,
                 ``flash_attn``, ``varlen``); ``flex`` for sinks and (without
                 flash-attn) soft-capping; ``sdpa`` for float32 and head dims
                 over 256.
* ``sdpa``       torch SDPA (:mod:`.dense`); CPU and CUDA, forward and backward.
                 Documents and windows use a dense (B, 1, S, S) boolean mask;
                 soft-capping and sinks an explicit-scores path.
* ``cudnn``      SDPA restricted to cuDNN attention (:mod:`.dense`), entered
                 inside the call (recompute and backward run it too); CUDA,
                 16-bit, head dims up to 128 (q/k 192 with v 128 on sm90/sm100);
                 windows and documents as a dense mask; cuDNN above 9.15.0.
* ``flex``       FlexAttention (:mod:`.flex`): block mask, score_mod, sinks via
                 its log-sum-exp; compiled on CUDA, forward only on CPU.
* ``varlen``     ``torch.nn.attention.varlen.varlen_attn`` (:mod:`.packed`);
                 CUDA, 16-bit, head dims up to 256; windows; no soft-capping or
                 sinks.
* ``flash_attn`` the flash-attn package, imported lazily (:mod:`.packed`); CUDA,
                 16-bit, head dims up to 256; windows and soft-capping; no sinks.
* ``fa4``        FlashAttention-4 (the flash-attn-4 package) through torch's
                 ``activate_flash_attention_impl("FA4")`` and the ``varlen``
                 path (:mod:`.packed`); sm90 / sm100, 16-bit; windows. The
                 switch is process-wide (torch's flash kernels all become FA4).

Pattern semantics: :mod:`.pattern`. Feature support per backend:
:data:`.select.SUPPORTS`; the tensors each kernel takes: :func:`.select.kernel_refusal`.
"""

from .documents import (
    cu_seqlens_from_document_ids,
    document_ids_from_position_ids,
)
from .capabilities import Capabilities
from .dense import _repeat_kv
from .kernel_table import Case, Choice, auto_choice, describe_choice
from .local import AttentionCall, LocalAttention, local_attention
from .select import (
    BACKENDS,
    FEATURES,
    _has_varlen,
    _import_flash_attn,
    check_backend,
    default_backend,
)

__all__ = [
    "AttentionCall",
    "BACKENDS",
    "FEATURES",
    "Capabilities",
    "Case",
    "Choice",
    "auto_choice",
    "check_backend",
    "default_backend",
    "describe_choice",
    "document_ids_from_position_ids",
    "cu_seqlens_from_document_ids",
    "local_attention",
    "LocalAttention",
]
