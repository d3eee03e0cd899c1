"""The attention kernel of one head chunk, split into a forward and a backward.

Head chunks (:mod:`.head_chunks`) run the exchange and the kernel chunk by chunk
over a rank's heads, forward and backward, inside ONE autograd function: the
backward of chunk c must run right after chunk c's gradient arrives, with only
that chunk's tensors alive. So the kernel cannot be left to autograd; each chunk
calls a :class:`SplitKernel`: ``forward`` returns the output and the few tensors
its backward needs (the log-sum-exp), ``backward`` takes them back with the
output's gradient. Tensors are in the kernel layout ``(batch, heads, seq,
head_dim)``, q ``Hq`` heads, k and v ``Hkv`` (GQA: ``Hq % Hkv == 0``).

Which split kernel runs a call follows the kernel that would run it unchunked
(:func:`split_kernel`), from the inner module's :meth:`call_spec` (what one call
computes: an :class:`~ulysses_dtensor.attention.local.AttentionCall`, or a
:class:`RingCall` under USP):

* :class:`PairSplit` -- the kernels with their LSE that the ring calls
  (:mod:`.ring_kernels`): SDPA's CPU flash kernel (``sdpa`` on CPU; documents
  and windows as a dense mask), on CUDA cuDNN (``cudnn``, plain causal), torch's
  flash and memory-efficient kernels (``sdpa``), torch's varlen FlashAttention
  (``varlen``, ``fa4``: documents as ``cu_seqlens``, windows). No recompute.
* :class:`RingSplit` -- ring attention over the chunk's heads (USP).
* :class:`RecomputeSplit` -- every other case: the inner module itself, run
  without grad in forward and again with grad in backward (one more attention
  forward per chunk). ``flex`` (sinks, soft-capping), the ``flash_attn``
  package, ``sdpa``'s explicit scores (soft-capping, sinks), ``cudnn`` with a
  mask, and any module that describes no call (a user's own).

While the memory planner traces (:func:`~ulysses_dtensor.attention.planning.planning_target`),
a call is planned as the target GPU's kernel, by its memory class: an ``lse``
kernel as the CPU flash kernel without a mask, ``dense_mask`` with its mask,
``dense_scores`` as the explicit scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.documents import cached_for_documents, cu_seqlens_from_document_ids, segment_ids
from ..attention.kernel_table import Case
from ..attention.local import AttentionCall
from ..attention.pattern import Pattern, dense_mask
from ..attention.planning import count_planned, planned_choice, planning_target
from ..attention.select import flash_head_dim, resolve_backend
from .ring_kernels import PairKernel, kernel_for, pair_backward, pair_forward

__all__ = ["PairSplit", "RecomputeSplit", "RingCall", "RingSplit", "SplitKernel", "split_kernel"]


class SplitKernel:
    """One attention call split in two. ``keeps_out``: the backward needs the output (given
    back to it unpadded, ``(B, Hq, S, Dv)``); ``keeps_kv``: it needs k and v (a kernel that
    keeps its own copy of them says no, and gets None)."""

    keeps_out = True
    keeps_kv = True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None):
        """-> (out (B, Hq, S, Dv), tensors the backward needs, anything else it needs)."""
        raise NotImplementedError

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None, saved, meta,
                 sinks: Tensor | None):
        """-> (dq, dk, dv, dsinks or None). ``saved``: the list of what forward kept, which
        the kernel may empty to let its tensors go early."""
        raise NotImplementedError

    def forward_done(self) -> None:
        """After the last chunk's forward: drop what only the forward shared between chunks
        (the kernel lives until the backward, and under activation checkpointing from the
        first forward on)."""

    def stand_in(self, kept, kv_first: bool) -> list[Tensor]:
        """Tensors as large as another chunk's ``kept`` (the memory planner's edge trace:
        :func:`~.head_chunks.edge_chunks_only`); ``kv_first``: that chunk starts a kv group."""
        return [torch.empty_like(t) for t in kept]


def _pad(t: Tensor, width: int) -> Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


class PairSplit(SplitKernel):
    """An LSE kernel of :mod:`.ring_kernels` over the whole sequence of a chunk.

    Those kernels take one head dim: a value head dim of its own (MLA) is
    zero-padded to the larger one, with the scale of the real q/k head dim, and
    the output and gradients cropped (exact). ``seg`` (segment ids of packed
    documents) and the window become a dense mask for the CPU flash and
    memory-efficient kernels (built per call, not kept between forward and
    backward), ``cu_seqlens`` and ``window_size`` for varlen.
    """

    def __init__(self, kernel: PairKernel, pattern: Pattern, scale: float | None, seg: Tensor | None,
                 runs=None, planned=None):
        self.kernel, self.pattern, self.scale, self.seg, self.runs = kernel, pattern, scale, seg, runs
        self.planned = planned  # the planner's Choice this kernel stands in for, counted per call

    def _mask(self, q: Tensor) -> Tensor | None:
        if self.kernel.name not in ("cpu_flash", "efficient"):
            return None
        allowed = dense_mask(self.seg, self.pattern, q.shape[2], q.device)
        if allowed is None:
            return None
        return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))

    def _causal(self, mask) -> bool:
        return self.pattern.causal and mask is None

    def _window(self) -> int | None:
        return self.pattern.window if self.kernel.name == "varlen" else None

    def forward(self, q, k, v, sinks):
        if self.planned is not None:
            count_planned(self.planned)
        d, dv = q.shape[-1], v.shape[-1]
        width = max(d, dv)
        scale = d**-0.5 if self.scale is None and d != width else self.scale
        mask = self._mask(q)
        out, lse, state = pair_forward(self.kernel, _pad(q, width), _pad(k, width), _pad(v, width),
                                       self._causal(mask), scale, mask, self.runs, self._window())
        return out, (lse,), state

    def stand_in(self, kept, kv_first: bool) -> list[Tensor]:
        if self.planned is not None:  # a call the planner's edge trace skips is a call of the step
            count_planned(self.planned)
        return super().stand_in(kept, kv_first)

    def backward(self, dout, q, k, v, out, saved, meta, sinks):
        (lse,) = saved
        d, dv = q.shape[-1], v.shape[-1]
        width = max(d, dv)
        scale = d**-0.5 if self.scale is None and d != width else self.scale
        mask = self._mask(q)
        dq, dk, dvv = pair_backward(self.kernel, _pad(dout, width), _pad(q, width), _pad(k, width),
                                    _pad(v, width), _pad(out, width), lse, self._causal(mask), scale, meta, mask)
        return dq[..., :d], dk[..., :d], dvv[..., :dv], None


class RecomputeSplit(SplitKernel):
    """Any attention call: ``fn(q, k, v, sinks)`` without grad in forward, again with
    grad in backward (its own autograd gives the gradients: one more forward)."""

    keeps_out = False

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]):
        self.fn = fn

    def forward(self, q, k, v, sinks):
        with torch.no_grad():
            return self.fn(q, k, v, sinks), (), None

    def backward(self, dout, q, k, v, out, saved, meta, sinks):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            s = None if sinks is None else sinks.detach().requires_grad_()
            o = self.fn(*inputs, s)
            grads = torch.autograd.grad(o, inputs + ([s] if s is not None else []), dout, allow_unused=True)
        dq, dk, dv = (torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads[:3]))
        return dq, dk, dv, (grads[3] if s is not None else None)


@dataclass(frozen=True)
class RingCall:
    """One ring-attention call (USP): what :class:`~.ring.RingLocalAttention` computes."""

    mesh: object  # the ring DeviceMesh
    causal: bool = True
    scale: float | None = None
    overlap: bool = True
    document_ids: Tensor | None = None


class RingSplit(SplitKernel):
    """Ring attention over a chunk's heads (:func:`~.ring_steps.ring_forward` /
    :func:`~.ring_steps.ring_backward`); a value head dim of its own is padded as
    :class:`PairSplit` pads it. The ring keeps its own packed copy of k and v (the block it
    passes around again in backward), one per kv head: the chunks of a kv head share it."""

    keeps_kv = False

    def __init__(self, call: RingCall):
        self.call = call
        self._own = (None, None)  # (k of the last call, its packed block)

    def _docs(self, q: Tensor):
        from .ring_steps import ring_documents

        ids = self.call.document_ids
        return None if ids is None else ring_documents(ids.to(q.device), self.call.mesh.size())

    def forward(self, q, k, v, sinks):
        from .ring_steps import ring_forward

        c = self.call
        d, dv, width = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        scale = d**-0.5 if c.scale is None and d != width else c.scale
        reuse = self._own[1] if self._own[0] is k else None
        out, lse, own, state = ring_forward(_pad(q, width), _pad(k, width), _pad(v, width), self._docs(q),
                                            c.mesh.get_group(), c.mesh.get_local_rank(), c.mesh.size(),
                                            c.causal, scale, c.overlap, own=reuse)
        self._own = (k, own)
        return out, (lse, own), (state, d, dv)

    def forward_done(self) -> None:
        self._own = (None, None)

    def stand_in(self, kept, kv_first: bool) -> list[Tensor]:
        lse, own = kept
        # The packed k/v block is one per kv group: a chunk in the middle of one shares it.
        return [torch.empty_like(lse), torch.empty_like(own) if kv_first else own]

    def backward(self, dout, q, k, v, out, saved, meta, sinks):
        from .ring_steps import ring_backward

        state, d, dv = meta
        width = max(d, dv)
        tensors = [_pad(q, width), saved[1], _pad(out, width), saved[0]]
        saved.clear()  # the packed block goes once the ring has passed it on, unless another chunk keeps it
        dq, dk, dvv = ring_backward(_pad(dout, width), tensors, state)
        return dq[..., :d], dk[..., :d], dvv[..., :dv], None


# --------------------------------------------------------------------------- #
# Which split kernel runs a call
# --------------------------------------------------------------------------- #


def _runs(seg: Tensor | None, document_ids: Tensor | None, b: int, s: int, device) -> tuple[Tensor, int]:
    """varlen's sequences: the documents (cu_seqlens over the flattened batch, built
    once per batch), else one per row."""
    if seg is None:
        return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device), s
    return cached_for_documents("cu_seqlens", document_ids, (device, b, s),
                                lambda: cu_seqlens_from_document_ids(seg))


def _local_fn(call: AttentionCall) -> Callable:
    """The call as :func:`~ulysses_dtensor.attention.local_attention` runs it, on the
    kernel layout (B, H, S, D)."""
    from ..attention import local_attention

    def fn(q, k, v, sinks):
        out = local_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=call.backend,
                              causal=call.causal, document_ids=call.document_ids, scale=call.scale,
                              window=call.window, softcap=call.softcap, sinks=sinks)
        return out.transpose(1, 2)

    return fn


def _planned(call: AttentionCall, q: Tensor, v: Tensor, pattern: Pattern, seg, caps, sinks: bool) -> SplitKernel:
    """The memory class of the target machine's kernel, on the CPU (the planner's trace)."""
    case = Case(q.dtype, q.shape[-1], v.shape[-1], documents=seg is not None, window=pattern.window is not None,
                softcap=pattern.softcap is not None, sinks=sinks)
    choice = planned_choice(call.backend, case, caps)
    cpu = PairKernel("cpu_flash", max(q.shape[-1], v.shape[-1]))
    if choice.memory == "lse":
        return PairSplit(cpu, Pattern(causal=pattern.causal), call.scale, None, planned=choice)
    if choice.memory == "dense_mask":
        return PairSplit(cpu, Pattern(pattern.causal, pattern.window), call.scale, seg, planned=choice)
    return RecomputeSplit(_local_fn(call))  # local_attention plans (and counts) each of its calls


def _for_attention(call: AttentionCall, q: Tensor, v: Tensor, sinks: bool) -> SplitKernel:
    from ..attention.pattern import check_pattern

    pattern = check_pattern(call.causal, call.window, call.softcap, None, q.shape[1])
    pattern = Pattern(pattern.causal, pattern.window, pattern.softcap, sinks)
    ids = call.document_ids
    if ids is not None and ids.device != q.device:
        ids = ids.to(q.device)
    # Once per batch: every layer's call shares them (a kernel keeps them until its backward).
    seg = None if ids is None else cached_for_documents("segment_ids", ids, (), lambda: segment_ids(ids))
    caps = planning_target()
    if caps is not None:
        return _planned(call, q, v, pattern, seg, caps, sinks)
    d, dv = q.shape[-1], v.shape[-1]
    backend = resolve_backend(call.backend, pattern.features(), q.device, q.dtype, d, v_head_dim=dv,
                              documents=ids is not None)
    masked = seg is not None or pattern.window is not None
    scores = pattern.softcap is not None or sinks  # only an explicit-scores path or flex/flash_attn shape them
    if scores or backend in ("flex", "flash_attn"):
        return RecomputeSplit(_local_fn(call))
    if q.device.type != "cuda":
        return PairSplit(PairKernel("cpu_flash", max(d, dv)), pattern, call.scale, seg)
    if backend in ("varlen", "fa4"):
        if backend == "fa4":
            from ..attention.packed import _fa4_active

            _fa4_active()
        b, s = q.shape[0], q.shape[2]
        kernel = PairKernel("varlen", kernel_for("cuda", q.dtype, max(d, dv), True).head_dim)
        return PairSplit(kernel, pattern, call.scale, seg, _runs(seg, ids, b, s, q.device))
    if backend == "cudnn":
        if masked:
            return RecomputeSplit(_local_fn(call))  # cuDNN's dense-mask path: no split kernel here
        return PairSplit(PairKernel("cudnn", flash_head_dim(max(d, dv))), pattern, call.scale, None)
    kernel = kernel_for("cuda", q.dtype, max(d, dv), False)  # sdpa: its flash kernel, or the memory-efficient one
    if masked and kernel.name != "efficient":
        kernel = PairKernel("efficient", max(d, dv))  # SDPA with a dense mask: its memory-efficient kernel
    return PairSplit(kernel, pattern, call.scale, seg)


def split_kernel(spec, fallback: Callable, q: Tensor, v: Tensor, sinks: bool) -> SplitKernel:
    """The split kernel of one call: ``spec`` is the inner module's description of it
    (an :class:`~ulysses_dtensor.attention.local.AttentionCall`, a :class:`RingCall`,
    or None), ``fallback(q, k, v, sinks)`` the module's own forward on the kernel
    layout (run by :class:`RecomputeSplit` when the call has no split kernel).
    ``q``, ``v``: a chunk's tensors (their device, dtype and head dims decide)."""
    if isinstance(spec, RingCall):
        if sinks:
            from .ring_steps import refused_pattern

            raise ValueError(refused_pattern("sinks", "a tensor per query head"))
        return RingSplit(spec)
    if isinstance(spec, AttentionCall):
        return _for_attention(spec, q, v, sinks)
    return RecomputeSplit(fallback)
