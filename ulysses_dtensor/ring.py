"""Ring attention over the ``ring`` dim of a USP mesh, and its causal load balancing.

USP (Ulysses x ring): ``sp = ring x ulysses``. The Ulysses all-to-all runs over
the ``ulysses`` ranks (inside a node) and leaves each rank with ``S / ring``
tokens of ``H / ulysses`` heads: one ring block. Ring attention then passes the
k/v blocks around the ``ring`` ranks (across nodes); every rank attends its own
queries to each block in turn and merges the partial outputs by their
log-sum-exp (LSE). Per layer a rank sends ``ring - 1`` k/v blocks forward;
backward sends them again plus ``ring`` blocks of fp32 dk/dv accumulators, which
travel with their block and come home at the end (:func:`ring_bytes_per_rank`).

Load balancing (causal). The sequence is cut into ``2 * ring`` chunks and ring
rank ``r`` holds chunks ``r`` and ``2*ring-1-r`` ("head-tail"), so every rank
does the same causal work: at step 0 its own block (causal); from a block of an
earlier rank only the block's first chunk (seen by both of its chunks, no mask);
from a later rank only its second chunk attends (to the whole block, no mask).
:func:`layout_indices` gives that order; ``shard_batch`` applies it to the
batch BEFORE slicing (labels already shifted, position ids global), so the
model never sees the reordering except through the document ids, which stay
global (in layout order) for the masks.

Packed documents: every rank holds the global document ids, so the mask of any
(query block, key block) pair is known locally: same document, plus causal on
the diagonal step. On CPU each block runs SDPA's CPU flash kernel with a dense
per-block mask; rows with no visible key in a block get LSE -inf (the kernel
itself reports 0), so they add nothing to the merge.

Overlap: each step issues the next block's transfer (an asynchronous functional
``all_to_all_single`` that only sends to ``rank + 1``) before attending to the
current block, and waits for it after. ``overlap=False`` waits at once (the
benchmark's reference). Backward overlaps the same way, and also the dk/dv
accumulator arriving from ``rank - 1`` with the current block's gradients.

What is PyTorch's and what is ours
----------------------------------
Reused: the LSE-returning SDPA kernels (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward, which also take GQA k/v natively; on CUDA the flash and
memory-efficient ops), functional collectives (async ``all_to_all_single``),
``_SDPAMerger`` (the LSE merge, including the half-query update) and
``_HeadTailLoadBalancer`` (the layout) from
``torch.distributed.tensor.experimental._attention``.

Written here, the loop itself (forward and backward): torch's
``_templated_ring_attention`` passes the same kernel arguments to every step,
so it cannot give each block its own document mask; its step and rotation
choices live in a process-wide ``_cp_options`` (all-gather rotation by
default, load balancing on, which refuses non-causal attention), and it has no
switch to measure the overlap. It does run on gloo and with GQA.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from .attention import LocalAttention, _cached_for, _segment_ids, local_attention

from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

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
_aten = torch.ops.aten


# ---------------------------------------------------------------------------
# Layout (causal load balancing)
# ---------------------------------------------------------------------------


def seq_multiple(sp: int, ring: int) -> int:
    """What a sequence length must be a multiple of: sp slices and 2*ring chunks."""
    return sp if ring == 1 else math.lcm(sp, 2 * ring)


def layout_indices(seq_len: int, ring: int, device=None) -> Tensor:
    """(seq_len,) int64: slot i of the ring layout holds original token ``idx[i]``.

    Ring rank r's block is ``[chunk r, chunk 2*ring-1-r]`` of ``2*ring`` equal
    chunks; blocks follow each other in ring-rank order. ``ring=1``: identity.
    """
    if ring == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * ring):
        raise ValueError(
            f"the ring layout needs a sequence length divisible by 2*ring={2 * ring}, got "
            f"{seq_len}; pad it (shard_batch pads to a multiple of lcm(sp, 2*ring))"
        )
    return _HeadTailLoadBalancer(seq_len, ring, device)._generate_indices()[0].long()


def layout_position_ids(local_len: int, sp_rank: int, sp_size: int, ring: int, device=None) -> Tensor:
    """(local_len,) global positions of sp rank ``sp_rank``'s slots (one document per row)."""
    idx = layout_indices(local_len * sp_size, ring, device)
    return idx[sp_rank * local_len : (sp_rank + 1) * local_len]


def _ring_segment_ids(document_ids: Tensor, ring: int) -> Tensor:
    """Layout-order document ids -> layout-order segment ids (one per run in ORIGINAL order).

    A document is a run of equal ids in the original order (as everywhere in
    this package); the layout splits runs, so runs are found on the restored
    order and the ids mapped back.
    """
    s = document_ids.shape[1]
    idx = layout_indices(s, ring, document_ids.device)
    original = torch.empty_like(document_ids)
    original[:, idx] = document_ids
    return _segment_ids(original)[:, idx]


# ---------------------------------------------------------------------------
# Block kernels: (out, lse) and gradients of one (query part, key block) pair
# ---------------------------------------------------------------------------


