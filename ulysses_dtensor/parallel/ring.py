"""Ring attention over the ``ring`` dim of a USP mesh (Ulysses x ring).

USP: ``sp = ring x ulysses``. The Ulysses all-to-all runs over the ``ulysses``
ranks (inside a node) and leaves each rank ``S / ring`` tokens of
``H / ulysses`` heads: one ring block, laid out as two mirrored chunks
(:mod:`~ulysses_dtensor.parallel.ring_layout`). Ring attention passes the k/v blocks
around the ``ring`` ranks (across nodes); each rank attends its queries to every
block in turn and merges the partial outputs by their log-sum-exp (LSE), in
place. Per layer a rank sends ``ring - 1`` k/v blocks forward; backward sends
them again plus ``ring`` fp32 dk/dv accumulators, which travel with their block
and come home at the end (:func:`ring_bytes_per_rank`).

The steps of a block -- which chunk pairs attend, their kernel calls, the merge
and the transfers, forward and backward -- are :mod:`~ulysses_dtensor.parallel.ring_steps`'s.

What is PyTorch's and what is ours
----------------------------------
Reused: the LSE-returning kernels (SDPA's CPU flash kernel and its backward,
which take GQA k/v; on CUDA cuDNN attention where the kernel table gives plain
causal attention to it, SDPA's flash / memory-efficient ops and
``torch.nn.attention.varlen``'s ops, :mod:`~ulysses_dtensor.parallel.ring_kernels`),
functional collectives, and ``_HeadTailLoadBalancer`` for the layout.

Written here, the loop (forward and backward) and the merge. torch's
``_templated_ring_attention`` passes the same kernel arguments to every step,
so it cannot give a block its own document mask or slices; its rotation and
balancing are process-wide ``_cp_options`` (all-gather rotation by default;
balancing on refuses non-causal attention); its merge (``_SDPAMerger``) makes
three full fp32 temporaries and a concatenated copy per step (the forward's
memory peak at long context); its backward runs one kernel per step (up to four
times the workspace of ours); and it has no switch to measure the overlap.
It does run on gloo and with GQA.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from ..attention import LocalAttention, local_attention
from .head_chunk_kernels import RingCall
from .ring_layout import layout_indices, layout_position_ids, seq_multiple
from .ring_steps import (  # noqa: F401 - the steps' helpers, read by tests and the benchmark
    RingState,
    _RingAttentionFn,
    refused_pattern,
    ring_documents,
    _calls,
    _dense_mask,
    _send_to_next,
    _wait,
    ring_backward,
    ring_forward,
)

__all__ = [
    "RING_BACKENDS",
    "RingAttention",
    "RingLocalAttention",
    "RingState",
    "ring_backward",
    "ring_forward",
    "layout_indices",
    "layout_position_ids",
    "ring_attention",
    "ring_bytes_per_rank",
    "seq_multiple",
    "usp_bytes_per_rank",
]

# The ring merges blocks by LSE, which only SDPA's kernels return here.
RING_BACKENDS = ("auto", "sdpa")


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mesh: DeviceMesh,
    *,
    causal: bool = True,
    document_ids: Tensor | None = None,
    scale: float | None = None,
    overlap: bool = True,
) -> Tensor:
    """Attention of this rank's ring block over the whole (ring-laid-out) sequence.

    q: (B, S/ring, H, D), k, v: (B, S/ring, Hkv, D) with H % Hkv == 0: ring
    rank r's block of the sequence in :func:`layout_indices` order.
    document_ids: (B, S) for the WHOLE sequence in layout order (``shard_batch``
    gives them), or None. Returns (B, S/ring, H, D).
    """
    size = mesh.size()
    if size == 1:
        return local_attention(q, k, v, backend="sdpa", causal=causal, document_ids=document_ids, scale=scale)
    b, s, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != s or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
            f"(B, S/ring, H, D) and (B, S/ring, Hkv, D) with H % Hkv == 0"
        )
    if s % 2:
        raise ValueError(f"ring_attention: a ring block holds two chunks; its length {s} must be even")
    docs = None
    if document_ids is not None:
        if tuple(document_ids.shape) != (b, s * size):
            raise ValueError(
                f"ring_attention: document_ids must cover the whole sequence, (B, S) = "
                f"{(b, s * size)}; got {tuple(document_ids.shape)}"
            )
        docs = ring_documents(document_ids.to(q.device), size)
    out = _RingAttentionFn.apply(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        docs,
        mesh.get_group(),
        mesh.get_local_rank(),
        size,
        causal,
        scale,
        overlap,
    )
    return out.transpose(1, 2)


class RingLocalAttention(nn.Module):
    """:class:`~ulysses_dtensor.attention.LocalAttention`'s drop-in for a ring mesh."""

    def __init__(self, mesh: DeviceMesh, *, causal: bool = True, scale: float | None = None, overlap: bool = True):
        super().__init__()
        self.mesh = mesh
        self.causal = causal
        self.scale = scale
        self.overlap = overlap

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None, sinks: Tensor | None = None
    ) -> Tensor:
        if sinks is not None:
            raise ValueError(refused_pattern("sinks", f"a ({sinks.shape[0]},) tensor"))
        return ring_attention(
            q, k, v, self.mesh, causal=self.causal, document_ids=document_ids, scale=self.scale, overlap=self.overlap
        )

    def call_spec(self, document_ids: Tensor | None = None) -> RingCall:
        """What ``forward(q, k, v, document_ids)`` computes, for head chunks (:mod:`.head_chunk_kernels`)."""
        return RingCall(self.mesh, self.causal, self.scale, self.overlap, document_ids)

    def extra_repr(self) -> str:
        return f"ring={self.mesh.size()}, causal={self.causal}, overlap={self.overlap}"


