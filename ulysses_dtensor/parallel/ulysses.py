"""Ulysses sequence parallelism: switch attention inputs from Shard(seq) to Shard(heads).

Each sp rank holds ``seq / sp`` tokens of every head. Around attention one
all-to-all per tensor turns that into ``heads / sp`` heads of every token, the
local attention runs over the whole sequence, and one all-to-all turns the
output back. Per rank and tensor that moves ``(sp-1)/sp`` of the local shard,
O(n*d/P) bytes, and never gathers the sequence.

torch 2.13's ``DTensor.redistribute(Shard(1) -> Shard(2))`` falls back to an
all-gather on CPU process groups (P times the bytes and the memory), so the
switch is done here with the functional ``all_to_all_single``, which has
autograd, runs on gloo and NCCL alike, and traces under ``torch.compile``. The
result is re-wrapped as a DTensor with the new placement, so callers keep
DTensor semantics.

Layout copies. The all-to-all sends a ``(P, B, s, h/P, D)`` buffer, destination
rank first, and receives one with the source rank first. From the
``(B, s, H, D)`` contract the send needs a permute copy per tensor and the
output's arrival another. A model can skip both (:mod:`.grouped_exchange`; our Llama
does): its q/k/v projections write the send buffers as batched
matmuls over the destination blocks of their weights; at batch 1 the received
``(P, 1, s, h/P, D)`` buffer is the kernel's ``(1, S, h/P, D)`` input as it
lands and the kernel's output the send buffer of the way back; the o-projection
sums over the received head blocks. Backward is the autograd of the same views
and matmuls: no copy either. What still copies: kv heads replicated for
``sp > kv_heads`` (the replication itself), ``pack_qkv`` (the packing), batch > 1
(the sequence blocks of a row are not adjacent on arrival).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from ..runtime.regions import in_region
from .comm_timing import active_timer, timed_all_to_all
from .head_chunk_kernels import split_kernel
from .head_chunk_plan import AUTO_MIN_BYTES, check_head_chunks, resolve_head_chunks
from .head_chunks import head_chunked_attention
from .mesh import divisors

SEQ_DIM = 1
HEAD_DIM = 2
# Keyword arguments of the inner module indexed by query head (dim 0): each
# rank passes on the block of the heads it holds after the exchange.
HEAD_KWARGS = ("sinks",)


# ---------------------------------------------------------------------------
# The exchange on local tensors: (B, S/P, H, D) <-> (B, S, H/P, D)
# ---------------------------------------------------------------------------


@in_region("ulysses.all_to_all")
def _all_to_all(x: Tensor, mesh: DeviceMesh) -> Tensor:
    # Input is laid out (P, ...): chunk i goes to rank i, chunk i of the result
    # came from rank i. The backward of this op is the reverse all-to-all.
    timer = active_timer()
    if timer is not None:  # metrics: the exchange's share of step time (eager only)
        return timed_all_to_all(x, mesh.get_group(), timer)
    return funcol.all_to_all_single_autograd(x, None, None, mesh.get_group())


@in_region("ulysses.layout")
def _seq_to_heads_local(parts: list[Tensor], mesh: DeviceMesh) -> list[Tensor]:
    """(B, s, h_i, D_i) shards of the sequence -> (B, s*P, h_i/P, D_i) shards of heads.

    Several tensors go through one all-to-all: their per-destination chunks
    are flattened and concatenated, so packing q, k, v costs one collective
    even when v's head dim differs from q's and k's (MLA).
    """
    world = mesh.size()
    batch, seq = parts[0].shape[:2]
    # (B, s, h, D) -> (P, B, s, h/P * D): destination rank first.
    chunks = [
        p.reshape(batch, seq, world, -1).permute(2, 0, 1, 3)
        for p in parts
    ]
    send = torch.cat(chunks, dim=3) if len(chunks) > 1 else chunks[0]
    recv = _all_to_all(send.contiguous(), mesh)
    # recv is (P, B, s, sum h/P*D) with the source rank (= sequence block) first.
    recv = recv.view(world, batch, seq, -1).permute(1, 0, 2, 3).reshape(batch, world * seq, -1)
    sizes = [c.shape[3] for c in chunks]
    pieces = recv.split(sizes, dim=2) if len(parts) > 1 else [recv]
    return [x.view(batch, world * seq, p.shape[2] // world, p.shape[3]) for x, p in zip(pieces, parts)]


@in_region("ulysses.layout")
def _heads_to_seq_local(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """(B, S, h, D) shard of heads -> (B, S/P, h*P, D) shard of the sequence."""
    world = mesh.size()
    batch, seq, heads, dim = x.shape
    # (B, S, h, D) -> (P, B, S/P, h, D): sequence block = destination rank.
    send = x.reshape(batch, world, seq // world, heads, dim).transpose(0, 1)
    recv = _all_to_all(send.contiguous(), mesh)
    # recv is (P, B, S/P, h, D) with the source rank (= head block) first.
    return recv.view(world, batch, seq // world, heads, dim).permute(1, 2, 0, 3, 4).reshape(
        batch, seq // world, world * heads, dim
    )


# ---------------------------------------------------------------------------
# The exchange as DTensor placement switches
# ---------------------------------------------------------------------------


def _expect(x: DTensor, placement: Shard, what: str) -> None:
    if x.device_mesh.ndim != 1 or tuple(x.placements) != (placement,):
        raise ValueError(
            f"{what} expects a DTensor on a 1-D sp mesh with placements ({placement},), "
            f"got mesh ndim={x.device_mesh.ndim} placements={tuple(x.placements)}"
        )


def seq_to_heads(*tensors: DTensor) -> list[DTensor]:
    """Redistribute ``Shard(1)`` (sequence) DTensors to ``Shard(2)`` (heads).

    All tensors share one all-to-all. Each must have a head count divisible by
    the mesh size and the same sequence length.
    """
    mesh = tensors[0].device_mesh
    for t in tensors:
        _expect(t, Shard(SEQ_DIM), "seq_to_heads")
    outs = _seq_to_heads_local([t.to_local() for t in tensors], mesh)
    return [DTensor.from_local(o, mesh, [Shard(HEAD_DIM)], run_check=False) for o in outs]


def heads_to_seq(x: DTensor) -> DTensor:
    """Redistribute a ``Shard(2)`` (heads) DTensor to ``Shard(1)`` (sequence)."""
    _expect(x, Shard(HEAD_DIM), "heads_to_seq")
    out = _heads_to_seq_local(x.to_local(), x.device_mesh)
    return DTensor.from_local(out, x.device_mesh, [Shard(SEQ_DIM)], run_check=False)


# ---------------------------------------------------------------------------
# Head bookkeeping for GQA / MQA
# ---------------------------------------------------------------------------


def kv_replication(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each kv head is repeated before the exchange (1 = split).

    With ``kv_heads % sp == 0`` kv heads are split like q heads. With
    ``sp % kv_heads == 0`` each kv head is repeated ``sp / kv_heads`` times so
    rank r receives kv head ``r // (sp / kv_heads)``, the one its q heads use.
    """
    if heads % sp:
        raise ValueError(
            f"Ulysses needs heads % sp == 0, got heads={heads}, kv_heads={kv_heads}, "
            f"sp={sp}; valid sp for {heads} heads: {divisors(heads)}"
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"heads={heads} must be a multiple of kv_heads={kv_heads} (sp={sp})"
        )
    if kv_heads % sp == 0:
        return 1
    if sp % kv_heads == 0:
        return sp // kv_heads
    raise ValueError(
        f"Ulysses cannot place kv_heads={kv_heads} on sp={sp} ranks (heads={heads}): "
        f"need kv_heads % sp == 0 (split) or sp % kv_heads == 0 (replicate); valid sp: "
        f"{[d for d in divisors(heads) if kv_heads % d == 0 or d % kv_heads == 0]}"
    )


