"""Head chunks: the Ulysses exchange and the attention kernel, a few heads at a time.

After the exchange a rank holds its ``hq`` heads over the WHOLE sequence: q, k,
v, the output, the log-sum-exp, and in backward their gradients and the
kernel's workspace (FlashAttention's float32 dq accumulator, and under GQA its
dk/dv expanded to every query head). At millions of tokens that working set,
proportional to ``hq``, is most of a GPU. With ``C`` head chunks the exchange
and the kernel run chunk by chunk over the rank's heads, forward and backward,
inside one autograd function, so only one chunk's full-sequence tensors and
gradients are alive at a time:

* forward, chunk c: exchange its q heads (and their k/v heads) from sequence to
  heads, run the kernel (split into forward and backward:
  :mod:`.head_chunk_kernels`), exchange the output back straight into its heads
  of the output tensor (no full-size copy). Kept for backward: the chunk's q, k,
  v and output in heads layout and its log-sum-exp -- what the kernel keeps
  unchunked, by chunks.
* backward, chunk c: exchange the output's gradient for its heads, run the
  kernel's backward, exchange dq back into its heads of dq. dq is written into
  the storage of the output's gradient when they match (a chunk's part of that
  gradient is dead once sent): no second full-size gradient. dk/dv of a kv head
  shared by several chunks are summed over them and sent back once.

In the send layout (:func:`~.grouped_exchange.grouped_attention`: our Llama's projections write
it), q arrives as one part per chunk and k, v as one per kv group, each its chunk's send
buffer; the received buffers are the kernel's inputs (views at batch 1, sequence
outermost: the layout the kernels write); the output's received buffer is the chunk's
part of the o-projection's input, returned as it is; in backward the output gradient's
parts are sent as they are and freed once sent, dq's received part taking their memory.
No layout copy at batch 1; in the ``(B, s, H, D)`` layout each exchange copies the
chunk's heads in or out.

Chunks follow the kv groups (GQA). With ``hk`` kv heads per rank, ``C`` divides
``hk`` (each chunk: ``hk / C`` kv heads and their query heads), or ``C`` is
``hk`` times a divisor of the group size ``hq / hk`` (a group's query heads
split over ``C / hk`` chunks; its k/v exchanged once, when its first chunk
starts, and their gradients sent back once). Llama-3-8B on sp 8 holds 4 query
heads and 1 kv head per rank: 1, 2 or 4 chunks, k/v exchanged once.
:func:`~.head_chunk_plan.valid_head_chunks` lists the counts.

Overlap: chunk c+1's exchange is issued (an asynchronous functional
all-to-all) before chunk c's kernel runs and waited after it, in forward (its
q, and k/v when a group starts) and in backward (its output gradient). The
outputs' exchanges are waited right after their kernel: at millions of tokens a
chunk's kernel takes seconds and its exchange milliseconds, and an output in
flight would hold two more chunk-size buffers at the peak.

``head_chunks=None`` (:func:`~.head_chunk_plan.auto_head_chunks`) chooses one query head per
chunk when one layer's exchanged attention tensors (q, k, v, the output and
their gradients, for the rank's heads over the whole sequence) would exceed
:data:`~.head_chunk_plan.AUTO_MIN_BYTES`, and no chunks below: chunks shrink what binds at long
context, and at short lengths would only add kernel launches and collectives.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..runtime.regions import region
from .comm_timing import active_timer
from .head_chunk_plan import Chunk, chunk_plan

__all__ = ["after_chunked_backward", "chunked_calls", "edge_chunks_only", "edges_only", "head_chunked_attention"]

# ---------------------------------------------------------------------------
# The exchange of one chunk's heads, on local tensors
# ---------------------------------------------------------------------------


class _Part(NamedTuple):
    x: Tensor  # (P, B, s, per_rank, D): this rank's slice of the sequence, destination rank first
    heads: tuple[int, int]  # the chunk's heads among a rank's per_rank


class _InFlight(NamedTuple):
    send: Tensor  # kept until the wait: the collective reads it until it ends
    recv: Tensor  # async until waited
    parts: tuple


def _by_rank(t: Tensor, size: int) -> Tensor:
    """A (B, s, P * per_rank, D) tensor as its (P, B, s, per_rank, D) view; a part already in
    the send layout (5-D) as it is."""
    if t.dim() == 5:
        return t
    return t.unflatten(2, (size, t.shape[2] // size)).permute(2, 0, 1, 3, 4)


def _marked(name: str, forward: bool):
    # Regions mark forward code (and its recompute); backward kernels carry none (runtime/regions.py).
    return region(name) if forward else contextlib.nullcontext()


def _issue(parts: list[_Part], size: int, group, forward: bool) -> _InFlight:
    """Start one all-to-all of the chunk's heads of ``parts`` (sequence -> heads)."""
    b, s = parts[0].x.shape[1:3]
    whole = parts[0]
    with _marked("ulysses.layout", forward):
        if len(parts) == 1 and whole.heads == (0, whole.x.shape[3]) and whole.x.is_contiguous():
            send = whole.x.flatten(3)  # a part in the send layout is the send buffer
        else:
            widths = [(p.heads[1] - p.heads[0]) * p.x.shape[-1] for p in parts]
            send = whole.x.new_empty(size, b, s, sum(widths))
            off = 0
            for p, w in zip(parts, widths):
                # Destination rank first: rank r gets heads r * per_rank + [a, b) of our tokens.
                send[..., off:off + w].unflatten(3, (p.heads[1] - p.heads[0], p.x.shape[-1])).copy_(
                    p.x[:, :, :, p.heads[0]:p.heads[1]])
                off += w
    with _marked("ulysses.all_to_all", forward):
        recv = funcol.all_to_all_single(send, None, None, group)
    return _InFlight(send, recv, tuple(parts))