class RingAttention(ParallelStyle):
    """Ring attention for a :class:`LocalAttention`, applied on the 1-D ring mesh.

    ``parallelize_module(inner, pmesh.ring, RingAttention())`` returns the
    module to use in its place (assign it). Apply it BEFORE
    :class:`~ulysses_dtensor.parallel.ulysses.UlyssesAttention` on the ulysses mesh, whose
    hooks then wrap the ring. A size-1 mesh returns the module unchanged.
    """

    def __init__(self, *, overlap: bool = True):
        super().__init__()
        self.overlap = overlap

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"RingAttention must be applied on the 1-D ring mesh (pmesh.ring), got a "
                f"{device_mesh.ndim}-D mesh with dims {device_mesh.mesh_dim_names}"
            )
        if not isinstance(module, LocalAttention):
            raise TypeError(f"RingAttention applies to a LocalAttention, got {type(module).__name__}")
        check_ring_backend(module.backend)
        for name in ("window", "softcap"):
            if getattr(module, name, None) is not None:
                raise ValueError(refused_pattern(name, getattr(module, name)))
        if device_mesh.size() == 1:
            return module
        return RingLocalAttention(device_mesh, causal=module.causal, scale=module.scale, overlap=self.overlap)


def check_ring_backend(backend: str) -> str:
    if backend not in RING_BACKENDS:
        raise ValueError(
            f"attention backend {backend!r} cannot run inside ring attention (ring > 1): the ring "
            f"merges per-block outputs by their log-sum-exp, which it takes from SDPA's kernels; "
            f"valid: {', '.join(RING_BACKENDS)}"
        )
    return backend


# ---------------------------------------------------------------------------
# Communication volume
# ---------------------------------------------------------------------------


def ring_bytes_per_rank(
    batch: int,
    seq: int,
    kv_heads: int,
    head_dim: int,
    ring: int,
    element_size: int,
    *,
    backward: bool = True,
    grad_element_size: int = 4,
) -> int:
    """Bytes one rank sends around the ring for one attention layer.

    A block is k and v of ``seq / ring`` tokens and ``kv_heads`` heads (the kv
    heads a rank holds after the Ulysses exchange). Forward sends ``ring - 1``
    blocks; backward sends them again plus ``ring`` fp32 dk/dv accumulators
    (``grad_element_size``): ``2*B*(S/ring)*kv*D * ((ring-1)*(2e) + ring*4)``.
    """
    if ring == 1:
        return 0
    block = 2 * batch * (seq // ring) * kv_heads * head_dim
    sent = (ring - 1) * block * element_size
    if backward:
        sent += (ring - 1) * block * element_size + ring * block * grad_element_size
    return sent


def usp_bytes_per_rank(
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ring: int,
    ulysses: int,
    element_size: int,
    *,
    backward: bool = True,
) -> int:
    """Ulysses all-to-all bytes over ``ulysses`` ranks + ring bytes over ``ring`` ranks, one layer."""
    from .ulysses import exchange_bytes_per_rank, kv_replication

    a2a = exchange_bytes_per_rank(batch, seq // ring, heads, kv_heads, head_dim, ulysses, element_size, backward=backward)
    kv_local = kv_heads * kv_replication(heads, kv_heads, ulysses) // ulysses
    return a2a + ring_bytes_per_rank(batch, seq, kv_local, head_dim, ring, element_size, backward=backward)