# ---------------------------------------------------------------------------
# The ParallelStyle
# ---------------------------------------------------------------------------


class UlyssesAttention(ParallelStyle):
    """Ulysses SP for an inner attention module ``forward(q, k, v, **kwargs)``.

    Apply on the 1-D sp mesh::

        parallelize_module(inner_attn, mesh["sp"], UlyssesAttention())

    Before: ``q: (B, S/P, H, D)``, ``k: (B, S/P, H_kv, D)``, ``v: (B, S/P,
    H_kv, D_v)`` (``D_v`` may differ: MLA), plain tensors holding this rank's
    sequence slice (or DTensors placed ``Shard(1)``); the module returns
    ``(B, S/P, H, D_v)``. Inside, the inner module sees plain tensors with the
    full sequence and ``H/P`` heads (and its kv heads); keyword arguments (e.g.
    global document ids) pass unchanged, except ``sinks`` (one value per query
    head), of which each rank passes on its heads' block.

    Args:
        pack_qkv: exchange q, k and v in one all-to-all instead of three.
        use_local_output: return a plain tensor (default) rather than a
            ``Shard(1)`` DTensor, as in PyTorch's own parallel styles. A flag
            rather than mirroring the input kind keeps the hooks free of
            per-call state, which compiled checkpoint regions cannot replay.
        head_chunks: run the exchange and the attention kernel over chunks of
            a rank's heads, forward and backward (:mod:`.head_chunks`): 1 (the
            default) none, an int a count :func:`~.head_chunk_plan.valid_head_chunks`
            allows, None a count from each call's shapes
            (:func:`~.head_chunk_plan.auto_head_chunks`). With chunks the module's
            ``forward`` is replaced in place (the hooks cannot split a call):
            its kernel runs split into forward and backward when the module
            describes its call (``call_spec``), else its own forward is re-run
            with grad per chunk in backward.

    A model can hand q, k, v over in the all-to-all's send layout instead of calling the
    module (:mod:`.grouped_exchange`; our Llama does): the same
    exchange, kernel and numbers, without the hooks' permute copies.
    """

    def __init__(self, *, pack_qkv: bool = False, use_local_output: bool = True, head_chunks: int | None = 1):
        super().__init__()
        if head_chunks is not None and (isinstance(head_chunks, bool) or not isinstance(head_chunks, int)
                                        or head_chunks < 1):
            raise ValueError(f"head_chunks={head_chunks!r} must be a positive integer (1: no chunks) or None "
                             "(a count from the shapes)")
        self.pack_qkv = pack_qkv
        self.use_local_output = use_local_output
        self.head_chunks = head_chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"UlyssesAttention must be applied on the 1-D sp mesh (mesh['sp']), "
                f"got a {device_mesh.ndim}-D mesh with dims {device_mesh.mesh_dim_names}"
            )
        if device_mesh.size() == 1:
            # Nothing to exchange: leave the module as it is (no copies, no
            # 1-rank collectives).
            return module
        # For models that hand over q, k, v in the send layout (grouped_attention).
        module._ulysses_exchange = (self, device_mesh)
        if self.head_chunks != 1:
            module.forward = _chunked_forward(module, device_mesh, self)
            return module

        def pre_hook(_mod, args, kwargs):
            q, k, v, rest = _split_qkv(args, kwargs)
            # Per-head arguments first: a wrong one fails before any collective.
            for name in HEAD_KWARGS:
                if kwargs.get(name) is not None:
                    kwargs = {**kwargs, name: _heads_of_rank(kwargs[name], name, q.shape[HEAD_DIM], device_mesh)}
            q, k, v = self._to_heads(q, k, v, device_mesh)
            return (q, k, v, *rest), kwargs

        def post_hook(_mod, _args, _kwargs, out):
            if isinstance(out, DTensor):
                raise TypeError("the inner attention module must return a plain tensor")
            if self.use_local_output:
                return _heads_to_seq_local(out, device_mesh)
            return heads_to_seq(DTensor.from_local(out, device_mesh, [Shard(HEAD_DIM)], run_check=False))

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook, with_kwargs=True)
        return module

    @in_region("ulysses.layout")
    def _to_heads(self, q, k, v, mesh: DeviceMesh) -> list[Tensor]:
        if self.pack_qkv:
            q, k, v = _exchange_inputs(q, k, v, mesh)
            return _seq_to_heads_local([q, k, v], mesh)
        q, k, v = _exchange_inputs(q, k, v, mesh, replicate=False)
        repeat = kv_replication(q.shape[HEAD_DIM], k.shape[HEAD_DIM], mesh.size())
        # One copy per tensor into the send layout, the kv replication included.
        sends = [_to_send_layout(q, mesh.size()), *(_to_send_layout(t, mesh.size(), repeat) for t in (k, v))]
        return [_received_as_input(_all_to_all(t, mesh)) for t in sends]

    def __repr__(self) -> str:
        chunks = "" if self.head_chunks == 1 else f", head_chunks={self.head_chunks}"
        return f"{type(self).__name__}(pack_qkv={self.pack_qkv}, use_local_output={self.use_local_output}{chunks})"


