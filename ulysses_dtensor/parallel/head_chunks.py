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

Chunks follow the kv groups (GQA). With ``hk`` kv heads per rank, ``C`` divides
``hk`` (each chunk: ``hk / C`` kv heads and their query heads), or ``C`` is
``hk`` times a divisor of the group size ``hq / hk`` (a group's query heads
split over ``C / hk`` chunks; its k/v exchanged once, when its first chunk
starts, and their gradients sent back once). Llama-3-8B on sp 8 holds 4 query
heads and 1 kv head per rank: 1, 2 or 4 chunks, k/v exchanged once.
:func:`valid_head_chunks` lists the counts.

Overlap: chunk c+1's exchange is issued (an asynchronous functional
all-to-all) before chunk c's kernel runs and waited after it, in forward (its
q, and k/v when a group starts) and in backward (its output gradient). The
outputs' exchanges are waited right after their kernel: at millions of tokens a
chunk's kernel takes seconds and its exchange milliseconds, and an output in
flight would hold two more chunk-size buffers at the peak.

``head_chunks=None`` (:func:`auto_head_chunks`) chooses one query head per
chunk when one layer's exchanged attention tensors (q, k, v, the output and
their gradients, for the rank's heads over the whole sequence) would exceed
:data:`AUTO_MIN_BYTES`, and no chunks below: chunks shrink what binds at long
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
from .mesh import divisors

__all__ = [
    "AUTO_MIN_BYTES",
    "Chunk",
    "after_chunked_backward",
    "chunked_calls",
    "auto_head_chunks",
    "check_head_chunks",
    "edge_chunks_only",
    "edges_only",
    "chunk_plan",
    "recomputes_in_chunks",
    "head_chunked_attention",
    "resolve_head_chunks",
    "valid_head_chunks",
]

# Auto chunks when one layer's exchanged attention tensors and their gradients exceed this
# per rank: Llama-3-8B on sp 8 reaches it at about 210K tokens.
AUTO_MIN_BYTES = 1 << 30


