"""A Llama-3-style decoder written for sequence parallelism.

Every block works on this rank's slice of the sequence, ``(batch, seq/sp, dim)``.
The only place that needs the whole sequence is ``attention.inner`` (a
:class:`~ulysses_dtensor.attention.LocalAttention`), which is what
:class:`~ulysses_dtensor.parallel.ulysses.UlyssesAttention` is applied to.

Rotary embeddings (``rope.py``) are computed on the fly from ``position_ids``
and applied on the local slice before the exchange. With global position ids
(``shard_batch`` gives them) rope on a slice equals rope on the full sequence.

The same module covers the Hugging Face families (see ``hf_checkpoint.py``):
q/k/v bias (Qwen2), RMSNorm of q and k over head_dim (Qwen3), a head_dim that is
not ``dim / n_heads`` (Qwen3, Mistral-Nemo), and the rotate-half rope layout
(``rope_layout="half"``) in which HF stores q/k projections. Our own flavors keep
Meta's interleaved layout; the two are the same model up to a permutation of
each head's q/k rows (``hf_checkpoint.interleaved_to_half``).

Typical life cycle::

    with torch.device("meta"):
        model = Llama(llama_args("llama3_8b"))
    model = parallelize_llama(model, pmesh, ...)
    model.to_empty(device="cuda")
    model.init_weights(seed=0)       # same full weights whatever the mesh
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..attention import LocalAttention
from ..memory.tiling import auto_num_tiles, tiled_forward, tiled_sp_cross_entropy
from ..parallel.loss import sp_cross_entropy
from ..parallel.mesh import ring_degree
from ..parallel.ring_layout import layout_position_ids
from ..parallel.grouped_exchange import (
    grouped_attention,
    plain_linear,
    project_from_received,
    project_to_send,
    send_layout,
)
from ..runtime.regions import in_region, region
from .init import init_param
from .llama_args import FLAVORS, LlamaArgs, llama_args
from .norm import RMSNorm
from .rope import ROPE_LAYOUTS, RopeConfig, apply_rope, rope_cos_sin, rope_frequencies

__all__ = [
    "FLAVORS",
    "ROPE_LAYOUTS",
    "Llama",
    "LlamaArgs",
    "RopeConfig",
    "apply_rope",
    "llama_args",
    "rope_cos_sin",
    "rope_frequencies",
]


# ---------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------


class Attention(nn.Module):
    """q/k/v projections, rope, ``inner`` attention, o-projection.

    Under Ulysses (``inner`` parallelized with ``UlyssesAttention``) the projections write
    q, k, v in the all-to-all's send layout and the o-projection reads the output as its
    all-to-all delivers it (:func:`~ulysses_dtensor.parallel.grouped_exchange.grouped_attention`): no
    layout copy around the exchange at batch 1. ``grouped_qkv = False``, or projections
    that are not plain ``nn.Linear`` (FP8, LoRA, tensor parallelism), take the
    ``(B, S/P, H, D)`` path instead: the same numbers (up to the order of float sums; the
    o-projection adds its head blocks one by one), a permute copy per tensor each way.
    """

    grouped_qkv = True
    # Set by parallelize_llama under full activation checkpointing: the q / k norms (Qwen3)
    # keep the block's normed input, not their own (the projections' outputs, 1.25 x a
    # hidden-wide tensor under GQA), and their backward recomputes the projections from it.
    recompute_qk_norm_inputs = False

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.rope_layout = args.rope_layout
        bias = args.qkv_bias
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Sees (B, S, H, D) q/k/v. Under Ulysses: the full sequence, H/sp heads.
        self.inner = LocalAttention(args.attn_backend)

    def _send_layout(self, x: Tensor):
        if not self.grouped_qkv or not all(plain_linear(m) for m in (self.wq, self.wk, self.wv, self.wo)):
            return None
        return send_layout(self.inner, x.shape[0], x.shape[1], self.wq.out_features // self.head_dim,
                           self.wk.out_features // self.head_dim, self.head_dim, self.head_dim,
                           self.wq.weight.element_size())

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, document_ids: Tensor | None = None) -> Tensor:
        layout = self._send_layout(x)
        if layout is not None:
            return self._grouped_forward(layout, x, cos, sin, document_ids)
        b, s, _ = x.shape
        with region("proj.qkv"):
            if self._recompute_qk(plain_linear(self.wq) and plain_linear(self.wk)):
                q, k = checkpoint(self._normed_qk, x, use_reentrant=False, preserve_rng_state=False)
            else:
                q, k = self._normed_qk(x)
            v = self.wv(x).view(b, s, -1, self.head_dim)
        with region("rope"):
            q = apply_rope(q, cos, sin, self.rope_layout)
            k = apply_rope(k, cos, sin, self.rope_layout)
        out = self.inner(q, k, v, document_ids=document_ids)
        with region("proj.o"):
            return self.wo(out.reshape(b, s, -1))

    def _grouped_forward(self, layout, x: Tensor, cos: Tensor, sin: Tensor, document_ids: Tensor | None) -> Tensor:
        # The same steps on the send layout: per destination rank (and head chunk) blocks.
        d = self.head_dim
        with region("proj.qkv"):
            if self._recompute_qk(True):
                q, k = checkpoint(self._grouped_normed_qk, x, layout, use_reentrant=False, preserve_rng_state=False)
            else:
                q, k = self._grouped_normed_qk(x, layout)
            v = project_to_send(x, self.wv, layout.kv_groups, layout.kv_slabs, d)
        with region("rope"):
            q = [apply_rope(t, cos, sin, self.rope_layout) for t in q]
            k = [apply_rope(t, cos, sin, self.rope_layout) for t in k]
        out = grouped_attention(self.inner, layout, q, k, v, document_ids=document_ids)
        with region("proj.o"):
            return project_from_received(out, self.wo, layout.q_slabs)


    def _recompute_qk(self, plain: bool) -> bool:
        # Plain projections only (no dropout to replay); compiled blocks leave it to inductor.
        return (self.recompute_qk_norm_inputs and self.q_norm is not None and plain and torch.is_grad_enabled()
                and not torch.compiler.is_compiling())

    def _normed_qk(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def _grouped_normed_qk(self, x: Tensor, layout) -> tuple[list[Tensor], list[Tensor]]:
        d = self.head_dim
        q = project_to_send(x, self.wq, layout.ranks, layout.q_slabs, d)
        k = project_to_send(x, self.wk, layout.kv_groups, layout.kv_slabs, d)
        if self.q_norm is not None:
            q, k = [self.q_norm(t) for t in q], [self.k_norm(t) for t in k]
        return q, k


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``.

    ``num_tiles`` (set by ``parallelize_llama(tiled_mlp=...)``): 1 computes
    it whole; n > 1 over n sequence tiles, recomputed per tile in backward, so
    the (seq, ffn_dim) intermediates never exist whole; None picks n from the
    shapes. Tiling lives here, not in a wrapper, so parameter names (and
    checkpoints) are the same either way.
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.num_tiles: int | None = 1

    @in_region("mlp")  # inside each tile's checkpoint: its recompute is marked too
    def _swiglu(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x: Tensor) -> Tensor:
        n = self.num_tiles or auto_num_tiles(x.shape[1], self.w1.out_features, x.shape[-1])
        return tiled_forward(self._swiglu, x, n)


class OutputHead(nn.Linear):
    """The vocabulary projection; given labels, this rank's loss share instead.

    ``loss_chunks`` (set by ``parallelize_llama(tiled_loss=...)``): 1 makes
    the whole ``(B, s, vocab)`` logits; n > 1 computes logits and loss over n
    sequence chunks, never all at once; None picks n from the shapes. The loss
    is computed inside this module's forward so that under FSDP2 it runs with
    the gathered weight.
    """

    loss_chunks: int | None = 1

    @in_region("loss")
    def forward(
        self, h: Tensor, labels: Tensor | None = None, num_valid_tokens: Tensor | int | None = None
    ) -> Tensor:
        if labels is None:
            return super().forward(h)
        if self.loss_chunks == 1:
            return sp_cross_entropy(super().forward(h), labels, num_valid_tokens=num_valid_tokens)
        return tiled_sp_cross_entropy(
            h, self.weight, labels, num_valid_tokens, num_chunks=self.loss_chunks
        )


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, document_ids: Tensor | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, document_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only transformer; every tensor but ``document_ids`` is this rank's slice."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = OutputHead(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Set by parallelize_llama when sp > 1: default position ids are then
        # this rank's global offsets.
        self.sp_mesh = None
        # The rope in effect (set_rope changes it at a context stage boundary).
        self.rope: RopeConfig = args.rope
        # For length-dependent ropes (dynamic, longrope): the sequence length L that
        # chooses the frequencies. None: 1 + the largest position id of this forward's
        # batch over every sp rank (transformers' rule). The trainer pins it to the
        # step's GLOBAL batch so every mesh and micro-batch split uses the same L.
        self.rope_seq_len: int | None = None

    # -- rope ----------------------------------------------------------------

    def set_rope(self, rope: RopeConfig) -> None:
        """Use ``rope`` from the next forward on (weights untouched).

        The one entry point the trainer calls at a context stage boundary and
        on resume; a model of another implementation offers the same method.
        """
        if not isinstance(rope, RopeConfig):
            raise TypeError(f"set_rope takes a RopeConfig, got {type(rope).__name__}")
        rope.check_head_dim(self.args.head_dim)
        self.rope = rope

    def _rope_length(self, position_ids: Tensor) -> int:
        if self.rope_seq_len is not None:
            return self.rope_seq_len
        longest = position_ids.max().reshape(1)
        if self.sp_mesh is not None and self.sp_mesh.size() > 1:
            # A rank's slice alone would give each rank other frequencies.
            import torch.distributed as dist

            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.sp_mesh.get_group())
        return int(longest.item()) + 1

    def rope_cos_sin(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """float32 ``cos, sin`` ``(B, s, head_dim/2)`` of the rope in effect at ``position_ids``."""
        rope = self.rope
        seq_len = self._rope_length(position_ids) if rope.length_dependent else None
        inv_freq = rope_frequencies(rope, self.args.head_dim, seq_len, position_ids.device)
        return rope_cos_sin(position_ids, inv_freq, rope.attention_scaling)

    # -- forward -------------------------------------------------------------

    def _default_position_ids(self, input_ids: Tensor) -> Tensor:
        b, s = input_ids.shape
        if self.sp_mesh is None:
            return torch.arange(s, device=input_ids.device).expand(b, s)
        # This rank's global positions (the ring's layout when sp has a ring).
        mesh = self.sp_mesh
        pos = layout_position_ids(s, mesh.get_local_rank(), mesh.size(), ring_degree(mesh), input_ids.device)
        return pos.expand(b, s)

    def hidden_states(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Final normed hidden states ``(B, s_local, dim)`` (no output projection).

        For a tiled / chunked loss that applies ``self.output`` piece by piece.
        ``parallelize_llama`` registers this method with FSDP, so it can be
        called on a sharded model like ``forward``.
        """
        return self._hidden(input_ids, position_ids, document_ids)

    def _hidden(self, input_ids, position_ids, document_ids) -> Tensor:
        # forward() must not call hidden_states(): under FSDP that is a hooked
        # method whose exit reshards the root parameters (output.weight too).
        if position_ids is None:
            position_ids = self._default_position_ids(input_ids)
        if position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids {tuple(position_ids.shape)} must match input_ids "
                f"{tuple(input_ids.shape)} (both this rank's slice)"
            )
        cos, sin = self.rope_cos_sin(position_ids)
        with region("embedding"):
            h = self.tok_embeddings(input_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin, document_ids)
        return self.norm(h)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        num_valid_tokens: Tensor | int | None = None,
    ) -> Tensor:
        """Logits ``(B, s_local, vocab)`` for this rank's tokens, or its loss share.

        ``position_ids``: (B, s_local) GLOBAL positions (``shard_batch`` gives
        them); default ``arange`` offset by this rank's slice. ``document_ids``:
        (B, S_full) for packed-document masking, or None for plain causal.
        With ``labels`` (shifted, this rank's slice) it returns this rank's
        share of the global token-mean cross entropy: the local sum divided by
        ``num_valid_tokens``, the valid-label count of the WHOLE global batch
        (see :func:`~ulysses_dtensor.parallel.loss.count_valid_tokens`). This is the
        path the tiled loss takes.
        """
        h = self._hidden(input_ids, position_ids, document_ids)
        if labels is None:
            return self.output(h)
        if num_valid_tokens is None:
            raise ValueError(
                "labels given without num_valid_tokens: pass the valid-label count of the "
                "whole global batch (count_valid_tokens(labels, pmesh.loss)) so every rank "
                "divides by the same number"
            )
        return self.output(h, labels, num_valid_tokens)

    # -- sizes ---------------------------------------------------------------

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (full, unsharded; tied weights counted once).

        ``exclude_embeddings`` drops the input embedding table (a lookup, no
        FLOPs) unless it is tied to the output projection.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.args.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int, causal: bool = True) -> int:
        """Model FLOPs per trained token (forward + backward), for MFU.

        ``6 * N`` for the matmuls (N without the embedding lookup) plus
        attention scores and values: per layer and token ``2 * 2 * seq * H*hd``
        forward, times 3 for training, halved when causal.
        """
        a = self.args
        attn = 12 * a.n_layers * a.n_heads * a.head_dim * seq_len
        if causal:
            attn //= 2
        return 6 * self.num_params(exclude_embeddings=True) + attn

    # -- init ----------------------------------------------------------------

    def _init_plan(self):
        """(name, parameter, kind, std) for every parameter, in a fixed order."""
        a = self.args
        emb_std = a.dim**-0.5 if a.tie_embeddings else 1.0
        yield "tok_embeddings.weight", self.tok_embeddings.weight, "normal", emb_std
        for i in range(a.n_layers):
            layer = self.layers[str(i)]
            depth_std = 0.02 / math.sqrt(2 * (i + 1))
            pre = f"layers.{i}."
            yield pre + "attention_norm.weight", layer.attention_norm.weight, "ones", 0.0
            yield pre + "ffn_norm.weight", layer.ffn_norm.weight, "ones", 0.0
            att, ff = layer.attention, layer.feed_forward
            for n in ("wq", "wk", "wv"):
                yield pre + f"attention.{n}.weight", getattr(att, n).weight, "trunc_normal", 0.02
                if a.qkv_bias:
                    yield pre + f"attention.{n}.bias", getattr(att, n).bias, "zeros", 0.0
            if a.qk_norm:
                yield pre + "attention.q_norm.weight", att.q_norm.weight, "ones", 0.0
                yield pre + "attention.k_norm.weight", att.k_norm.weight, "ones", 0.0
            yield pre + "attention.wo.weight", att.wo.weight, "trunc_normal", depth_std
            yield pre + "feed_forward.w1.weight", ff.w1.weight, "trunc_normal", 0.02
            yield pre + "feed_forward.w2.weight", ff.w2.weight, "trunc_normal", depth_std
            yield pre + "feed_forward.w3.weight", ff.w3.weight, "trunc_normal", depth_std
        yield "norm.weight", self.norm.weight, "ones", 0.0
        if not a.tie_embeddings:
            yield "output.weight", self.output.weight, "trunc_normal", a.dim**-0.5

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter in place from ``seed``.

        Works on plain and on sharded (DTensor) parameters after
        ``to_empty``. Each parameter is drawn in fixed blocks of rows, each
        from its own generator seeded by (seed, name, block), so a rank draws
        only the blocks its shard overlaps and the full weights are the same
        whatever the mesh (for one device type). Nothing is materialised
        beyond one block per parameter at a time.
        """
        plan = list(self._init_plan())
        covered = {id(p) for _, p, _, _ in plan}
        missing = [n for n, p in self.named_parameters() if id(p) not in covered]
        if missing:
            raise RuntimeError(f"init_weights has no rule for parameters {missing}")
        for name, param, kind, std in plan:
            init_param(param, name, kind, std, seed)
