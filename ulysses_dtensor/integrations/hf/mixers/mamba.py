"""Ulysses SP for the Mamba mixers of hybrid transformers models.

Mamba-2 mixers (Bamba, Nemotron-H, Granite-4.0-H ``granitemoehybrid``, Falcon-H1,
Zamba2) and Jamba's Mamba mixers mix tokens per head (Mamba-2) or per channel
(Mamba), like attention, so Ulysses applies to them the same way. Per layer:

1. the input projection runs on this rank's slice of the sequence;
2. one all-to-all switches what the scan needs from Shard(seq) to
   Shard(heads / channels): each rank holds the WHOLE sequence of
   ``heads/sp`` heads (Mamba-2: their x, their dt, their groups' B and C --
   groups fewer than sp are repeated so that each rank gets the group of its
   heads) or of ``channels/sp`` channels (Mamba);
3. the short causal convolution (this rank's rows of its weight) and the scan
   (this rank's ``A``, ``D``, ``dt`` bias) run over the whole sequence; with
   packed documents both restart at every document start, as if each document ran
   alone (:mod:`ulysses_dtensor.mixers.dispatch`: causal-conv1d's / fla-core's and
   mamba-ssm's GPU kernels where they compute the same result, else the torch code).
   Mamba's B, C and dt come from every channel (``x_proj``): each rank projects
   its channels and one all-reduce of ``(batch, seq, dt_rank + 2 state)`` sums
   them (autograd: the same all-reduce in backward);
4. one all-to-all brings the output back to Shard(seq), where the gate, the
   gated norm and the out projection run on the local slice.

The kernels are called directly (transformers' own kernel paths are not used under SP).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ulysses_dtensor.mixers.dispatch import causal_conv, selective_scan, ssd_scan
from ulysses_dtensor.parallel.mesh import divisors
from ulysses_dtensor.parallel.ulysses import _heads_to_seq_local, _seq_to_heads_local

from ..attention_function import CallState, call_document_ids
from .style import UlyssesMixerStyle, conv_activation

__all__ = ["MAMBA2_MIXERS", "MAMBA_MIXERS", "UlyssesMamba", "UlyssesMamba2", "check_mamba", "check_mamba2"]

# Mixer classes (by name) whose layers run under Ulysses, each parity-tested in the family matrix.
MAMBA2_MIXERS = frozenset({"BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "FalconH1Mixer",
                           "Zamba2MambaMixer"})
MAMBA_MIXERS = frozenset({"JambaMambaMixer"})

# transformers' own packed-sequence metadata and caches: refused (the whole sequence's
# document ids come from shard_hf_batch instead).
_REFUSED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "cu_seqlens")


def check_mamba2(name: str, module: nn.Module, sp: int) -> None:
    """Refuse an sp that cannot place the mixer's heads and groups, naming the valid ones."""
    heads, groups = module.num_heads, module.n_groups
    if heads % sp == 0 and (groups % sp == 0 or sp % groups == 0):
        return
    valid = [d for d in divisors(heads) if groups % d == 0 or d % groups == 0]
    raise ValueError(
        f"{name}: Ulysses SP splits the Mamba-2 mixer's heads over sp ranks (and its groups, or repeats "
        f"them), but {type(module).__name__} has {heads} heads in {groups} groups, which sp={sp} cannot "
        f"place; valid sp: {valid}")


def check_mamba(name: str, module: nn.Module, sp: int) -> None:
    channels = module.intermediate_size
    if channels % sp:
        raise ValueError(
            f"{name}: Ulysses SP splits the Mamba mixer's {channels} channels over sp ranks, but sp={sp} does "
            f"not divide them; valid sp: {divisors(channels)}")


def _refuse_inputs(model_name: str, kind: str, attention_mask, kwargs) -> None:
    for key in ("cache", "cache_params", "past_key_values"):
        if kwargs.get(key) is not None:
            raise ValueError(f"{model_name}: a cache (generation) is not supported under Ulysses SP; use_cache=False")
    if attention_mask is not None:
        raise ValueError(
            f"{model_name}: a padding mask reached a {kind} layer under Ulysses SP; pack documents and "
            "describe them with position_ids (shard_hf_batch)")
    for key in _REFUSED_KWARGS:
        if kwargs.get(key) is not None:
            raise ValueError(f"{model_name}: {key}=... (transformers' packed-sequence metadata) is not supported "
                             "under Ulysses SP; use shard_hf_batch's document ids")


# ---------------------------------------------------------------------------
# Mamba-2
# ---------------------------------------------------------------------------


