"""One ring block's steps: which chunk pairs attend, their kernel calls, the merge
and the transfers, forward (:func:`ring_forward`) and backward (:func:`ring_backward`).

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

The two functions are the ring's autograd Function (``_RingAttentionFn``) and what
head chunks (:mod:`~ulysses_dtensor.parallel.head_chunks`) call per chunk of heads.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ..attention.capabilities import Capabilities
from ..attention.documents import cached_for_documents
from ..attention.select import FEATURES
from .head_chunks import edges_only
from .ring_kernels import PairKernel, kernel_for, pair_backward, pair_forward
from .ring_layout import Documents, original_segment_ids

__all__ = ["RingState", "refused_pattern", "ring_backward", "ring_documents", "ring_forward"]

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


class RingState(NamedTuple):
    """What a ring block's backward needs besides the tensors it saves (q, the own k/v
    block, out, lse): the block's documents, its k/v shape, each step's kernel states
    and the ring's collective arguments."""

    docs: Documents | None
    kv_shape: torch.Size
    states: list
    group: object
    rank: int
    size: int
    causal: bool
    scale: float | None
    overlap: bool


def _steps(size: int) -> list[int]:
    """The ring's steps: all of them, or while the memory planner traces a step at its edges
    (:func:`~.head_chunks.edge_chunks_only`) steps 0, 1, 2 and the last. From step 2 on every
    step but the last holds the same buffers (the block before it until its views are
    dropped, its own, the next in flight, the merge, the travelling dk/dv accumulator), so
    the others repeat step 2's memory; the block step 2 receives stands for the last step's."""
    if not edges_only() or size <= 4:
        return list(range(size))
    return [0, 1, 2, size - 1]


def ring_forward(q, k, v, docs, group, rank, size, causal, scale, overlap,
                 own: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, RingState]:
    """One ring block's attention: q (B, H, S, D), k/v (B, Hkv, S, D) in ring layout.
    Returns out, lse (float32), the own k/v block (packed, what the backward passes
    around again) and the :class:`RingState` the backward needs. ``own``: that packed
    block from an earlier call on the same k and v (head chunks of one kv head), reused."""
    s = q.shape[2]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    acc = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
    lse_acc = torch.empty(q.shape[:3], dtype=acc_dtype, device=q.device)
    states = {}  # step -> its kernel calls' states
    kernels = _pair_kernels(q)
    # The block that travels: k and v packed in one buffer (one copy of each).
    if own is None:
        own = k.new_empty(2 * k.numel())
        k_own, v_own = _split_kv(own, k.shape)
        k_own.copy_(k)
        v_own.copy_(v)
    kv = own
    for i in _steps(size):
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
        states[i] = step_states
        if nxt is not None:
            kv = _wait(nxt)
    out = acc.to(q.dtype)
    del acc
    return out, lse_acc, own, RingState(docs, k.shape, states, group, rank, size, causal, scale, overlap)


def ring_backward(dout, tensors: list, st: RingState) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one ring block from :func:`ring_forward`'s tensors ``[q, own k/v block,
    out, lse]`` and state. The list is emptied: the own block goes as soon as the ring has
    passed it on (the caller's references to it must go too)."""
    q, kv, out, lse = tensors
    tensors.clear()
    group, rank, size, causal, scale, overlap = st.group, st.rank, st.size, st.causal, st.scale, st.overlap
    kv_shape, docs = st.kv_shape, st.docs
    s = q.shape[2]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    kernels = _pair_kernels(q)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dkv = None  # the block's fp32 dk/dv accumulator, passed on with it
    for i in _steps(size):
        nxt = _next_block(kv, i, group, rank, size, overlap)
        src = (rank - i) % size
        kb, vb = _split_kv(kv, kv_shape)
        pending = []  # this step's dk/dv pieces, added once the block's accumulator is here
        calls = _calls(i, rank, src, size, causal, s, docs, kernels)
        for c, state in zip(calls, st.states[i]):
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
        acc = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device) if dkv is None else _wait(dkv)
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
    return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype)


class _RingAttentionFn(torch.autograd.Function):
    """q (B, H, S, D), k/v (B, Hkv, S, D): this rank's ring block, in ring layout."""

    @staticmethod
    def forward(ctx, q, k, v, docs, group, rank, size, causal, scale, overlap):
        out, lse, own, ctx.state = ring_forward(q, k, v, docs, group, rank, size, causal, scale, overlap)
        ctx.save_for_backward(q, own, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ring_backward(dout, list(ctx.saved_tensors), ctx.state)
        ctx.state = None
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_documents(document_ids: Tensor, ring: int) -> Documents:
    """The batch's :class:`Documents` (layout-order ids in), built once per batch:
    every layer of a step shares it, with its host-side edges and runs."""
    return cached_for_documents(
        "ring_documents", document_ids, (ring,),
        lambda: Documents(original_segment_ids(document_ids, ring), 2 * ring),
    )


def refused_pattern(name: str, value) -> str:
    """The one message for an attention pattern the ring does not implement."""
    return (
        f"ring attention (ring > 1) does not implement {FEATURES[name]} ({name}={value}): its blocks are "
        f"merged from plain causal kernels; run this model with ring=1 (Ulysses only, sp up to the head count)"
    )
