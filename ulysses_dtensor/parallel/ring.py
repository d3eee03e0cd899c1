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

Work is done per (query chunk, key chunk) pair: at step 0 the rank's own
chunks (causal) and its tail against its head; from an earlier rank's block
both our chunks against its head chunk; from a later rank's block our tail
against both of its chunks (causal masking makes the rest empty: balanced).
Backward runs each pair as kernels on halves of its rows and keys, so a
kernel's workspace (FlashAttention's fp32 dq accumulator, GQA-expanded dk/dv)
and its dq cover a quarter of a chunk pair.

Packed documents: every rank holds the global document ids (layout order).
A pair of different chunks shares at most one document, so it is attention of a
row slice over a row slice, no mask; a chunk against itself runs over its
document runs (FlashAttention varlen on CUDA in 16-bit, else a dense mask). The
edges and runs are read to the host once per batch (not per layer), which is
why a ring block cannot be compiled with ``fullgraph`` when documents are packed.

Overlap: each step issues the next block's transfer (an asynchronous functional
``all_to_all_single`` that only sends to ``rank + 1``) before attending to the
current block, and waits for it after; backward also overlaps the dk/dv
accumulator arriving from ``rank - 1``. ``overlap=False`` waits at once (the
benchmark's reference).

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

import math
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from ..attention import FEATURES, LocalAttention, local_attention
from ..attention.capabilities import Capabilities
from ..attention.documents import cached_for_documents
from .ring_kernels import PairKernel, kernel_for, pair_backward, pair_forward
from .ring_layout import (
    Documents,
    layout_indices,
    layout_position_ids,
    original_segment_ids,
    seq_multiple,
)

__all__ = [
    "RING_BACKENDS",
    "RingAttention",
    "RingLocalAttention",
    "layout_indices",
    "layout_position_ids",
    "ring_attention",
    "ring_bytes_per_rank",
    "seq_multiple",
    "usp_bytes_per_rank",
]

# The ring merges blocks by LSE, which only SDPA's kernels return here.
RING_BACKENDS = ("auto", "sdpa")


# ---------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------


def _chunk_pairs(i: int, rank: int, src: int, causal: bool) -> list[tuple[int, int]]:
    """(query chunk, key chunk) pairs attended at step i (chunk 0 = head, 1 = tail).

    Step 0 is the rank's own block: the two diagonal pairs come first (they
    start every query row's running output), causal ones when ``causal``. With
    causal masking an earlier rank's head chunk precedes both our chunks (its
    tail follows both), and only our tail chunk follows a later rank's block.
    """
    if i == 0:
        return [(0, 0), (1, 1), (1, 0)] if causal else [(0, 0), (1, 1), (1, 0), (0, 1)]
    if not causal:
        return [(0, 0), (0, 1), (1, 0), (1, 1)]
    return [(0, 0), (1, 0)] if src < rank else [(1, 0), (1, 1)]


class _Call(NamedTuple):
    """One kernel call of a ring step, on slices of this rank's block."""

    rows: slice  # batch rows
    q_rows: slice
    k_rows: slice
    causal: bool
    kernel: PairKernel
    mask: Tensor | None  # dense additive mask of a diagonal pair's documents
    runs: tuple | None  # or its document runs, for varlen
    diagonal: bool


def _pair_kernels(q: Tensor) -> tuple[PairKernel, PairKernel]:
    """(plain pairs, diagonal pairs of packed documents) kernels for q (B, H, S, D):
    the plain pairs follow the local kernel table on this machine."""
    caps = Capabilities.probe(q.device) if q.is_cuda else None
    return tuple(kernel_for(q.device.type, q.dtype, q.shape[-1], documents, caps) for documents in (False, True))


def _calls(i, rank, src, size, causal, s, docs: Documents | None, kernels) -> list[_Call]:
    """The kernel calls of step i.

    Rows are slices of this rank's block (chunk c is ``[c*s/2, (c+1)*s/2)``).
    Without documents, one call per chunk pair. With documents, a diagonal pair
    runs over the chunk's document runs (varlen, or a dense mask: ``kernels``)
    and any other pair over the one document it may share, per batch row.
    """
    plain, diagonal_kernel = kernels
    # A document shared across chunks can leave a slice of one token, which cuDNN
    # attention does not take (a key length of 1): those slices run FlashAttention.
    shared_kernel = PairKernel("flash", plain.head_dim) if plain.name == "cudnn" else plain
    half = s // 2
    out = []
    for qc, kc in _chunk_pairs(i, rank, src, causal):
        qs, ks = slice(qc * half, (qc + 1) * half), slice(kc * half, (kc + 1) * half)
        diagonal = i == 0 and qc == kc
        pair_causal = diagonal and causal
        if docs is None:
            out.append(_Call(slice(None), qs, ks, pair_causal, plain, None, None, diagonal))
            continue
        pq, pk = _position(rank, qc, size), _position(src, kc, size)
        if diagonal:
            if diagonal_kernel.name == "varlen":
                out.append(_Call(slice(None), qs, ks, pair_causal, diagonal_kernel, None, docs.runs(pq), True))
            else:
                mask = _dense_mask(docs.chunk(pq), pair_causal)
                out.append(_Call(slice(None), qs, ks, pair_causal, diagonal_kernel, mask, None, True))
            continue
        for b, q_rows, k_rows in docs.shared(pq, pk):
            q_abs = slice(qs.start + q_rows.start, qs.start + q_rows.stop)
            k_abs = slice(ks.start + k_rows.start, ks.start + k_rows.stop)
            out.append(_Call(slice(b, b + 1), q_abs, k_abs, False, shared_kernel, None, None, False))
    return out


def ring_documents(document_ids: Tensor, ring: int) -> Documents:
    """The batch's :class:`Documents` (layout-order ids in), built once per batch:
    every layer of a step shares it, with its host-side edges and runs."""
    return cached_for_documents(
        "ring_documents", document_ids, (ring,),
        lambda: Documents(original_segment_ids(document_ids, ring), 2 * ring),
    )


def _halves(sl: slice) -> list[slice]:
    mid = (sl.start + sl.stop) // 2
    return [sl] if sl.stop - sl.start < 2 else [slice(sl.start, mid), slice(mid, sl.stop)]


def _backward_pieces(call: _Call):
    """One backward call as kernels on halves of its rows and keys: (q rows, k rows, causal, mask).

    A backward kernel's workspace scales with its rows and keys (FlashAttention:
    an fp32 dq accumulator over the rows, dk/dv expanded to every query head
    over the keys under GQA): quarter-size kernels keep it, and each kernel's
    dq, at a quarter of a chunk pair's. A causal (diagonal) pair keeps its
    causal squares and drops the quarter above them. Varlen calls stay whole
    (their sequences are the chunk's documents).
    """
    qs, ks, causal, mask = call.q_rows, call.k_rows, call.causal, call.mask
    if call.runs is not None:
        return [(qs, ks, causal, mask)]
    pieces = []
    for a, q in enumerate(_halves(qs)):
        for b, k in enumerate(_halves(ks)):
            if causal and b > a:
                continue  # keys after every query of the piece
            m = None if mask is None else mask[:, :, q.start - qs.start : q.stop - qs.start, k.start - ks.start : k.stop - ks.start]
            pieces.append((q, k, causal and a == b, m))
    return pieces


def _position(rank: int, c: int, size: int) -> int:
    """Where chunk c of ring rank ``rank``'s block sits in the original sequence."""
    return rank if c == 0 else 2 * size - 1 - rank


def _dense_mask(seg: Tensor, causal: bool) -> Tensor:
    """(B, 1, C, C) additive mask of a chunk's documents (causal within each)."""
    allowed = seg[:, :, None] == seg[:, None, :]
    if causal:
        allowed &= torch.ones(allowed.shape[1:], dtype=torch.bool, device=seg.device).tril()
    return torch.zeros(allowed.shape, device=seg.device).masked_fill_(~allowed, float("-inf"))[:, None]


def _merge(acc: Tensor, lse_acc: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold one call's (out, LSE) into the running ones, in place (views of the rows it covers).

    ``out = out_acc * e^(lse_acc - lse) + out_b * e^(lse_b - lse)`` with
    ``lse = logaddexp(lse_acc, lse_b)``: only (B, H, S)-sized temporaries.
    """
    lse = torch.logaddexp(lse_acc, lse_b)
    acc.mul_(torch.exp(lse_acc - lse).unsqueeze(-1))
    acc.addcmul_(out_b, torch.exp(lse_b - lse).unsqueeze(-1))
    lse_acc.copy_(lse)


def _send_to_next(buf: Tensor, group, rank: int, size: int) -> Tensor:
    """Asynchronously send ``buf`` to ring rank+1 and receive rank-1's (same size)."""
    n = buf.numel()
    send = [0] * size
    recv = [0] * size
    send[(rank + 1) % size] = n
    recv[(rank - 1) % size] = n
    return funcol.all_to_all_single(buf, recv, send, group)


def _next_block(kv: Tensor, step: int, group, rank: int, size: int, overlap: bool) -> Tensor | None:
    """Start passing the current block on (none after the last step); without
    ``overlap`` wait for it at once, the benchmark's serial reference."""
    if step == size - 1:
        return None
    nxt = _send_to_next(kv, group, rank, size)
    return nxt if overlap else _wait(nxt)


def _wait(t: Tensor) -> Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _split_kv(buf: Tensor, shape) -> tuple[Tensor, Tensor]:
    n = math.prod(shape)
    return buf[:n].view(shape), buf[n:].view(shape)


class _RingAttentionFn(torch.autograd.Function):
    """q (B, H, S, D), k/v (B, Hkv, S, D): this rank's ring block, in ring layout."""

    @staticmethod
    def forward(ctx, q, k, v, docs, group, rank, size, causal, scale, overlap):
        s = q.shape[2]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        acc = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
        lse_acc = torch.empty(q.shape[:3], dtype=acc_dtype, device=q.device)
        states = []
        kernels = _pair_kernels(q)
        # The block that travels: k and v packed in one buffer (one copy of each).
        kv = own = k.new_empty(2 * k.numel())
        k_own, v_own = _split_kv(kv, k.shape)
        k_own.copy_(k)
        v_own.copy_(v)
        for i in range(size):
            nxt = _next_block(kv, i, group, rank, size, overlap)
            src = (rank - i) % size
            kb, vb = _split_kv(kv, k.shape)
            step_states = []
            for c in _calls(i, rank, src, size, causal, s, docs, kernels):
                rows, qs, ks = c.rows, c.q_rows, c.k_rows
                out_p, lse_p, state = pair_forward(
                    c.kernel, q[rows, :, qs], kb[rows, :, ks], vb[rows, :, ks], c.causal, scale,
                    None if c.mask is None else c.mask.to(q.dtype), c.runs,
                )
                if c.diagonal:  # every query sees itself here: it starts its row's running output
                    acc[rows, :, qs] = out_p
                    lse_acc[rows, :, qs] = lse_p
                else:
                    _merge(acc[rows, :, qs], lse_acc[rows, :, qs], out_p, lse_p)
                step_states.append(state)
                del out_p, lse_p
            states.append(step_states)
            if nxt is not None:
                kv = _wait(nxt)
        out = acc.to(q.dtype)
        del acc
        ctx.save_for_backward(q, own, out, lse_acc)
        ctx.docs, ctx.kv_shape, ctx.states = docs, k.shape, states
        ctx.args = (group, rank, size, causal, scale, overlap)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        group, rank, size, causal, scale, overlap = ctx.args
        kv_shape, docs = ctx.kv_shape, ctx.docs
        s = q.shape[2]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        kernels = _pair_kernels(q)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dkv = None  # the block's fp32 dk/dv accumulator, passed on with it
        for i in range(size):
            nxt = _next_block(kv, i, group, rank, size, overlap)
            src = (rank - i) % size
            kb, vb = _split_kv(kv, kv_shape)
            pending = []  # this step's dk/dv pieces, added once the block's accumulator is here
            calls = _calls(i, rank, src, size, causal, s, docs, kernels)
            for c, state in zip(calls, ctx.states[i]):
                rows = c.rows
                for qs, ks, pair_causal, mask in _backward_pieces(c):
                    dq_p, dk_p, dv_p = pair_backward(
                        c.kernel, dout[rows, :, qs], q[rows, :, qs], kb[rows, :, ks], vb[rows, :, ks],
                        out[rows, :, qs], lse[rows, :, qs].contiguous(), pair_causal, scale, state,
                        None if mask is None else mask.to(q.dtype),
                    )
                    dq[rows, :, qs] += dq_p
                    pending.append((rows, ks, dk_p, dv_p))
                    del dq_p
            # The accumulator of the block held now, from the ranks that held it before.
            acc = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device) if i == 0 else _wait(dkv)
            dk_acc, dv_acc = _split_kv(acc, kv_shape)
            for rows, ks, dk_p, dv_p in pending:
                dk_acc[rows, :, ks] += dk_p
                dv_acc[rows, :, ks] += dv_p
            del pending
            dkv = _send_to_next(acc, group, rank, size)  # the last send brings each home
            if not overlap:
                dkv = _wait(dkv)
            if nxt is not None:
                kv = _wait(nxt)
        dk, dv = _split_kv(_wait(dkv), kv_shape)
        ctx.states = ctx.docs = None
        return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype), None, None, None, None, None, None, None


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


def refused_pattern(name: str, value) -> str:
    """The one message for an attention pattern the ring does not implement."""
    return (
        f"ring attention (ring > 1) does not implement {FEATURES[name]} ({name}={value}): its blocks are "
        f"merged from plain causal kernels; run this model with ring=1 (Ulysses only, sp up to the head count)"
    )


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
