"""Calls into fla-core's Triton kernels: the gated delta rule and the short causal convolution.

Their conventions, read in fla-core 0.6.0 (``fla/ops/gated_delta_rule/chunk.py``,
``fla/modules/causal_conv1d/ops.py``) and the same as :mod:`.gated_delta`'s:

* tensors are (batch, seq, heads, dim), not head-first; value heads are a multiple of
  key heads, value head ``j`` reading key head ``j // (v_heads / k_heads)`` (the kernels'
  ``i_h // (HV // H)``);
* ``g`` is the log decay and ``beta`` is taken after its sigmoid;
  ``use_qk_l2norm_in_kernel=True`` normalises q and k as ``x / sqrt(sum x^2 + 1e-6)``, and
  the scale ``k_dim ** -0.5`` is passed explicitly; no initial state, no final state;
* the convolution's ``weight`` is (channels, width) with its last tap on the current
  token, accumulated in float32, the output in the input's dtype;
* packed documents are the batch flattened into one row (batch 1) with ``cu_seqlens``
  (int64, ``num_docs + 1`` offsets from 0 to ``batch * seq``): each row ends a document,
  so the flattened row holds exactly the rows' documents, each from a zero state.
  ``cu_seqlens`` costs one host sync per batch (the document count); it is built once per
  batch and shared by every layer (fla caches its chunk indices by that tensor's identity).

``tests/test_mixer_kernels.py`` checks every keyword passed here against the installed
functions' signatures (CPU); ``tests/test_mixer_kernels_gpu.py`` the results against the
torch code (GPU).
"""

from __future__ import annotations

from torch import Tensor

from ..attention.documents import cached_for_documents, cu_seqlens
from .kernel_choice import load_kernel

__all__ = ["fla_causal_conv", "fla_cu_seqlens", "fla_gated_delta_rule"]


def fla_cu_seqlens(document_ids: Tensor) -> Tensor:
    """int64 offsets of the documents of ``document_ids`` (batch, seq) flattened into one row."""
    return cached_for_documents("fla_cu_seqlens", document_ids, (), lambda: cu_seqlens(document_ids).long())


def _one_row(t: Tensor) -> Tensor:
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         document_ids: Tensor | None) -> Tensor:
    """:func:`~.gated_delta.chunk_gated_delta_rule_documents` on fla's kernel: same arguments
    (document ids instead of segments; None: one document per row), same result."""
    kernel = load_kernel("fla.chunk_gated_delta_rule")
    batch, seq = q.shape[:2]
    documents = {}
    if document_ids is not None:
        documents = {"cu_seqlens": fla_cu_seqlens(document_ids)}
        q, k, v, g, beta = (_one_row(t) for t in (q, k, v, g, beta))
    out, _ = kernel(q=q, k=k, v=v, g=g, beta=beta, scale=k.shape[-1] ** -0.5, initial_state=None,
                    output_final_state=False, use_qk_l2norm_in_kernel=True, **documents)
    return out.reshape(batch, seq, *out.shape[2:])


def fla_causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, document_ids: Tensor | None,
                    activation: str | None) -> Tensor:
    """The depthwise causal convolution of ``x`` (batch, seq, channels) on fla's kernel,
    restarting at every document of ``document_ids`` (None: one per row); ``activation``
    None, ``"silu"`` or ``"swish"``, applied inside the kernel."""
    kernel = load_kernel("fla.causal_conv1d")
    batch, seq = x.shape[:2]
    documents = {}
    if document_ids is not None:
        documents = {"cu_seqlens": fla_cu_seqlens(document_ids)}
        x = _one_row(x)
    out, _ = kernel(x=x, weight=weight, bias=bias, activation=activation, backend="triton", **documents)
    return out.reshape(batch, seq, -1)