def _block_forward(q, k, v, causal: bool, mask: Tensor | None, scale):
    """q (B, H, Sq, D), k/v (B, Hkv, Sk, D) -> out (B, H, Sq, D), lse (B, H, Sq) fp32, kernel state."""
    if q.device.type == "cuda":
        return _cuda_block_forward(q, k, v, causal, mask, scale)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    return out, lse, None


def _block_backward(dout, q, k, v, out, lse, causal: bool, mask, scale, state):
    if q.device.type == "cuda":
        return _cuda_block_backward(dout, q, k, v, out, lse, causal, mask, scale, state)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )


# CUDA: the kernels torch's own context parallelism rings on. No GPU was lent
# while this was written: these two are exercised on meta tensors only.
def _cuda_block_forward(q, k, v, causal, mask, scale):
    if mask is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, ("flash", cum_q, cum_k, seed, offset)
    # Memory-efficient kernel: any dtype, an additive bias for documents, no GQA.
    kr, vr = _repeat_heads(k, v, q.shape[1])
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, kr, vr, _cuda_bias(mask, q.shape[1]), True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]], ("efficient", seed, offset)


def _cuda_block_backward(dout, q, k, v, out, lse, causal, mask, scale, state):
    # ``state`` comes from the step's forward call; without dropout the kernels
    # read only its layout (dense batches), so it serves the sub-blocks too.
    if state[0] == "flash":
        _, cum_q, cum_k, seed, offset = state
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
            scale=scale,
        )
    _, seed, offset = state
    kr, vr = _repeat_heads(k, v, q.shape[1])
    lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel pads LSE rows to 32
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, kr, vr, _cuda_bias(mask, q.shape[1]), out, lse, seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale,
    )
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # gradients of the repeated heads sum into their kv head
        b, h, s, d = dk.shape
        dk, dv = (t.view(b, h // rep, rep, s, d).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _repeat_heads(k, v, heads: int):
    rep = heads // k.shape[1]
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))