def _exchange_inputs(q, k, v, mesh: DeviceMesh, replicate: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's (B, S/P, H, D) slices of q, k, v as the exchange takes them: checked,
    and (``replicate``) kv heads repeated so that each rank receives the kv head its q heads use."""
    # Plain tensors are this rank's Shard(1) slices and go straight to the
    # exchange on local tensors: the same collective as the DTensor path,
    # without a DTensor wrap and unwrap per tensor (measurable per-layer
    # CPU overhead in eager mode at short per-rank lengths).
    sp = mesh.size()
    q, k, v = (_local_seq_shard(t, mesh, name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q, k, v must agree on batch and sequence and k, v on heads (head dims may differ); got "
            f"q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)} (this rank's slices)"
        )
    repeat = kv_replication(q.shape[HEAD_DIM], k.shape[HEAD_DIM], sp)
    if repeat > 1 and replicate:
        # Repeat each kv head on the local slice; the repeat's backward sums
        # the gradients of the copies, so kv grads stay exact.
        k, v = (t.repeat_interleave(repeat, dim=HEAD_DIM) for t in (k, v))
    return q, k, v


def _chunked_forward(module: nn.Module, mesh: DeviceMesh, style: "UlyssesAttention"):
    """``module``'s forward under :class:`UlyssesAttention` with head chunks: each call is
    exchanged and attended chunk by chunk (:func:`~.head_chunks.head_chunked_attention`),
    or, when the call resolves to one chunk, exchanged whole as the hooks do. The module's
    own forward is its class's (one function for every layer: compiled blocks share a graph)."""
    own_forward = type(module).forward
    call_spec = getattr(type(module), "call_spec", None)

    def forward(*args, **kwargs):
        q, k, v, rest = _split_qkv(args, kwargs)
        sinks = kwargs.pop("sinks", None)
        if sinks is not None:  # a wrong one fails before any collective
            sinks = _heads_of_rank(sinks, "sinks", q.shape[HEAD_DIM], mesh)
        q, k, v = _exchange_inputs(q, k, v, mesh)
        size = mesh.size()
        chunks = resolve_head_chunks(style.head_chunks, q.shape[0], q.shape[1] * size, q.shape[HEAD_DIM] // size,
                                     k.shape[HEAD_DIM] // size, q.shape[-1], v.shape[-1], q.element_size())
        if chunks == 1:
            heads = _seq_to_heads_local([q, k, v], mesh) if style.pack_qkv else [
                _seq_to_heads_local([t], mesh)[0] for t in (q, k, v)]
            extra = {} if sinks is None else {"sinks": sinks}
            out = _heads_to_seq_local(own_forward(module, *heads, *rest, **kwargs, **extra), mesh)
        else:
            def fallback(q_h, k_h, v_h, s):  # the module's own forward, on the kernel layout
                extra = {} if s is None else {"sinks": s}
                o = own_forward(module, q_h.transpose(1, 2), k_h.transpose(1, 2), v_h.transpose(1, 2), *rest,
                                **kwargs, **extra)
                return o.transpose(1, 2)

            spec = None if call_spec is None else call_spec(module, *rest, **kwargs)

            def make_kernel(q_h, v_h):
                return split_kernel(spec, fallback, q_h, v_h, sinks is not None)

            out = head_chunked_attention(q, k, v, sinks, mesh, chunks, make_kernel, pack=style.pack_qkv)
        if style.use_local_output:
            return out
        return DTensor.from_local(out, mesh, [Shard(SEQ_DIM)], run_check=False)

    return forward


def _heads_of_rank(t: Tensor, name: str, heads: int, mesh: DeviceMesh) -> Tensor:
    """Rank r's block of a per-query-head tensor: heads r*H/P ... (r+1)*H/P - 1, the
    q heads the exchange gives it (kv-head replication does not change them).
    Slicing is differentiable: each rank's gradient covers its own heads."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if t.dim() != 1 or t.shape[0] != heads:
        raise ValueError(
            f"UlyssesAttention: {name} must have one entry per query head, shape ({heads},); "
            f"got {tuple(t.shape)}"
        )
    per_rank = heads // mesh.size()
    start = mesh.get_local_rank() * per_rank
    return t[start : start + per_rank]


def _split_qkv(args: tuple, kwargs: dict):
    names = ("q", "k", "v")
    vals = list(args[:3])
    for name in names[len(vals):]:
        if name not in kwargs:
            raise TypeError(f"UlyssesAttention: inner attention forward needs {name!r}")
        vals.append(kwargs.pop(name))
    return vals[0], vals[1], vals[2], args[3:]


def _local_seq_shard(t, mesh: DeviceMesh, name: str) -> Tensor:
    """This rank's (B, S/P, H, D) slice of ``t`` (a plain tensor or a Shard(1) DTensor)."""
    sp = mesh.size()
    if isinstance(t, DTensor):
        _expect(t, Shard(SEQ_DIM), f"UlyssesAttention input {name}")
        if t.dim() != 4 or t.shape[SEQ_DIM] % sp:
            raise ValueError(
                f"UlyssesAttention input {name} has global shape {tuple(t.shape)}: need "
                f"(batch, seq, heads, head_dim) with seq divisible by sp={sp}; pad the "
                f"sequence to a multiple of {sp} (shard_batch does this)"
            )
        return t.to_local()
    if not isinstance(t, Tensor) or t.dim() != 4:
        raise ValueError(
            f"UlyssesAttention input {name} must be a (batch, seq/sp, heads, head_dim) "
            f"tensor, got {getattr(t, 'shape', type(t))}"
        )
    return t



@in_region("ulysses.layout")
def _received_as_input(recv: Tensor) -> Tensor:
    # (P, B, s, h, D), source rank = sequence block -> (B, S, h, D): a view at batch 1.
    size, b, s = recv.shape[:3]
    return recv.transpose(0, 1).reshape(b, size * s, *recv.shape[3:])


def _to_send_layout(t: Tensor, size: int, repeat: int = 1) -> Tensor:
    """A (B, s, h, D) slice as the (P, B, s, h * repeat / P, D) send buffer, in one copy
    (``repeat`` > 1: one kv head per rank, kv head i going to ranks i * repeat ...)."""
    if repeat == 1:
        return t.unflatten(2, (size, -1)).permute(2, 0, 1, 3, 4).contiguous()
    b, s, h, d = t.shape
    # Expanded in place of the head dim: the backward's sum over the copies lands in t's layout.
    return t.unsqueeze(3).expand(b, s, h, repeat, d).permute(2, 3, 0, 1, 4).reshape(size, b, s, 1, d)


# ---------------------------------------------------------------------------
# Head chunks of a model, before anything is applied
# ---------------------------------------------------------------------------


def check_chunks_for_heads(value, heads: int, kv_heads: int, ulysses: int, key: str = "head_chunks") -> int | None:
    """:func:`check_head_chunks` for a model of ``heads`` / ``kv_heads`` (per tp rank) exchanged over
    ``ulysses`` ranks (kv heads replicated as the exchange does), before anything is applied;
    ``key``: the setting's name in the message."""
    if value is None or ulysses == 1:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key}={value!r} must be a positive integer (1: no chunks) or None")
        return value
    exchanged = kv_heads * kv_replication(heads, kv_heads, ulysses)
    return check_head_chunks(value, heads // ulysses, exchanged // ulysses, key)


def describe_head_chunks(setting: int | None, seq: int, heads: int, kv_heads: int, head_dim: int,
                         v_head_dim: int, sp: int, element_size: int, batch: int = 1) -> str:
    """The banner's words: how many head chunks run at ``seq`` tokens (``heads`` / ``kv_heads``
    of the model as they enter the exchange over ``sp`` ranks, kv heads replicated as needed)."""
    if sp == 1:
        return "head chunks: none (no exchange, sp 1)"
    hq, hk = heads // sp, kv_heads * kv_replication(heads, kv_heads, sp) // sp
    n = resolve_head_chunks(setting, batch, seq, hq, hk, head_dim, v_head_dim, element_size)
    if setting is not None:
        how = "named"
    else:
        working = 2 * batch * seq * element_size * (hq + hk) * (head_dim + v_head_dim)
        how = (f"auto: a layer's exchanged attention tensors are {working / (1 << 30):.1f} GiB per rank, "
               f"chunked from {AUTO_MIN_BYTES >> 30} GiB")
    kv = "; k/v exchanged once per kv head" if n > hk else ""
    return f"head chunks: {n} ({hq} query heads per rank, {seq:,} tokens; {how}{kv})"


def exchange_bytes_per_rank(
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    sp: int,
    element_size: int,
    *,
    backward: bool = True,
    v_head_dim: int | None = None,
    head_chunks: int = 1,
) -> int:
    """Bytes one rank sends through all-to-all for one attention layer.

    Forward moves q, k, v (kv after replication for GQA) and the output, each
    a ``(batch, seq/sp, h, d)`` shard of which ``(sp-1)/sp`` leaves the
    rank, with ``d = v_head_dim`` (default ``head_dim``) for v and the output;
    backward moves their gradients, the same volume again. Packing q, k, v
    changes the number of collectives, not the bytes. With ``head_chunks`` > 1
    backward also sends the output again, chunk by chunk (its kernels take it
    with its gradient: :mod:`.head_chunks`).
    """
    if sp == 1:
        return 0
    dv = head_dim if v_head_dim is None else v_head_dim
    kv_exchanged = kv_heads * kv_replication(heads, kv_heads, sp)
    local_tokens = batch * seq // sp
    elements = local_tokens * (head_dim + dv) * (heads + kv_exchanged)
    sent = elements * element_size * (sp - 1) // sp
    if not backward:
        return sent
    again = local_tokens * heads * dv * element_size * (sp - 1) // sp if head_chunks > 1 else 0
    return 2 * sent + again