def _mamba2_forward(module: nn.Module, mesh: DeviceMesh, model_name: str, call: CallState | None,
                    hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """The Mamba-2 mixer's forward on this rank's slice ``(B, s, hidden)``."""
    _refuse_inputs(model_name, "Mamba-2", attention_mask, {**kwargs, "cache": cache})
    sp, rank = mesh.size(), mesh.get_local_rank()
    batch, seq, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, groups, state = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    inner = module.intermediate_size

    # Falcon-H1's muP multipliers (absent elsewhere).
    projected = module.in_proj(hidden_states * getattr(module, "ssm_in_multiplier", 1.0))
    if getattr(module, "mup_vector", None) is not None:
        projected = projected * module.mup_vector
    gate, xbc, dt = projected.split([inner, module.conv_dim, heads], dim=-1)
    x, b, c = xbc.split([inner, groups * state, groups * state], dim=-1)
    x = x.reshape(batch, seq, heads, head_dim)
    b, c = (t.reshape(batch, seq, groups, state) for t in (b, c))
    repeat = sp // groups if groups < sp else 1  # each rank needs the group of its heads
    if repeat > 1:
        b, c = (t.repeat_interleave(repeat, dim=2) for t in (b, c))
    if sp > 1:
        x, b, c, dt = _seq_to_heads_local([x, b, c, dt.unsqueeze(-1)], mesh)
        dt = dt.squeeze(-1)
    local_heads, local_groups = x.shape[2], b.shape[2]
    first_group = rank // repeat if repeat > 1 else rank * local_groups

    # This rank's channels of the depthwise convolution: its heads' x, its groups' B and C.
    weight, bias = module.conv1d.weight.squeeze(1), module.conv1d.bias
    starts = (rank * local_heads * head_dim, inner + first_group * state, inner + (groups + first_group) * state)
    widths = (local_heads * head_dim, local_groups * state, local_groups * state)
    weight = torch.cat([weight.narrow(0, s, w) for s, w in zip(starts, widths)])
    if bias is not None:
        bias = torch.cat([bias.narrow(0, s, w) for s, w in zip(starts, widths)])
    documents = call_document_ids(kwargs, call)
    mixed = torch.cat([x.flatten(2), b.flatten(2), c.flatten(2)], dim=-1)
    mixed = causal_conv(mixed, weight, bias, documents, conv_activation(module))
    x, b, c = mixed.split(widths, dim=-1)
    x = x.reshape(batch, -1, local_heads, head_dim)
    b, c = (t.reshape(batch, -1, local_groups, state) for t in (b, c))

    mine = slice(rank * local_heads, (rank + 1) * local_heads)
    low, high = module.time_step_limit
    dt = F.softplus(dt + module.dt_bias[mine].to(dt.dtype)).clamp(min=low, max=high)
    A = -torch.exp(module.A_log[mine].float())
    y = ssd_scan(x, dt, A, b, c, module.chunk_size, module.D[mine], documents)
    if sp > 1:
        y = _heads_to_seq_local(y, mesh)
    y = y.reshape(batch, seq, inner)
    if getattr(module, "mamba_rms_norm", True):
        y = module.norm(y, gate)
    else:  # Falcon-H1 without its gated norm: the gate alone
        y = y * F.silu(gate)
    return module.out_proj(y.to(dtype))


# ---------------------------------------------------------------------------
# Mamba (Jamba)
# ---------------------------------------------------------------------------


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks; backward sums the gradients (every rank uses the sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def _mamba_forward(module: nn.Module, mesh: DeviceMesh, model_name: str, call: CallState | None,
                   hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """The Mamba mixer's forward on this rank's slice ``(B, s, hidden)``."""
    _refuse_inputs(model_name, "Mamba", attention_mask, {**kwargs, "cache": cache})
    sp, rank = mesh.size(), mesh.get_local_rank()
    dtype = hidden_states.dtype
    rank_dim, state = module.time_step_rank, module.ssm_state_size

    x, gate = module.in_proj(hidden_states).chunk(2, dim=-1)
    if sp > 1:
        (x,) = _seq_to_heads_local([x.unsqueeze(-1)], mesh)
        x = x.squeeze(-1)
    width = x.shape[-1]
    mine = slice(rank * width, (rank + 1) * width)
    documents = call_document_ids(kwargs, call)
    bias = None if module.conv1d.bias is None else module.conv1d.bias[mine]
    x = causal_conv(x, module.conv1d.weight.squeeze(1)[mine], bias, documents, conv_activation(module))
    # dt, B, C project every channel: this rank's share, summed over the ranks.
    projected = F.linear(x, module.x_proj.weight[:, mine])
    if sp > 1:
        projected = _AllReduceSum.apply(projected, mesh.get_group())
    dt, b, c = projected.split([rank_dim, state, state], dim=-1)
    dt, b, c = module.dt_layernorm(dt), module.b_layernorm(b), module.c_layernorm(c)
    A = -torch.exp(module.A_log[mine].float())
    y = selective_scan(x, F.linear(dt, module.dt_proj.weight[mine]), module.dt_proj.bias[mine], A, b, c,
                       module.D[mine], documents)
    if sp > 1:
        y = _heads_to_seq_local(y.unsqueeze(-1), mesh).squeeze(-1)
    return module.out_proj((y * F.silu(gate)).to(dtype))


# ---------------------------------------------------------------------------
# ParallelStyles
# ---------------------------------------------------------------------------


class UlyssesMamba2(UlyssesMixerStyle):
    """Ulysses SP for one Mamba-2 mixer (a class of :data:`MAMBA2_MIXERS`), on the 1-D sp mesh.
    The module then takes this rank's slice ``(B, S/P, hidden)`` and returns its slice of the
    output; parameters and their names are unchanged."""

    kind, classes = "Mamba-2 mixer", MAMBA2_MIXERS
    check = staticmethod(check_mamba2)
    forward_fn = staticmethod(_mamba2_forward)


class UlyssesMamba(UlyssesMixerStyle):
    """Ulysses SP for one Mamba mixer (a class of :data:`MAMBA_MIXERS`), on the 1-D sp mesh."""

    kind, classes = "Mamba mixer", MAMBA_MIXERS
    check = staticmethod(check_mamba)
    forward_fn = staticmethod(_mamba_forward)