def _cuda_bias(mask: Tensor | None, heads: int) -> Tensor | None:
    if mask is None:
        return None
    # The kernel wants the key dim 16-aligned: allocate padded, view the real part.
    b, _, sq, sk = mask.shape
    padded = mask.new_zeros(b, 1, sq, -(-sk // 16) * 16)
    padded[..., :sk] = mask
    return padded[..., :sk].expand(b, heads, sq, sk)


# ---------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------


class _Step:
    """Which part of the queries meets which part of the held k/v block, and how (forward)."""

    __slots__ = ("q", "k", "causal")

    def __init__(self, i: int, rank: int, src: int, causal: bool, s: int):
        full, head, tail = slice(0, s), slice(0, s // 2), slice(s // 2, s)
        self.q, self.k, self.causal = full, full, False
        if i == 0:
            self.causal = causal  # own block: causal within [head, tail]
        elif causal and src < rank:
            self.k = head  # the earlier rank's head chunk precedes both of ours; its tail follows both
        elif causal:
            self.q = tail  # only our tail chunk comes after a later rank's block


def _chunk_pairs(i: int, rank: int, src: int, causal: bool) -> list[tuple[int, int, bool]]:
    """The same work as :class:`_Step`, as (query chunk, key chunk, causal) pairs (0 head, 1 tail).

    Backward runs one kernel per pair: a kernel's workspace (FlashAttention's
    fp32 dq accumulator, GQA-expanded dk/dv) and its dq then cover half a block.
    """
    if not causal:
        return [(a, b, False) for a in (0, 1) for b in (0, 1)]
    if i == 0:
        return [(0, 0, True), (1, 0, False), (1, 1, True)]
    return [(0, 0, False), (1, 0, False)] if src < rank else [(1, 0, False), (1, 1, False)]


def _block_mask(seg, rank, src, qs: slice, ks: slice, causal: bool, s: int, dtype):
    """Dense additive mask of one block pair (same document; causal on the diagonal) and its row coverage."""
    if seg is None:
        return None, None
    q_ids = seg[:, rank * s : (rank + 1) * s][:, qs]
    k_ids = seg[:, src * s : (src + 1) * s][:, ks]
    allowed = q_ids[:, :, None] == k_ids[:, None, :]
    if causal:
        allowed &= torch.ones(allowed.shape[1:], dtype=torch.bool, device=seg.device).tril()
    mask = torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill_(~allowed, float("-inf"))
    return mask[:, None], allowed.any(-1)[:, None]


def _merge(acc: Tensor, lse_acc: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold one block's (out, LSE) into the running ones, in place (views of the rows it covers).

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


def _wait(t: Tensor) -> Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _split_kv(buf: Tensor, shape) -> tuple[Tensor, Tensor]:
    n = math.prod(shape)
    return buf[:n].view(shape), buf[n:].view(shape)


class _RingAttentionFn(torch.autograd.Function):
    """q (B, H, S, D), k/v (B, Hkv, S, D): this rank's ring block, in ring layout."""

    @staticmethod
    def forward(ctx, q, k, v, seg, group, rank, size, causal, scale, overlap):
        s = q.shape[2]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        acc = lse_acc = None
        states = []
        # The block that travels: k and v packed in one buffer (one copy of each).
        kv = k.new_empty(2 * k.numel())
        k_own, v_own = _split_kv(kv, k.shape)
        k_own.copy_(k)
        v_own.copy_(v)
        own = kv
        for i in range(size):
            nxt = None
            if i < size - 1:
                nxt = _send_to_next(kv, group, rank, size)
                if not overlap:
                    nxt = _wait(nxt)
            src = (rank - i) % size
            step = _Step(i, rank, src, causal, s)
            kb, vb = _split_kv(kv, k.shape)
            mask, rows = _block_mask(seg, rank, src, step.q, step.k, step.causal, s, q.dtype)
            out_b, lse_b, state = _block_forward(
                q[:, :, step.q], kb[:, :, step.k], vb[:, :, step.k], step.causal and mask is None, mask, scale
            )
            if rows is not None:
                # No visible key in this block: no contribution (the CPU kernel says LSE 0).
                lse_b = lse_b.masked_fill(~rows, float("-inf"))
                out_b = out_b.masked_fill(~rows[..., None], 0.0)
            if i == 0:  # every query sees at least itself here: finite LSE from now on
                acc, lse_acc = out_b.to(acc_dtype), lse_b.to(acc_dtype)
            else:
                _merge(acc[:, :, step.q], lse_acc[:, :, step.q], out_b, lse_b)
            states.append(state)
            del out_b, lse_b, mask
            if nxt is not None:
                kv = _wait(nxt)
        out, lse = acc.to(q.dtype), lse_acc
        del acc
        ctx.save_for_backward(q, own, out, lse, seg)
        ctx.kv_shape = k.shape
        ctx.states = states
        ctx.args = (group, rank, size, causal, scale, overlap)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, seg = ctx.saved_tensors
        group, rank, size, causal, scale, overlap = ctx.args
        kv_shape = ctx.kv_shape
        s = q.shape[2]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        halves = (slice(0, s // 2), slice(s // 2, s))
        dkv = None  # the block's fp32 dk/dv accumulator, passed on with it
        for i in range(size):
            nxt = None
            if i < size - 1:
                nxt = _send_to_next(kv, group, rank, size)
                if not overlap:
                    nxt = _wait(nxt)
            src = (rank - i) % size
            kb, vb = _split_kv(kv, kv_shape)
            pending = []  # this step's dk/dv pieces, added once the block's accumulator is here
            for qc, kc, pair_causal in _chunk_pairs(i, rank, src, causal):
                qs, ks = halves[qc], halves[kc]
                mask, _ = _block_mask(seg, rank, src, qs, ks, pair_causal, s, q.dtype)
                dq_p, dk_p, dv_p = _block_backward(
                    dout[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks], out[:, :, qs],
                    lse[:, :, qs].contiguous(), pair_causal and mask is None, mask, scale, ctx.states[i],
                )
                dq[:, :, qs] += dq_p
                pending.append((ks, dk_p, dv_p))
                del dq_p, mask
            # The accumulator of the block held now, from the ranks that held it before.
            acc = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device) if i == 0 else _wait(dkv)
            dk_acc, dv_acc = _split_kv(acc, kv_shape)
            for ks, dk_p, dv_p in pending:
                dk_acc[:, :, ks] += dk_p
                dv_acc[:, :, ks] += dv_p
            del pending
            dkv = _send_to_next(acc, group, rank, size)  # the last send brings each home
            if not overlap:
                dkv = _wait(dkv)
            if nxt is not None:
                kv = _wait(nxt)
        dk, dv = _split_kv(_wait(dkv), kv_shape)
        ctx.states = None
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
    seg = None
    if document_ids is not None:
        if tuple(document_ids.shape) != (b, s * size):
            raise ValueError(
                f"ring_attention: document_ids must cover the whole sequence, (B, S) = "
                f"{(b, s * size)}; got {tuple(document_ids.shape)}"
            )
        document_ids = document_ids.to(q.device)
        seg = _cached_for("ring_segments", document_ids, (size,), lambda: _ring_segment_ids(document_ids, size))
    out = _RingAttentionFn.apply(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        seg,
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

    def forward(self, q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None) -> Tensor:
        return ring_attention(
            q, k, v, self.mesh, causal=self.causal, document_ids=document_ids, scale=self.scale, overlap=self.overlap
        )

    def extra_repr(self) -> str:
        return f"ring={self.mesh.size()}, causal={self.causal}, overlap={self.overlap}"


class RingAttention(ParallelStyle):
    """Ring attention for a :class:`LocalAttention`, applied on the 1-D ring mesh.

    ``parallelize_module(inner, pmesh.ring, RingAttention())`` returns the
    module to use in its place (assign it). Apply it BEFORE
    :class:`~ulysses_dtensor.ulysses.UlyssesAttention` on the ulysses mesh, whose
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
