"""Ulysses SP for the gated delta-net layers of hybrid transformers models.

Qwen3-Next and Qwen3.5 (dense and MoE) interleave full-attention layers with
``linear_attention`` layers: a gated delta-net (``*GatedDeltaNet``). Its token
mixing -- a short causal convolution over the q/k/v channels, then a per-head
recurrence -- is per head, like attention, so Ulysses applies to it the same
way. Per layer, in :func:`_ulysses_forward`:

1. the projections run on this rank's slice of the sequence (q, k, v before
   the convolution, the output gate ``z``, and the per-head ``b``/``a`` that
   become ``beta`` and the decay ``g``);
2. one all-to-all switches q, k, v, b, a from Shard(seq) to Shard(heads):
   each rank now holds the WHOLE sequence for ``k_heads/sp`` key heads and
   ``v_heads/sp`` value heads (``v_heads`` is a multiple of ``k_heads``, and
   value head ``j`` uses key head ``j // (v_heads/k_heads)``, so splitting
   both by sp keeps every pair on one rank);
3. the convolution (its weight rows for this rank's channels), the gates
   (``A_log``, ``dt_bias`` for this rank's heads) and the recurrence run over
   the whole sequence; with packed documents (the model's
   :data:`~.hf_attention.DOCUMENT_IDS_KWARG`) both restart at every document
   start (:mod:`~ulysses_dtensor.mixers.gated_delta`), as if each document ran alone;
4. one all-to-all brings the per-head output back to Shard(seq), where the
   gated RMSNorm (with the local ``z``) and the out projection run.

Two all-to-alls per linear layer forward, two in backward. The convolution and the
recurrence run on fla-core's / causal-conv1d's GPU kernels where they compute the same
result (CUDA, 16-bit, packages installed), else on the torch code, both restarting at
packed documents (:mod:`ulysses_dtensor.mixers.dispatch` decides and logs the choice).

The other token mixers that run, and the checks that refuse the rest, are in
:mod:`.layer_types`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ulysses_dtensor.mixers.dispatch import causal_conv, gated_delta_rule
from ulysses_dtensor.parallel.mesh import divisors
from ulysses_dtensor.parallel.ulysses import _all_to_all, _heads_to_seq_local

from ..attention_function import CallState, call_document_ids
from .style import UlyssesMixerStyle, conv_activation

__all__ = ["GATED_DELTA_NETS", "LINEAR_LAYER_TYPE", "UlyssesGatedDeltaNet", "check_gated_delta_heads"]

# The value of ``config.layer_types`` for gated delta-net layers.
LINEAR_LAYER_TYPE = "linear_attention"


# ---------------------------------------------------------------------------
# Families: how each gated delta-net projects its inputs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _DeltaNetParts:
    """What differs between families: the projections (on the local slice,
    returning q, k, v before the convolution as (B, s, heads, dim), the gate
    z as (B, s, v_heads, v_dim), and b, a as (B, s, v_heads)), and the names of
    the gated norm and the out projection."""

    project: Callable[[nn.Module, Tensor], tuple[Tensor, ...]]
    norm: str = "norm"
    out: str = "out_proj"


def _project_qwen3_next(m: nn.Module, h: Tensor) -> tuple[Tensor, ...]:
    # One fused projection grouped per key head; the module's own helper splits it.
    return m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))


def _project_qwen3_5(m: nn.Module, h: Tensor) -> tuple[Tensor, ...]:
    batch, seq, _ = h.shape
    q, k, v = m.in_proj_qkv(h).split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q, k = (t.reshape(batch, seq, -1, m.head_k_dim) for t in (q, k))
    v = v.reshape(batch, seq, -1, m.head_v_dim)
    z = m.in_proj_z(h).reshape(batch, seq, -1, m.head_v_dim)
    return q, k, v, z, m.in_proj_b(h), m.in_proj_a(h)


# Gated delta-net classes (by name: transformers is an optional dependency)
# whose layers run under Ulysses, each parity-tested against the unsharded model.
GATED_DELTA_NETS: dict[str, _DeltaNetParts] = {
    "Qwen3NextGatedDeltaNet": _DeltaNetParts(_project_qwen3_next),
    "Qwen3_5GatedDeltaNet": _DeltaNetParts(_project_qwen3_5),
    "Qwen3_5MoeGatedDeltaNet": _DeltaNetParts(_project_qwen3_5),
}


# ---------------------------------------------------------------------------
# Checks: sp must place the heads
# ---------------------------------------------------------------------------


def check_gated_delta_heads(name: str, module: nn.Module, sp: int) -> None:
    """Refuse an sp that does not divide both head counts, naming the valid ones."""
    k_heads, v_heads = module.num_k_heads, module.num_v_heads
    if k_heads % sp == 0 and v_heads % sp == 0:
        return
    valid = [d for d in divisors(k_heads) if v_heads % d == 0]
    raise ValueError(
        f"{name}: Ulysses SP splits the gated delta-net's key and value heads over sp ranks, but "
        f"linear_num_key_heads={k_heads} and linear_num_value_heads={v_heads} are not both "
        f"divisible by sp={sp}; valid sp: {valid}"
    )


# ---------------------------------------------------------------------------
# The exchange: mixed head dims in one all-to-all
# ---------------------------------------------------------------------------


def _seq_to_heads_mixed(parts: list[Tensor], mesh: DeviceMesh) -> list[Tensor]:
    """(B, s, h_i, d_i) sequence shards -> (B, s*P, h_i/P, d_i) head shards, one all-to-all.

    Like :func:`~ulysses_dtensor.parallel.ulysses._seq_to_heads_local`, but the tensors
    may differ in head dim: each destination's chunk of each tensor is
    flattened and the chunks are concatenated.
    """
    world = mesh.size()
    batch, seq = parts[0].shape[:2]
    # (B, s, h, d) -> (P, B, s, h/P * d): destination rank first.
    send = torch.cat([p.reshape(batch, seq, world, -1).permute(2, 0, 1, 3) for p in parts], dim=-1)
    recv = _all_to_all(send.contiguous(), mesh)  # (P, B, s, sum): source rank = sequence block
    widths = [p.shape[2] // world * p.shape[3] for p in parts]
    outs = []
    for p, chunk in zip(parts, recv.split(widths, dim=-1)):
        heads, dim = p.shape[2] // world, p.shape[3]
        chunk = chunk.reshape(world, batch, seq, heads, dim).permute(1, 0, 2, 3, 4)
        outs.append(chunk.reshape(batch, world * seq, heads, dim))
    return outs


# ---------------------------------------------------------------------------
# The Ulysses forward and its ParallelStyle
# ---------------------------------------------------------------------------

# transformers' own packed-sequence metadata, which these layers would need
# instead of the whole sequence's document ids.
_REFUSED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def _ulysses_forward(
    module: nn.Module,
    parts: _DeltaNetParts,
    mesh: DeviceMesh,
    model_name: str,
    call: CallState | None,
    hidden_states: Tensor,
    cache_params=None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """The gated delta-net's forward on this rank's slice ``(B, s, hidden)``."""
    if cache_params is not None:
        raise ValueError(f"{model_name}: a cache (generation) is not supported under Ulysses SP; use_cache=False")
    if attention_mask is not None:
        raise ValueError(
            f"{model_name}: a padding mask reached a gated delta-net layer under Ulysses SP; pack "
            "documents and describe them with position_ids (shard_hf_batch)"
        )
    for kw in _REFUSED_KWARGS:
        if kwargs.get(kw) is not None:
            raise ValueError(
                f"{model_name}: {kw}=... (transformers' packed-sequence metadata) is not supported under "
                "Ulysses SP; use shard_hf_batch's document ids"
            )
    sp, rank = mesh.size(), mesh.get_local_rank()
    batch, seq, _ = hidden_states.shape

    q, k, v, z, b, a = parts.project(module, hidden_states)
    if sp > 1:
        q, k, v, b, a = _seq_to_heads_mixed([q, k, v, b.unsqueeze(-1), a.unsqueeze(-1)], mesh)
        b, a = b.squeeze(-1), a.squeeze(-1)
    k_heads, k_dim = q.shape[2:]
    v_heads, v_dim = v.shape[2:]

    # This rank's channels of the depthwise convolution: its q, k and v heads.
    weight, bias = module.conv1d.weight.squeeze(1), module.conv1d.bias
    starts = (rank * k_heads * k_dim, module.key_dim + rank * k_heads * k_dim, 2 * module.key_dim + rank * v_heads * v_dim)
    widths = (k_heads * k_dim, k_heads * k_dim, v_heads * v_dim)
    weight = torch.cat([weight.narrow(0, s, w) for s, w in zip(starts, widths)])
    if bias is not None:
        bias = torch.cat([bias.narrow(0, s, w) for s, w in zip(starts, widths)])
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)

    documents = call_document_ids(kwargs, call)
    mixed = causal_conv(mixed, weight, bias, documents, conv_activation(module))
    q, k, v = mixed.split(widths, dim=-1)
    q, k = (t.reshape(batch, -1, k_heads, k_dim) for t in (q, k))
    v = v.reshape(batch, -1, v_heads, v_dim)

    heads = slice(rank * v_heads, (rank + 1) * v_heads)
    beta = b.sigmoid()
    g = -module.A_log[heads].float().exp() * F.softplus(a.float() + module.dt_bias[heads])
    out = gated_delta_rule(q, k, v, g, beta, documents)
    if sp > 1:
        out = _heads_to_seq_local(out, mesh)

    out = getattr(module, parts.norm)(out.reshape(-1, v_dim), z.reshape(-1, v_dim))
    return getattr(module, parts.out)(out.reshape(batch, seq, -1))


class UlyssesGatedDeltaNet(UlyssesMixerStyle):
    """Ulysses SP for one gated delta-net module (a class of :data:`GATED_DELTA_NETS`).

    Apply on the 1-D sp mesh::

        parallelize_module(model.model.layers[0].linear_attn, mesh["sp"], UlyssesGatedDeltaNet("Qwen3NextForCausalLM"))

    The module then takes this rank's slice ``(B, S/P, hidden)`` and returns
    its slice of the output; parameters and their names are unchanged. Also at
    sp 1, where nothing is exchanged: packed documents still restart the state.
    """

    kind, classes = "gated delta-net", GATED_DELTA_NETS
    check = staticmethod(check_gated_delta_heads)

    @staticmethod
    def forward_fn(module: nn.Module, mesh: DeviceMesh, model_name: str, call: CallState | None, *args, **kwargs):
        return _ulysses_forward(module, GATED_DELTA_NETS[type(module).__name__], mesh, model_name, call, *args, **kwargs)
