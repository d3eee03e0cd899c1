"""Token mixers besides attention that run under Ulysses, and the checks that refuse the others.

A decoder layer mixes tokens through attention (transformers' registry: the
exchange of :mod:`~ulysses_dtensor.integrations.hf.attention_function`) or through one of these mixers, each with an
exchange of its own around a per-head / per-channel recurrence or convolution
that restarts at packed documents' starts:

============================  ==================================  =======================
mixer                         classes                             module
============================  ==================================  =======================
gated delta-net               Qwen3-Next, Qwen3.5 (dense / MoE)   :mod:`.gated_delta_net`
Mamba-2                       Bamba, Nemotron-H, Granite-4.0-H,   :mod:`.mamba`
                              Falcon-H1, Zamba2
Mamba                         Jamba                               :mod:`.mamba`
short convolution             LFM2, LFM2-MoE, LFM3                :mod:`.short_conv`
============================  ==================================  =======================

Everything else that mixes tokens outside the registry -- other recurrences,
lightning / delta attention variants, convolutions of other classes, layer
types with masks of their own (chunked, indexed, compressed attention) -- would
see only this rank's slice of the sequence: refused by name, never run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .gated_delta_net import GATED_DELTA_NETS, LINEAR_LAYER_TYPE, UlyssesGatedDeltaNet, check_gated_delta_heads
from .mamba import MAMBA2_MIXERS, MAMBA_MIXERS, UlyssesMamba, UlyssesMamba2, check_mamba, check_mamba2
from .short_conv import SHORT_CONVS, UlyssesShortConv, check_short_conv

__all__ = ["MIXERS", "TokenMixer", "check_layer_types", "has_token_mixers", "mixer_of", "mixer_ops",
           "token_mixer_modules"]


@dataclass(frozen=True)
class TokenMixer:
    kind: str
    classes: frozenset
    style: Callable  # (model_name, call) -> ParallelStyle, applied on the sp mesh
    check: Callable  # (model_name, module, sp) -> None, or ValueError naming the valid sp
    ops: frozenset  # the ops of ulysses_dtensor.mixers.dispatch it runs (names of describe_mixer_kernels)


MIXERS = (
    TokenMixer("gated delta-net", frozenset(GATED_DELTA_NETS), UlyssesGatedDeltaNet, check_gated_delta_heads,
               frozenset({"conv", "gated_delta"})),
    TokenMixer("Mamba-2", MAMBA2_MIXERS, UlyssesMamba2, check_mamba2, frozenset({"conv", "ssd"})),
    TokenMixer("Mamba", MAMBA_MIXERS, UlyssesMamba, check_mamba, frozenset({"conv", "selective"})),
    TokenMixer("short convolution", SHORT_CONVS, UlyssesShortConv, check_short_conv, frozenset({"conv"})),
)
_SUPPORTED = frozenset().union(*(m.classes for m in MIXERS))
# Layer types backed by a mixer above (each such layer must hold one), and layer types
# that mix no tokens at all (Nemotron-H's MLP / MoE layers).
MIXER_LAYER_TYPES = (LINEAR_LAYER_TYPE, "conv", "hybrid")
PER_TOKEN_LAYER_TYPES = ("mlp", "moe")


def mixer_of(module: nn.Module) -> TokenMixer | None:
    return next((m for m in MIXERS if type(module).__name__ in m.classes), None)


def has_token_mixers(model: nn.Module) -> bool:
    """Whether ``model`` has mixers of :data:`MIXERS` (their attention layers, if any,
    still go through transformers' attention registry)."""
    return any(mixer_of(m) is not None for m in model.modules())


def mixer_ops(model: nn.Module) -> frozenset[str]:
    """The token-mixing ops the mixers of ``model`` run (empty without such mixers), for
    :func:`~ulysses_dtensor.mixers.kernel_choice.describe_mixer_kernels`."""
    return frozenset().union(*(m.ops for m in map(mixer_of, model.modules()) if m is not None))


def _conv_owners(module: nn.Module) -> list[str]:
    """Class names of the modules owning a convolution: token mixers outside attention."""
    return sorted({type(m).__name__ for m in module.modules() if any(isinstance(c, nn.Conv1d) for c in m.children())})


def _supported_names() -> str:
    return "; ".join(f"{m.kind}s {sorted(m.classes)}" for m in MIXERS)


def check_layer_types(model: nn.Module, attention_types: tuple[str, ...]) -> None:
    """Refuse layer types that mix tokens neither through attention (``attention_types``) nor
    through a mixer of :data:`MIXERS`, naming them and the convolutions found."""
    name = type(model).__name__
    types = list(getattr(model.config.get_text_config(), "layer_types", None) or ())
    allowed = (*attention_types, *PER_TOKEN_LAYER_TYPES, *(MIXER_LAYER_TYPES if has_token_mixers(model) else ()))
    other = sorted(set(types) - set(allowed))
    if not other:
        return
    mixers = [c for c in _conv_owners(model) if c not in _SUPPORTED]
    found = f" (token mixers with a convolution: {mixers})" if mixers else ""
    raise ValueError(
        f"{name} has layer types {other}{found}, which mix tokens outside transformers' attention "
        f"registry or with masks Ulysses SP does not implement; supported: {list(attention_types)}, and "
        f"{list(MIXER_LAYER_TYPES)} layers of {_supported_names()}"
    )


def token_mixer_modules(name: str, layers: nn.ModuleList, layer_types: list | None, sp: int
                        ) -> list[tuple[nn.Module, TokenMixer]]:
    """The mixers of :data:`MIXERS` in ``layers`` (checked: sp places them), after refusing any
    other module of the layers that owns a convolution, and any layer whose type says it mixes
    tokens outside attention without holding such a mixer (it would see this rank's slice only)."""
    found = []
    for i, layer in enumerate(layers):
        mine = [(m, mixer_of(m)) for m in layer.modules() if mixer_of(m) is not None]
        others = [c for c in _conv_owners(layer) if c not in _SUPPORTED]
        if others:
            raise ValueError(
                f"{name}: decoder layer {type(layer).__name__} holds {others}, a convolution over the sequence "
                f"that Ulysses SP does not run; supported token mixers besides attention: {_supported_names()}")
        kind = layer_types[i] if layer_types and i < len(layer_types) else None
        if kind in MIXER_LAYER_TYPES and not mine:
            raise ValueError(
                f"{name}: decoder layer {i} is a {kind!r} layer without a supported mixer (its modules: "
                f"{sorted({type(m).__name__ for m in layer.children()})}); supported: {_supported_names()}")
        found += mine
    for module, mixer in found:
        mixer.check(name, module, sp)
    return found