def _wait(t: Tensor) -> Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _waited(t: Tensor, kind: str) -> Tensor:
    timer = active_timer() if not torch.compiler.is_compiling() else None
    if timer is None:
        return _wait(t)
    with timer.span(kind):
        return _wait(t)


def _arrive(flight: _InFlight, kind: str) -> list[tuple[Tensor, tuple | None]]:
    """Wait for an exchange; per part ``(buffer, where)``, its kernel-layout (B, n, S, D) tensor
    being ``_kernel_view(buffer, where)``. At batch 1 that is a view of the received buffer
    (sequence outermost: the layout the kernels write themselves), kept as the buffer and
    where in it: a compiled checkpoint cannot keep a view of a collective's output."""
    recv = _waited(flight.recv, kind)
    size, b, s, _ = recv.shape
    out, off = [], 0
    for p in flight.parts:
        n, d = p.heads[1] - p.heads[0], p.x.shape[-1]
        if b == 1:
            out.append((recv, (off, n, d)))
        else:  # the sequence blocks of a row are apart: one copy, dense in the kernel layout
            piece = recv[..., off:off + n * d].unflatten(3, (n, d))  # (P, B, s, n, D), source = sequence block
            out.append((piece.permute(1, 3, 0, 2, 4).reshape(b, n, size * s, d), None))
        off += n * d
    return out


def _kernel_view(buffer: Tensor, where: tuple | None) -> Tensor:
    """The (1, n, S, D) kernel input at ``where = (offset, n, D)`` of a received (P, 1, s, W)
    buffer; ``buffer`` itself when ``where`` is None."""
    if where is None:
        return buffer
    off, n, d = where
    size, _, s, _ = buffer.shape
    return buffer[..., off:off + n * d].unflatten(3, (n, d)).view(1, size * s, n, d).transpose(1, 2)