# ---------------------------------------------------------------------------
# The plan: which heads each chunk holds
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One chunk: its query heads and kv heads among this rank's (``[start, stop)``),
    whether its k/v are exchanged with it (a group's first chunk) and whether their
    gradients go back after it (a group's last)."""

    q: tuple[int, int]
    kv: tuple[int, int]
    kv_first: bool = True
    kv_last: bool = True


def valid_head_chunks(q_heads: int, kv_heads: int) -> list[int]:
    """Chunk counts over ``q_heads`` query and ``kv_heads`` kv heads (per rank) that follow the kv groups."""
    group = q_heads // kv_heads
    return sorted(set(divisors(kv_heads)) | {kv_heads * d for d in divisors(group)})


def check_head_chunks(value, q_heads: int, kv_heads: int, where: str = "head_chunks") -> int | None:
    """``value`` if it is None (auto) or a count :func:`valid_head_chunks` allows, else ValueError."""
    if value is None:
        return None
    valid = valid_head_chunks(q_heads, kv_heads)
    if isinstance(value, bool) or not isinstance(value, int) or value not in valid:
        raise ValueError(
            f"{where}={value!r}: a rank holds {q_heads} query and {kv_heads} kv heads after the exchange, and "
            f"chunks follow the kv groups; valid: {valid} (1: no chunks), or None for a count from the shapes"
        )
    return value


def recomputes_in_chunks(head_chunks: int | None, backend: str, patterns) -> bool:
    """Whether chunks may run a kernel without a split backward (:class:`~.head_chunk_kernels.RecomputeSplit`:
    soft-capping or sinks, ``flex``, ``flash_attn``, ``cudnn`` with a mask), which torch.compile
    cannot trace in one graph: the blocks are then compiled with graph breaks allowed."""
    if head_chunks == 1:
        return False
    return bool({"softcap", "sinks"} & set(patterns)) or backend in ("flex", "flash_attn", "cudnn")


def chunk_plan(chunks: int, q_heads: int, kv_heads: int) -> tuple[Chunk, ...]:
    """The chunks of ``q_heads`` / ``kv_heads`` per rank, in order."""
    check_head_chunks(chunks, q_heads, kv_heads)
    nq = q_heads // chunks
    if chunks <= kv_heads:
        nk = kv_heads // chunks
        return tuple(Chunk((c * nq, (c + 1) * nq), (c * nk, (c + 1) * nk)) for c in range(chunks))
    per_group = chunks // kv_heads
    return tuple(Chunk((c * nq, (c + 1) * nq), (c // per_group, c // per_group + 1), c % per_group == 0,
                       c % per_group == per_group - 1) for c in range(chunks))


def auto_head_chunks(batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int, v_head_dim: int,
                     element_size: int) -> int:
    """One query head per chunk when q, k, v, the output and their gradients, for this rank's
    heads over the whole sequence (``seq`` tokens), exceed :data:`AUTO_MIN_BYTES`; else 1."""
    working = 2 * batch * seq * element_size * (q_heads + kv_heads) * (head_dim + v_head_dim)
    return q_heads if working >= AUTO_MIN_BYTES else 1


def resolve_head_chunks(setting: int | None, batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int,
                        v_head_dim: int, element_size: int) -> int:
    """The chunk count a call runs: ``setting``, or :func:`auto_head_chunks` for None."""
    if setting is not None:
        return check_head_chunks(setting, q_heads, kv_heads)
    return auto_head_chunks(batch, seq, q_heads, kv_heads, head_dim, v_head_dim, element_size)


# ---------------------------------------------------------------------------
# The exchange of one chunk's heads, on local tensors
# ---------------------------------------------------------------------------


class _Part(NamedTuple):
    x: Tensor  # (B, s, P * per_rank, D): this rank's slice of the sequence
    heads: tuple[int, int]  # the chunk's heads among a rank's per_rank
    per_rank: int


class _InFlight(NamedTuple):
    send: Tensor  # kept until the wait: the collective reads it until it ends
    recv: Tensor  # async until waited
    parts: tuple


def _marked(name: str, forward: bool):
    # Regions mark forward code (and its recompute); backward kernels carry none (runtime/regions.py).
    return region(name) if forward else contextlib.nullcontext()


def _issue(parts: list[_Part], size: int, group, forward: bool) -> _InFlight:
    """Start one all-to-all of the chunk's heads of ``parts`` (sequence -> heads)."""
    b, s = parts[0].x.shape[:2]
    widths = [(p.heads[1] - p.heads[0]) * p.x.shape[-1] for p in parts]
    with _marked("ulysses.layout", forward):
        send = parts[0].x.new_empty(size, b, s, sum(widths))
        off = 0
        for p, w in zip(parts, widths):
            n, d = p.heads[1] - p.heads[0], p.x.shape[-1]
            # Destination rank first: rank r gets heads r * per_rank + [a, b) of our tokens.
            src = p.x.unflatten(2, (size, p.per_rank))[:, :, :, p.heads[0]:p.heads[1]].permute(2, 0, 1, 3, 4)
            send[..., off:off + w].unflatten(3, (n, d)).copy_(src)
            off += w
    with _marked("ulysses.all_to_all", forward):
        recv = funcol.all_to_all_single(send, None, None, group)
    return _InFlight(send, recv, tuple(parts))


def _wait(t: Tensor) -> Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _arrive(flight: _InFlight, kind: str) -> list[Tensor]:
    """Wait for an exchange; its parts in the kernel layout (B, n, S, D) (views of the buffer when B is 1)."""
    timer = active_timer() if not torch.compiler.is_compiling() else None
    if timer is None:
        recv = _wait(flight.recv)
    else:
        with timer.span(kind):
            recv = _wait(flight.recv)
    size, b, s, _ = recv.shape
    out, off = [], 0
    for p in flight.parts:
        n, d = p.heads[1] - p.heads[0], p.x.shape[-1]
        piece = recv[..., off:off + n * d].unflatten(3, (n, d))  # (P, B, s, n, D), source rank = sequence block
        out.append(piece.permute(1, 3, 0, 2, 4).reshape(b, n, size * s, d))
        off += n * d
    return out


def _land(dest: Tensor, x: Tensor, heads: tuple[int, int], per_rank: int, size: int, group, kind: str) -> None:
    """Exchange ``x`` (B, n, S, D) (heads -> sequence) into ``dest``'s heads ``heads`` of
    every rank's block (``dest``: (B, s, size * per_rank, D)), and wait for it."""
    b, n, seq, d = x.shape
    forward = kind == "forward"
    with _marked("ulysses.layout", forward):
        send = x.unflatten(2, (size, seq // size)).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, n, s, D)
    with _marked("ulysses.all_to_all", forward):
        flight = funcol.all_to_all_single(send, None, None, group)
    timer = active_timer() if not torch.compiler.is_compiling() else None
    if timer is None:
        recv = _wait(flight)
    else:
        with timer.span(kind):
            recv = _wait(flight)
    with _marked("ulysses.layout", forward):
        # recv (P, B, n, s, D), source rank = head block -> our tokens, heads p * per_rank + [a, b).
        dest.unflatten(2, (size, per_rank))[:, :, :, heads[0]:heads[1]].copy_(recv.permute(1, 3, 0, 2, 4))


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
    """What one call's chunks share: the plan, the group, the split kernel and its factory."""

    plan: tuple[Chunk, ...]
    group: object
    size: int
    pack: bool
    make_kernel: object  # (q_h, v_h) -> SplitKernel, called once per forward
    kernel: object = None


def _parts(q: Tensor, k: Tensor, v: Tensor, ch: Chunk, hq: int, hk: int) -> list[_Part]:
    parts = [_Part(q, ch.q, hq)]
    if ch.kv_first:
        parts += [_Part(k, ch.kv, hk), _Part(v, ch.kv, hk)]
    return parts


def _issue_all(parts: list[_Part], run: _Run, forward: bool) -> list[_InFlight]:
    if run.pack:
        return [_issue(parts, run.size, run.group, forward)]
    return [_issue([p], run.size, run.group, forward) for p in parts]


def _arrive_all(flights: list[_InFlight], kind: str) -> list[Tensor]:
    return [t for f in flights for t in _arrive(f, kind)]


def _dq_buffer(dout: Tensor, shape, dtype) -> Tensor:
    """Where dq is written: the output gradient's own storage when it is one dense tensor of
    q's shape and dtype (each chunk's part of it is dead once sent), else a new tensor."""
    if (not torch.compiler.is_compiling() and tuple(dout.shape) == tuple(shape) and dout.dtype == dtype
            and dout.is_contiguous() and dout.storage_offset() == 0
            and dout.untyped_storage().nbytes() == dout.numel() * dout.element_size()):
        return dout
    return dout.new_empty(shape)


class _HeadChunked(torch.autograd.Function):
    """q (B, s, P*hq, D), k (B, s, P*hk, D), v (B, s, P*hk, Dv): this rank's slice of the
    sequence (kv heads replicated already); sinks (hq,) or None. -> (B, s, P*hq, Dv)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, run: _Run):
        size = run.size
        b, s, heads, _ = q.shape
        hq, hk, dv = heads // size, k.shape[2] // size, v.shape[-1]
        _CALLS[0] += 1
        out = q.new_empty(b, s, heads, dv)
        kept_by_chunk, metas = {}, {}  # chunk -> what its backward needs: tensors, the rest
        runs = sorted(_traced(run.plan))
        skipped = [c for c in range(len(run.plan)) if c not in runs]
        # Under the planner's edge trace the chunks in between stand in right after the first,
        # so that the second runs where every chunk but the last two would: see edge_chunks_only.
        order = runs[:1] + skipped + runs[1:]
        flights = _issue_all(_parts(q, k, v, run.plan[0], hq, hk), run, True)
        k_h = v_h = None
        for i, c in enumerate(order):
            ch = run.plan[c]
            if c in skipped:
                q_0 = kept_by_chunk[0][0]
                kept_by_chunk[c] = [torch.empty_like(q_0), *((torch.empty_like(k_h), torch.empty_like(v_h))
                                                             if ch.kv_first and run.kernel.keeps_kv else ()),
                                    *run.kernel.stand_in(metas[0][1], ch.kv_first)]
                metas[c] = (None, metas[0][1])
                continue
            arrived = _arrive_all(flights, "forward")
            nxt = next((n for n in order[i + 1:] if n not in skipped), None)
            if nxt is not None:  # in flight while this chunk's kernel runs
                flights = _issue_all(_parts(q, k, v, run.plan[nxt], hq, hk), run, True)
            q_h = arrived[0]
            if ch.kv_first:
                k_h, v_h = arrived[1:]
            if run.kernel is None:
                run.kernel = run.make_kernel(q_h, v_h)
            kernel = run.kernel
            with region("attention"):
                out_h, kept, meta = kernel.forward(q_h, k_h, v_h, None if sinks is None else sinks[ch.q[0]:ch.q[1]])
            _land(out, out_h[..., :dv], ch.q, hq, size, run.group, "forward")
            kept_by_chunk[c] = [q_h, *((k_h, v_h) if ch.kv_first and kernel.keeps_kv else ()), *kept]
            metas[c] = (meta, list(kept))
            del arrived, q_h, out_h, kept
        run.kernel.forward_done()
        saved = [t for c in range(len(run.plan)) for t in kept_by_chunk[c]]
        # The output is kept in the sequence layout, which the output projection keeps anyway, and
        # exchanged again chunk by chunk in backward: no second copy of it while backward reaches here.
        ctx.save_for_backward(*saved, *((out,) if run.kernel.keeps_out else ()),
                              *(() if sinks is None else (sinks,)))
        ctx.run = run
        ctx.index = [len(metas[c][1]) for c in range(len(run.plan))]
        ctx.metas = [metas[c][0] for c in range(len(run.plan))]
        ctx.shapes = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, sinks is not None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        run, kernel = ctx.run, ctx.run.kernel
        q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, has_sinks = ctx.shapes
        saved = list(ctx.saved_tensors)
        sinks = saved.pop() if has_sinks else None
        out = saved.pop() if kernel.keeps_out else None
        size = run.size
        hq, hk = q_shape[2] // size, k_shape[2] // size
        dq = _dq_buffer(dout, q_shape, q_dtype)
        dk = dv = None
        dsinks = None if sinks is None else torch.zeros_like(sinks)

        def parts(ch: Chunk) -> list[_Part]:  # the output's gradient, and the output if the kernel needs it
            return [_Part(dout, ch.q, hq)] + ([_Part(out, ch.q, hq)] if out is not None else [])

        runs = _traced(run.plan)
        order = sorted(runs)
        flights = [_issue(parts(run.plan[0]), size, run.group, False)]
        pos = 0
        k_h = v_h = acc_k = acc_v = None
        for c, ch in enumerate(run.plan):
            # A chunk's tensors leave the list as it runs (under activation checkpointing the list
            # holds the only reference): what is done with can go.
            q_h, saved[pos] = saved[pos], None
            pos += 1
            if ch.kv_first and kernel.keeps_kv:
                k_h, v_h = saved[pos:pos + 2]
                saved[pos:pos + 2] = [None, None]
                pos += 2
            kept = saved[pos:pos + ctx.index[c]]
            saved[pos:pos + ctx.index[c]] = [None] * ctx.index[c]
            pos += ctx.index[c]
            if c not in runs:  # the planner's edge trace: a chunk in between
                continue
            dout_h, *out_h = _arrive_all(flights, "backward")
            out_h = out_h[0] if out_h else None
            nxt = next((n for n in order if n > c), None)
            if nxt is not None:  # in flight while this chunk's backward runs
                flights = [_issue(parts(run.plan[nxt]), size, run.group, False)]
            sink_c = None if sinks is None else sinks[ch.q[0]:ch.q[1]]
            gq, gk, gv, gs = kernel.backward(dout_h, q_h, k_h, v_h, out_h, kept, ctx.metas[c], sink_c)
            del dout_h, q_h, out_h, kept
            _land(dq, gq, ch.q, hq, size, run.group, "backward")
            del gq
            if ch.kv_first or acc_k is None:
                acc_k, acc_v = gk, gv
            else:
                acc_k.add_(gk)
                acc_v.add_(gv)
            del gk, gv
            if ch.kv_last:
                if dk is None:
                    dk, dv = dout.new_empty(k_shape, dtype=k_dtype), dout.new_empty(v_shape, dtype=v_dtype)
                _land(dk, acc_k, ch.kv, hk, size, run.group, "backward")
                _land(dv, acc_v, ch.kv, hk, size, run.group, "backward")
                acc_k = acc_v = k_h = v_h = None
            if dsinks is not None and gs is not None:
                dsinks[ch.q[0]:ch.q[1]] = gs
        ctx.run = ctx.metas = None
        _backward_done()
        return dq, dk, dv, dsinks, None


def head_chunked_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, mesh, chunks: int, make_kernel,
                           *, pack: bool = False) -> Tensor:
    """Ulysses attention of this rank's sequence slice, ``chunks`` head chunks at a time.

    q (B, s, P*hq, D), k (B, s, P*hk, D), v (B, s, P*hk, Dv): local tensors on the
    1-D ``mesh`` of P ranks, kv heads already replicated to a multiple of P; sinks:
    this rank's (hq,) or None. ``make_kernel(q_h, v_h)``: the
    :class:`~.head_chunk_kernels.SplitKernel` of the call, from a chunk's tensors.
    ``pack``: one all-to-all per chunk for q with its k/v. Returns (B, s, P*hq, Dv).
    """
    size = mesh.size()
    hq, hk = q.shape[2] // size, k.shape[2] // size
    run = _Run(chunk_plan(chunks, hq, hk), mesh.get_group(), size, pack, make_kernel)
    return _HeadChunked.apply(q, k, v, sinks, run)
