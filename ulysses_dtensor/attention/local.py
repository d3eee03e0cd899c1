"""``local_attention`` / ``LocalAttention``: one call in front of every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .documents import segment_ids
from ..runtime.regions import in_region
from .dense import cudnn_attention, sdpa_attention
from .flex import flex_attention_backend
from .packed import fa4_backend, flash_attn_backend, varlen_backend
from .pattern import check_pattern
from .planning import planned_attention, planning_target
from .select import check_backend, resolve_backend

__all__ = ["AttentionCall", "LocalAttention", "local_attention"]


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"local_attention expects 4-D q, k, v of shape (batch, seq, heads, head_dim); got {shapes}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in batch, seq and heads (dims 0-2); got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k must agree in batch, seq and head_dim (dims 0, 1, 3); got {shapes}"
        )
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}); got {shapes}"
        )
    if document_ids is not None:
        if tuple(document_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(
                f"document_ids must have shape (batch, seq) = {tuple(q.shape[:2])}; "
                f"got {tuple(document_ids.shape)}"
            )
        if document_ids.is_floating_point() or document_ids.is_complex():
            raise ValueError(f"document_ids must be an integer tensor; got {document_ids.dtype}")


@in_region("attention")
def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    backend: str = "auto",
    causal: bool = True,
    document_ids: Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention over the full local sequence.

    q: (B, S, Hq, D); k: (B, S, Hkv, D); v: (B, S, Hkv, Dv) with Hq % Hkv == 0
    (GQA / MQA); Dv may differ from D (MLA).
    document_ids: optional (B, S) integer tensor; a token attends only within its
    own document (a run of equal ids in its row), causally when ``causal``.
    scale: softmax scale, default 1/sqrt(D).
    window: query i sees key j only if ``i - j < window`` (positions are indices
    of this full sequence; needs ``causal``).
    softcap: scores become ``softcap * tanh(scores / softcap)`` (after scaling).
    sinks: (Hq,) logits, one per query head, added to the softmax denominator only.

    Returns (B, S, Hq, Dv) in q's dtype. See :mod:`.pattern` for the exact math;
    a backend whose kernel cannot express a feature or take the tensors (device,
    dtype, head dim) is refused by name (``auto`` picks one that can).
    """
    check_backend(backend)
    _check_shapes(q, k, v, document_ids)
    pattern = check_pattern(causal, window, softcap, sinks, q.shape[2])
    if planning_target() is not None:  # the memory planner's trace: what the target GPU runs
        seg = None if document_ids is None else segment_ids(document_ids.to(q.device))
        return planned_attention(q, k, v, backend, pattern, seg, scale, sinks).to(q.dtype)
    backend = resolve_backend(backend, pattern.features(), q.device, q.dtype, q.shape[3],
                              v_head_dim=v.shape[3], documents=document_ids is not None)
    seg = None
    if document_ids is not None:
        if document_ids.device != q.device:
            document_ids = document_ids.to(q.device)
        seg = segment_ids(document_ids)

    if backend == "sdpa":
        out = sdpa_attention(q, k, v, pattern, seg, scale, sinks)
    elif backend == "flex":
        out = flex_attention_backend(q, k, v, pattern, seg, scale, document_ids, sinks)
    elif backend == "cudnn":
        out = cudnn_attention(q, k, v, pattern, seg, scale)
    elif backend == "varlen":
        out = varlen_backend(q, k, v, pattern, seg, scale, document_ids)
    elif backend == "fa4":
        out = fa4_backend(q, k, v, pattern, seg, scale, document_ids)
    else:
        out = flash_attn_backend(q, k, v, pattern, seg, scale, document_ids)
    return out.to(q.dtype)


@dataclass(frozen=True)
class AttentionCall:
    """What one :func:`local_attention` call computes, but for its tensors (q, k, v and
    sinks): a module's answer to ``call_spec(...)``, which lets head chunks
    (:mod:`ulysses_dtensor.parallel.head_chunks`) run the call's kernel split into a
    forward and a backward, chunk by chunk."""

    backend: str = "auto"
    causal: bool = True
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    document_ids: Tensor | None = None


class LocalAttention(torch.nn.Module):
    """Module wrapper around :func:`local_attention` (no parameters).

    The pattern (causal, window, softcap, scale) is fixed per module; sinks are
    a per-call argument because they are the model's parameters (under
    Ulysses each rank receives the sinks of its heads).
    """

    def __init__(
        self,
        backend: str = "auto",
        causal: bool = True,
        scale: float | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.backend = check_backend(backend)
        self.causal = causal
        self.scale = scale
        self.window = window
        self.softcap = softcap

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None, sinks: Tensor | None = None
    ) -> Tensor:
        return local_attention(
            q,
            k,
            v,
            backend=self.backend,
            causal=self.causal,
            document_ids=document_ids,
            scale=self.scale,
            window=self.window,
            softcap=self.softcap,
            sinks=sinks,
        )

    def call_spec(self, document_ids: Tensor | None = None) -> AttentionCall:
        """The :class:`AttentionCall` of ``forward(q, k, v, document_ids, sinks)``."""
        return AttentionCall(self.backend, self.causal, self.scale, self.window, self.softcap, document_ids)

    def extra_repr(self) -> str:
        extra = "".join(f", {n}={getattr(self, n)}" for n in ("window", "softcap") if getattr(self, n) is not None)
        return f"backend={self.backend!r}, causal={self.causal}{extra}"
