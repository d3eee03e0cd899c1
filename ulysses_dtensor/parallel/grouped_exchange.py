"""The exchange in the send layout: projections that write what the all-to-all sends.

The (B, s, H, D) contract of :class:`~.ulysses.UlyssesAttention` costs a permute copy per
tensor into the send buffer and one out of the received buffer. A model that calls these
instead copies nothing at batch 1 (our Llama does):

* :func:`send_layout`: how q, k, v must be laid out for a module's exchange (None: no
  exchange wraps it);
* :func:`project_to_send`: a linear layer whose output is the send buffer (a batched matmul
  over the destination blocks of its weight rows);
* :func:`grouped_attention`: the exchange and the module's kernel on those buffers, head
  chunks included; the received buffer is the kernel's input as it lands;
* :func:`project_from_received`: the o-projection as a sum over the received head blocks.

Backward is the autograd of the same views and matmuls. :func:`plain_linear` says which
layers can take this path (FP8's, LoRA's and tensor parallelism's cannot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..runtime.regions import in_region
from .head_chunk_kernels import split_kernel
from .head_chunk_plan import Chunk, chunk_plan, resolve_head_chunks
from .head_chunks import head_chunked_attention
from .ulysses import _all_to_all, _heads_of_rank, _received_as_input, kv_replication

__all__ = ["SendLayout", "grouped_attention", "plain_linear", "project_from_received", "project_to_send",
           "send_layout"]


@dataclass(frozen=True)
class SendLayout:
    """How q, k, v enter :func:`grouped_attention` (from :func:`send_layout`).

    ``ranks``: P. q is projected into P blocks of ``heads / P`` heads (block p: the heads
    rank p attends), k and v into ``kv_groups`` blocks: P, or ``kv_heads`` when kv heads are
    replicated (``sp > kv_heads``; the exchange then repeats each block). ``q_slabs``: one
    ``(start, stop)`` range of a block's heads per tensor handed over (one, or one per head
    chunk); ``kv_slabs`` likewise for k and v (one per kv group of the chunks). ``chunks``:
    the head-chunk plan, or None for one exchange."""

    ranks: int
    kv_groups: int
    q_slabs: tuple[tuple[int, int], ...]
    kv_slabs: tuple[tuple[int, int], ...]
    chunks: tuple[Chunk, ...] | None = None


def send_layout(module: nn.Module, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int,
                v_head_dim: int, element_size: int) -> SendLayout | None:
    """The :class:`SendLayout` for a call of ``module`` (``seq``: this rank's tokens; heads
    as they leave the projections), or None when no Ulysses exchange wraps it."""
    applied = getattr(module, "_ulysses_exchange", None)
    if applied is None:
        return None
    style, mesh = applied
    size = mesh.size()
    repeat = kv_replication(heads, kv_heads, size)
    hq, hk = heads // size, kv_heads * repeat // size
    chunks = 1 if style.head_chunks == 1 else resolve_head_chunks(
        style.head_chunks, batch, seq * size, hq, hk, head_dim, v_head_dim, element_size)
    if chunks == 1:
        return SendLayout(size, size // repeat, ((0, hq),), ((0, hk),))
    plan = chunk_plan(chunks, hq, hk)
    return SendLayout(size, size // repeat, tuple(c.q for c in plan), tuple(c.kv for c in plan if c.kv_first), plan)


def plain_linear(m: nn.Module) -> bool:
    """Whether :func:`project_to_send` / :func:`project_from_received` compute the products
    ``m(x)`` would: an ``nn.Linear`` itself (not FP8's or LoRA's), no hooks, local weights
    (not tensor parallelism's DTensors). (Block sums round per block: in 16-bit dtypes as
    tensor parallelism's row-wise layers do.)"""
    return (type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks
            and not isinstance(m.weight, DTensor))


def _rows(slabs, width: int) -> tuple[tuple[int, int], ...]:
    return tuple((a * width, (b - a) * width) for a, b in slabs)


class _ToSend(torch.autograd.Function):
    """x (n, dim) -> per slab ``(start, width)`` a (G, n, width) tensor: block g holds
    ``x @ weight[g*R + start : g*R + start + width]^T`` (+ bias), weight being G blocks of
    R rows. A batched matmul writes the send buffer; backward sums dx over the blocks
    (accumulated in place: no (G, n, dim) temporary) and writes dW in its own layout."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, slabs):
        w = weight.view(groups, -1, weight.shape[-1])
        xs = x.expand(groups, *x.shape)
        outs = []
        for start, width in slabs:
            wt = w[:, start:start + width].transpose(1, 2)
            if bias is None:
                outs.append(torch.bmm(xs, wt))
            else:
                outs.append(torch.baddbmm(bias.view(groups, 1, -1)[:, :, start:start + width], xs, wt))
        ctx.save_for_backward(x, weight)
        ctx.groups, ctx.slabs, ctx.has_bias = groups, slabs, bias is not None
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        groups, slabs = ctx.groups, ctx.slabs
        w = weight.view(groups, -1, weight.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            for g, (start, width) in zip(grads, slabs):
                for p in range(groups):
                    blk = w[p, start:start + width]
                    dx = torch.mm(g[p], blk) if dx is None else dx.addmm_(g[p], blk)
        if ctx.needs_input_grad[1]:
            if len(slabs) == 1:  # (G, R, dim): the weight's own layout
                dw = torch.bmm(grads[0].transpose(1, 2), x.expand(groups, *x.shape)).view(weight.shape)
            elif torch.compiler.is_compiling():  # no out= into views under dynamo
                xs = x.expand(groups, *x.shape)
                dw = torch.cat([torch.bmm(g.transpose(1, 2), xs) for g in grads], dim=1).view(weight.shape)
            else:
                dw = weight.new_empty(weight.shape)
                dwv = dw.view(w.shape)
                for g, (start, width) in zip(grads, slabs):
                    for p in range(groups):
                        torch.mm(g[p].t(), x, out=dwv[p, start:start + width])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            sums = [g.sum(1) for g in grads]
            db = (sums[0] if len(sums) == 1 else torch.cat(sums, dim=1)).reshape(-1)
        return dx, dw, db, None, None


class _FromReceived(torch.autograd.Function):
    """Per slab ``(start, width)`` a (G, n, width) tensor as the all-to-all delivered it
    (block g: heads of rank g) -> (n, out): the o-projection as a sum over the blocks,
    block g of a slab reading columns ``g*R + start ... + width`` of ``weight``."""

    @staticmethod
    def forward(ctx, weight, bias, groups: int, slabs, *parts):
        wv = weight.view(weight.shape[0], groups, -1)
        # Eager: one output buffer, every block added in place (a new sum per block would hold
        # two outputs at once: at 8M tokens on 8 GPUs, 2.75 GiB more at the backward's peak).
        # Written through out= ops, which op-level selective checkpointing never saves (a
        # saved mm output summed into in place would be wrong when replayed). Compiled:
        # inductor plans the buffers.
        eager = not torch.compiler.is_compiling()
        y = None
        for a, (start, width) in zip(parts, slabs):
            for p in range(groups):
                wt = wv[:, p, start:start + width].t()
                if y is None and eager:
                    y = a[p].new_empty(a[p].shape[0], weight.shape[0])
                    torch.mm(a[p], wt, out=y) if bias is None else torch.addmm(bias, a[p], wt, out=y)
                elif y is None:
                    y = torch.mm(a[p], wt) if bias is None else torch.addmm(bias, a[p], wt)
                elif eager:
                    y.addmm_(a[p], wt)
                else:
                    y = torch.addmm(y, a[p], wt)
        ctx.save_for_backward(weight, *parts)
        ctx.groups, ctx.slabs, ctx.has_bias = groups, slabs, bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        weight, *parts = ctx.saved_tensors
        groups, slabs = ctx.groups, ctx.slabs
        wv = weight.view(weight.shape[0], groups, -1)
        dparts = [None] * len(parts)
        if any(ctx.needs_input_grad[4:]):
            gs = g.expand(groups, *g.shape)
            dparts = [torch.bmm(gs, wv[:, :, start:start + width].permute(1, 0, 2)) for start, width in slabs]
        dw = db = None
        if ctx.needs_input_grad[0]:
            if torch.compiler.is_compiling():  # no out= into views under dynamo
                gt = g.t().expand(groups, *g.t().shape)
                dw = torch.cat([torch.bmm(gt, a) for a in parts], dim=2).permute(1, 0, 2).reshape(weight.shape)
            else:
                dw = weight.new_empty(weight.shape)
                dwv = dw.view(wv.shape)
                for a, (start, width) in zip(parts, slabs):
                    for p in range(groups):
                        torch.mm(g.t(), a[p], out=dwv[:, p, start:start + width])
        if ctx.has_bias and ctx.needs_input_grad[1]:
            db = g.sum(0)
        return dw, db, None, None, *dparts


def project_to_send(x: Tensor, linear: nn.Linear, groups: int, slabs, head_dim: int) -> list[Tensor]:
    """``linear(x)`` for ``x`` (B, s, dim), written in the send layout: per head range
    ``(start, stop)`` of ``slabs`` a (groups, B, s, stop - start, head_dim) tensor, block g
    holding heads ``g * heads_per_block + start ...`` (the linear's rows in head order)."""
    b, s, _ = x.shape
    outs = _ToSend.apply(x.reshape(b * s, -1), linear.weight, linear.bias, groups, _rows(slabs, head_dim))
    return [o.view(groups, b, s, -1, head_dim) for o in outs]


def project_from_received(parts: list[Tensor], linear: nn.Linear, slabs) -> Tensor:
    """``linear`` of the (B, s, heads * Dv) attention output, from the received parts of
    :func:`grouped_attention` (per head range of ``slabs`` a (P, B, s, n, Dv) tensor)."""
    groups, b, s, _, dv = parts[0].shape
    y = _FromReceived.apply(linear.weight, linear.bias, groups, _rows(slabs, dv),
                            *(p.reshape(groups, b * s, -1) for p in parts))
    return y.view(b, s, -1)




@in_region("ulysses.layout")
def _send_back(out: Tensor, mesh: DeviceMesh) -> Tensor:
    """The kernel's (B, S, h, Dv) output -> received (P, B, s, h, Dv), source rank = head block.
    At batch 1 the output (dense, as the kernels write it) is the send buffer."""
    size = mesh.size()
    b, seq = out.shape[:2]
    send = out.reshape(b, size, seq // size, *out.shape[2:]).transpose(0, 1)
    return _all_to_all(send.contiguous(), mesh)




def _replicated(t: Tensor, repeat: int) -> Tensor:
    # (G, B, s, 1, D) -> (G * repeat, B, s, 1, D): rank p receives kv head p // repeat. The
    # one copy a replicated kv head costs (its backward sums the copies' gradients).
    return t.unsqueeze(1).expand(t.shape[0], repeat, *t.shape[1:]).flatten(0, 1)


def grouped_attention(module: nn.Module, layout: SendLayout, q: list[Tensor], k: list[Tensor], v: list[Tensor],
                      *args, **kwargs) -> list[Tensor]:
    """``module``'s attention (parallelized with :class:`UlyssesAttention`) on q, k, v in the
    send layout of ``layout``: one (P, B, s, n, D) tensor per q slab, one (G, B, s, n_kv, D)
    per kv slab (D_v for v). Returns one (P, B, s, n, Dv) tensor per q slab as the
    output's all-to-all delivered it (block p: heads of rank p), the input of
    :func:`project_from_received`. Other arguments pass as through the style's hooks
    (``sinks``: one per query head); the module's own forward runs without them."""
    style, mesh = module._ulysses_exchange
    size = layout.ranks
    sinks = kwargs.pop("sinks", None)
    if sinks is not None:  # a wrong one fails before any collective
        heads = size * sum(b - a for a, b in layout.q_slabs)
        sinks = _heads_of_rank(sinks, "sinks", heads, mesh)
    if layout.kv_groups < size:
        k = [_replicated(t, size // layout.kv_groups) for t in k]
        v = [_replicated(t, size // layout.kv_groups) for t in v]
    own_forward = type(module).forward
    if layout.chunks is None:
        if style.pack_qkv:
            heads = _grouped_to_heads([q[0], k[0], v[0]], mesh)
        else:
            heads = [_grouped_to_heads([t], mesh)[0] for t in (q[0], k[0], v[0])]
        extra = {} if sinks is None else {"sinks": sinks}
        return [_send_back(own_forward(module, *heads, *args, **kwargs, **extra), mesh)]
    call_spec = getattr(type(module), "call_spec", None)
    spec = None if call_spec is None else call_spec(module, *args, **kwargs)

    def fallback(q_h, k_h, v_h, s):  # the module's own forward, on the kernel layout
        extra = {} if s is None else {"sinks": s}
        o = own_forward(module, q_h.transpose(1, 2), k_h.transpose(1, 2), v_h.transpose(1, 2), *args, **kwargs,
                        **extra)
        return o.transpose(1, 2)

    def make_kernel(q_h, v_h):
        return split_kernel(spec, fallback, q_h, v_h, sinks is not None)

    return head_chunked_attention(q, k, v, sinks, mesh, layout.chunks, make_kernel, pack=style.pack_qkv)


@in_region("ulysses.layout")
def _grouped_to_heads(parts: list[Tensor], mesh: DeviceMesh) -> list[Tensor]:
    """(P, B, s, h_i, D_i) send buffers -> (B, S, h_i, D_i) kernel inputs (views of what
    arrived, at batch 1). Several parts share one all-to-all at the price of packing them."""
    if len(parts) == 1:
        return [_received_as_input(_all_to_all(parts[0], mesh))]
    send = torch.cat([p.flatten(3) for p in parts], dim=3)
    recv = _all_to_all(send, mesh)
    pieces = recv.split([p.shape[3] * p.shape[4] for p in parts], dim=3)
    return [_received_as_input(x.unflatten(3, p.shape[3:])) for x, p in zip(pieces, parts)]