def _back(x: Tensor, size: int, group, kind: str) -> Tensor:
    """Exchange a chunk's ``x`` (B, n, S, D) from heads to sequence and wait for it: the
    received (P, B, s, n, D), source rank = head block. At batch 1 ``x`` as the kernels
    write it (sequence outermost) is the send buffer."""
    b, n, seq, d = x.shape
    forward = kind == "forward"
    with _marked("ulysses.layout", forward):
        send = x.transpose(1, 2).reshape(b, size, seq // size, n, d).transpose(0, 1).contiguous()
    with _marked("ulysses.all_to_all", forward):
        flight = funcol.all_to_all_single(send, None, None, group)
    return _waited(flight, kind)


def _land(dest: Tensor, recv: Tensor, heads: tuple[int, int], size: int, forward: bool) -> None:
    """What :func:`_back` received into ``dest``'s heads ``heads`` of every rank's block
    (``dest``: (B, s, size * per_rank, D))."""
    with _marked("ulysses.layout", forward):
        _by_rank(dest, size)[:, :, :, heads[0]:heads[1]].copy_(recv)


def _release(t: Tensor) -> None:
    """Free ``t``'s memory now when it is one dense tensor of its own (an output gradient whose
    chunk has been sent: the received gradient of q takes its place), outside compiled code."""
    if (not torch.compiler.is_compiling() and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        t.untyped_storage().resize_(0)


# ---------------------------------------------------------------------------
# The memory planner's trace: the first and the last chunk
# ---------------------------------------------------------------------------

_EDGES_ONLY = [False]


@contextlib.contextmanager
def edge_chunks_only():
    """For the memory planner's traces (as :func:`~ulysses_dtensor.memory.tiling.edge_pieces_only`
    for loops over the sequence): only a call's first two and last chunks (and the first of
    the last one's kv group) run; each chunk in between keeps empty tensors as large as what
    it would keep for backward, and its backward does nothing. The results are wrong, and
    the memory is that of every chunk: equal chunks keep equal bytes, every chunk's kept
    tensors are alive while backward runs the first ones, and the second chunk's backward
    reaches the level of every chunk in between."""
    before, _EDGES_ONLY[0] = _EDGES_ONLY[0], True
    try:
        yield
    finally:
        _EDGES_ONLY[0] = before


def edges_only() -> bool:
    """Whether the planner traces loops at their edges now (:func:`edge_chunks_only`; the ring's
    steps follow it: :mod:`.ring_steps`)."""
    return _EDGES_ONLY[0]


def _traced(plan: tuple[Chunk, ...]) -> set[int]:
    """The chunks that run: all of them, or under :func:`edge_chunks_only` the edges."""
    n = len(plan)
    if not _EDGES_ONLY[0] or n <= 3:
        return set(range(n))
    # The second chunk is the first to hold a kv group's summed gradients with the next chunk's
    # exchange in flight: the backward peak of every chunk in between.
    last_group_start = max(c for c in range(n) if plan[c].kv_first)
    return {0, 1, last_group_start, n - 1}


# ---------------------------------------------------------------------------
# A point in backward that memory switches can wait for
# ---------------------------------------------------------------------------

# Chunked forwards so far (memory switches ask whether a step ran any), and what to run once
# when the next chunked backward is done: the peak of a layer's backward is behind it then.
_CALLS = [0]
_AFTER_BACKWARD: dict = {}


def chunked_calls() -> int:
    """How many chunked attention forwards ran in this process (a counter to compare)."""
    return _CALLS[0]


def after_chunked_backward(owner, fn) -> None:
    """Run ``fn()`` once, when the next chunked attention backward ends (one pending
    call per ``owner``: a later one replaces it). Host offload starts bringing back the
    previous layer's input there (:mod:`ulysses_dtensor.memory.offload`), past this
    layer's attention backward, the peak, rather than at the layer's start."""
    _AFTER_BACKWARD[owner] = fn


def _backward_done() -> None:
    while _AFTER_BACKWARD:
        _AFTER_BACKWARD.popitem()[1]()


# ---------------------------------------------------------------------------
# The autograd function
# ---------------------------------------------------------------------------


@dataclass
class _Run:
    """What one call's chunks share: the plan, the group, the split kernel and its factory, and
    the layout (``grouped``: q, k, v handed over in the send layout, one part per chunk and per kv
    group, and the output returned as received, one part per chunk)."""

    plan: tuple[Chunk, ...]
    group: object
    size: int
    pack: bool
    make_kernel: object  # (q_h, v_h) -> SplitKernel, called once per forward
    grouped: bool = False
    kernel: object = None

    def kv_part(self, c: int) -> int:
        """Which kv part chunk ``c`` uses (grouped layout): its group's first chunk's."""
        return sum(ch.kv_first for ch in self.plan[:c + 1]) - 1

    def split(self, tensors) -> tuple[list, list, list]:
        if not self.grouped:
            return [tensors[0]], [tensors[1]], [tensors[2]]
        nq, nk = len(self.plan), sum(ch.kv_first for ch in self.plan)
        return list(tensors[:nq]), list(tensors[nq:nq + nk]), list(tensors[nq + nk:])

    def part(self, parts: list[Tensor], c: int, heads: tuple[int, int], kv: bool = False) -> _Part:
        """Chunk ``c``'s heads of ``parts`` (its q or kv heads), as :func:`_issue` takes them."""
        if self.grouped:
            x = parts[self.kv_part(c) if kv else c]
            return _Part(x, (0, x.shape[3]))
        return _Part(_by_rank(parts[0], self.size), heads)


def _issue_all(parts: list[_Part], run: _Run, forward: bool) -> list[_InFlight]:
    # Parts in the send layout go as they are, one all-to-all each, unless packing is asked for;
    # slices of the (B, s, H, D) layout are copied anyway, so backward packs them (as it always has).
    if run.pack or (not forward and not run.grouped):
        return [_issue(parts, run.size, run.group, forward)]
    return [_issue([p], run.size, run.group, forward) for p in parts]


def _arrive_all(flights: list[_InFlight], kind: str) -> list[tuple[Tensor, tuple | None]]:
    return [t for f in flights for t in _arrive(f, kind)]


def _stand_ins(buffers: list[Tensor]) -> list[Tensor]:
    # One empty tensor per distinct buffer: q, k, v packed in one all-to-all share theirs.
    made = {}
    return [made.setdefault(id(t), torch.empty_like(t)) for t in buffers]


def _dq_buffer(dout: Tensor, shape, dtype) -> Tensor:
    """Where dq is written: the output gradient's own storage when it is one dense tensor of
    q's shape and dtype (each chunk's part of it is dead once sent), else a new tensor."""
    if (not torch.compiler.is_compiling() and tuple(dout.shape) == tuple(shape) and dout.dtype == dtype
            and dout.is_contiguous() and dout.storage_offset() == 0
            and dout.untyped_storage().nbytes() == dout.numel() * dout.element_size()):
        return dout
    return dout.new_empty(shape)


class _HeadChunked(torch.autograd.Function):
    """(B, s, H, D) layout: q (B, s, P*hq, D), k (B, s, P*hk, D), v (B, s, P*hk, Dv), this rank's
    slice of the sequence (kv heads replicated already) -> (B, s, P*hq, Dv). Send layout
    (``run.grouped``): per chunk a q part (P, B, s, n, D), per kv group k and v parts
    (P, B, s, n_kv, D / Dv) -> per chunk the received output part (P, B, s, n, Dv).
    sinks: (hq,) or None."""

    @staticmethod
    def forward(ctx, run: _Run, sinks, *tensors):
        size = run.size
        qs, ks, vs = run.split(tensors)
        if run.grouped:
            b, s, hq = *qs[0].shape[1:3], sum(t.shape[3] for t in qs)
        else:
            b, s, hq = *qs[0].shape[:2], qs[0].shape[2] // size
        dv = vs[0].shape[-1]
        _CALLS[0] += 1
        out = None if run.grouped else qs[0].new_empty(b, s, size * hq, dv)
        outs = [None] * len(run.plan)

        def parts(c: int) -> list[_Part]:
            ch = run.plan[c]
            found = [run.part(qs, c, ch.q)]
            if ch.kv_first:
                found += [run.part(ks, c, ch.kv, kv=True), run.part(vs, c, ch.kv, kv=True)]
            return found

        kept_by_chunk, metas = {}, {}  # chunk -> what its backward needs: tensors, the rest
        wheres = {}  # chunk -> where its q (k, v) lie in the buffers it keeps (_kernel_view)
        runs = sorted(_traced(run.plan))
        skipped = [c for c in range(len(run.plan)) if c not in runs]
        # Under the planner's edge trace the chunks in between stand in right after the first,
        # so that the second runs where every chunk but the last two would: see edge_chunks_only.
        order = runs[:1] + skipped + runs[1:]
        flights = _issue_all(parts(0), run, True)
        k_h = v_h = k_buf = v_buf = None
        for i, c in enumerate(order):
            ch = run.plan[c]
            if c in skipped:
                kv_kept = ch.kv_first and run.kernel.keeps_kv
                kept_by_chunk[c] = [*_stand_ins([kept_by_chunk[0][0], *((k_buf, v_buf) if kv_kept else ())]),
                                    *run.kernel.stand_in(metas[0][1], ch.kv_first)]
                metas[c] = (None, metas[0][1])
                wheres[c] = wheres[0]
                if run.grouped:
                    outs[c] = qs[c].new_empty(*qs[c].shape[:-1], dv)
                continue
            arrived = _arrive_all(flights, "forward")
            nxt = next((n for n in order[i + 1:] if n not in skipped), None)
            if nxt is not None:  # in flight while this chunk's kernel runs
                flights = _issue_all(parts(nxt), run, True)
            (q_buf, q_at) = arrived[0]
            q_h = _kernel_view(q_buf, q_at)
            if ch.kv_first:
                (k_buf, k_at), (v_buf, v_at) = arrived[1:]
                k_h, v_h = _kernel_view(k_buf, k_at), _kernel_view(v_buf, v_at)
            if run.kernel is None:
                run.kernel = run.make_kernel(q_h, v_h)
            kernel = run.kernel
            with region("attention"):
                out_h, kept, meta = kernel.forward(q_h, k_h, v_h, None if sinks is None else sinks[ch.q[0]:ch.q[1]])
            back = _back(out_h[..., :dv], size, run.group, "forward")
            if run.grouped:
                outs[c] = back  # the o-projection's input as it arrived
            else:
                _land(out, back, ch.q, size, True)
            kv_kept = ch.kv_first and kernel.keeps_kv
            kept_by_chunk[c] = [q_buf, *((k_buf, v_buf) if kv_kept else ()), *kept]
            wheres[c] = (q_at, *((k_at, v_at) if kv_kept else ()))
            metas[c] = (meta, list(kept))
            del arrived, q_h, q_buf, out_h, kept, back
        run.kernel.forward_done()
        saved = [t for c in range(len(run.plan)) for t in kept_by_chunk[c]]
        # The output is kept in the sequence layout, which the output projection keeps anyway, and
        # exchanged again chunk by chunk in backward: no second copy of it while backward reaches here.
        results = outs if run.grouped else [out]
        ctx.save_for_backward(*saved, *(results if run.kernel.keeps_out else ()),
                              *(() if sinks is None else (sinks,)))
        ctx.run = run
        ctx.index = [len(metas[c][1]) for c in range(len(run.plan))]
        ctx.metas = [metas[c][0] for c in range(len(run.plan))]
        ctx.wheres = [wheres[c] for c in range(len(run.plan))]
        ctx.shapes = ([t.shape for t in tensors], [t.dtype for t in tensors], len(results), sinks is not None)
        return tuple(outs) if run.grouped else out

    @staticmethod
    @once_differentiable
    def backward(ctx, *douts):
        run, kernel = ctx.run, ctx.run.kernel
        shapes, dtypes, n_results, has_sinks = ctx.shapes
        saved = list(ctx.saved_tensors)
        sinks = saved.pop() if has_sinks else None
        results = None
        if kernel.keeps_out:
            results = saved[len(saved) - n_results:]
            del saved[len(saved) - n_results:]
        size = run.size
        q_shapes, k_shapes, v_shapes = run.split(shapes)
        q_dtypes, k_dtypes, v_dtypes = run.split(dtypes)
        douts = list(douts)
        if run.grouped:
            dqs, dks, dvs = [None] * len(q_shapes), [None] * len(k_shapes), [None] * len(v_shapes)
        else:
            dq = _dq_buffer(douts[0], q_shapes[0], q_dtypes[0])
            dk = dv = None
        dsinks = None if sinks is None else torch.zeros_like(sinks)

        def parts(c: int) -> list[_Part]:  # the output's gradient, and the output if the kernel needs it
            ch = run.plan[c]
            return [run.part(douts, c, ch.q)] + ([run.part(results, c, ch.q)] if results is not None else [])

        runs = _traced(run.plan)
        order = sorted(runs)
        flights = _issue_all(parts(order[0]), run, False)
        pos = 0
        k_h = v_h = acc_k = acc_v = None
        for c, ch in enumerate(run.plan):
            # A chunk's tensors leave the list as it runs (under activation checkpointing the list
            # holds the only reference): what is done with can go.
            at = ctx.wheres[c]
            q_h, saved[pos] = _kernel_view(saved[pos], at[0]), None
            pos += 1
            if ch.kv_first and kernel.keeps_kv:
                k_h, v_h = _kernel_view(saved[pos], at[1]), _kernel_view(saved[pos + 1], at[2])
                saved[pos:pos + 2] = [None, None]
                pos += 2
            kept = saved[pos:pos + ctx.index[c]]
            saved[pos:pos + ctx.index[c]] = [None] * ctx.index[c]
            pos += ctx.index[c]
            if c not in runs:  # the planner's edge trace: a chunk in between
                if run.grouped:  # stand-ins of its gradients; its output gradient's memory stands for dq's
                    same = douts[c].shape == q_shapes[c] and douts[c].dtype == q_dtypes[c]
                    dqs[c] = douts[c] if same else douts[c].new_empty(q_shapes[c], dtype=q_dtypes[c])
                continue
            dout_h, *out_h = [_kernel_view(*a) for a in _arrive_all(flights, "backward")]
            out_h = out_h[0] if out_h else None
            if run.grouped:
                _release(douts[c])  # sent: dq's part takes its memory
            nxt = next((n for n in order if n > c), None)
            if nxt is not None:  # in flight while this chunk's backward runs
                flights = _issue_all(parts(nxt), run, False)
            sink_c = None if sinks is None else sinks[ch.q[0]:ch.q[1]]
            gq, gk, gv, gs = kernel.backward(dout_h, q_h, k_h, v_h, out_h, kept, ctx.metas[c], sink_c)
            del dout_h, q_h, out_h, kept
            back = _back(gq, size, run.group, "backward")
            if run.grouped:
                dqs[c] = back
            else:
                _land(dq, back, ch.q, size, False)
            del gq, back
            if ch.kv_first or acc_k is None:
                acc_k, acc_v = gk, gv
            else:
                acc_k.add_(gk)
                acc_v.add_(gv)
            del gk, gv
            if ch.kv_last:
                back_k = _back(acc_k, size, run.group, "backward")
                back_v = _back(acc_v, size, run.group, "backward")
                if run.grouped:
                    g = run.kv_part(c)
                    dks[g], dvs[g] = back_k, back_v
                else:
                    if dk is None:
                        dk = douts[0].new_empty(k_shapes[0], dtype=k_dtypes[0])
                        dv = douts[0].new_empty(v_shapes[0], dtype=v_dtypes[0])
                    _land(dk, back_k, ch.kv, size, False)
                    _land(dv, back_v, ch.kv, size, False)
                acc_k = acc_v = k_h = v_h = back_k = back_v = None
            if dsinks is not None and gs is not None:
                dsinks[ch.q[0]:ch.q[1]] = gs
        ctx.run = ctx.metas = ctx.wheres = None
        _backward_done()
        if run.grouped:  # kv groups the edge trace skipped: stand-ins
            dks = [t if t is not None else douts[0].new_empty(s, dtype=d) for t, s, d in zip(dks, k_shapes, k_dtypes)]
            dvs = [t if t is not None else douts[0].new_empty(s, dtype=d) for t, s, d in zip(dvs, v_shapes, v_dtypes)]
            grads = [*dqs, *dks, *dvs]
        else:
            grads = [dq, dk, dv]
        return None, dsinks, *grads


def head_chunked_attention(q, k, v, sinks: Tensor | None, mesh, chunks, make_kernel, *, pack: bool = False):
    """Ulysses attention of this rank's sequence slice, chunk by chunk over its heads.

    q (B, s, P*hq, D), k (B, s, P*hk, D), v (B, s, P*hk, Dv): local tensors on the
    1-D ``mesh`` of P ranks, kv heads already replicated to a multiple of P; ``chunks``
    a count. Or, in the send layout, lists: per chunk of the plan ``chunks`` a q part
    (P, B, s, n, D), per kv group of it k and v parts (P, B, s, n_kv, D / Dv). sinks:
    this rank's (hq,) or None. ``make_kernel(q_h, v_h)``: the
    :class:`~.head_chunk_kernels.SplitKernel` of the call, from a chunk's tensors.
    ``pack``: one all-to-all per chunk for q with its k/v. Returns (B, s, P*hq, Dv), or per
    chunk the received output part (P, B, s, n, Dv).
    """
    size = mesh.size()
    if isinstance(q, Tensor):
        plan = chunk_plan(chunks, q.shape[2] // size, k.shape[2] // size)
        return _HeadChunked.apply(_Run(plan, mesh.get_group(), size, pack, make_kernel), sinks, q, k, v)
    run = _Run(tuple(chunks), mesh.get_group(), size, pack, make_kernel, grouped=True)
    return list(_HeadChunked.apply(run, sinks, *q, *k, *v))
