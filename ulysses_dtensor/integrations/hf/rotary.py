"""Changing the rope of a transformers model in place (context stages), weights untouched.

transformers computes a decoder's rotary frequencies once, in its rotary module
(``<decoder>.rotary_emb``): ``inv_freq`` and ``attention_scaling`` from
``config.rope_parameters`` through the module's ``compute_default_rope_parameters``
or ``ROPE_INIT_FUNCTIONS[rope_type]``; its forward multiplies position ids by
``inv_freq``. :func:`rope_inv_freq` calls those same functions on a copy of the
config carrying the new rope, so the model computes bit for bit what a fresh
model built from a config.json with that rope computes (:func:`export_rope_fields`
writes that config.json).

The length-dependent types (``dynamic``, ``longrope``) are recomputed per
forward by transformers from ``1 + max(position_ids)`` of the call: under
sequence parallelism that is one rank's slice. Once this module drives the
rotary module it marks it ``rope_type = "default"`` (transformers' per-call
update then does nothing) and the caller passes the length of the WHOLE batch.

Families whose rope this cannot change are named by :func:`rope_support`'s
reason: per-layer-type ropes (Gemma3's local / global), no rotary module, or
a rotary module of another shape.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ulysses_dtensor.models.rope import ROPE_PARAMETERS, RopeConfig, RopeError

__all__ = ["RopeSupport", "check_family_rope", "export_rope_fields", "rope_inv_freq", "rope_support", "set_rotary"]

# Keys of rope_parameters that belong to every rope type (the RopeConfig's own).
_ROPE_KEYS = {"rope_type", "rope_theta", *(k for req, opt in ROPE_PARAMETERS.values() for k in (*req, *opt))}


@dataclass
class RopeSupport:
    """What :func:`rope_support` found in a transformers model."""

    rope: RopeConfig | None  # the model's own rope; None: the family's rope cannot be changed
    reason: str = ""  # why not (for the error naming the stage)
    rotary: list = field(default_factory=list)  # the decoder's rotary module(s)
    extras: dict = field(default_factory=dict)  # family keys kept under every rope (partial_rotary_factor, mrope_section)
    rope_dim: int = 0  # dims rotated per head (2 x inv_freq entries)
    max_position_embeddings: int | None = None
    text_config: object = None

    def check_rope(self, rope: RopeConfig) -> None:
        """ValueError where this family's config refuses ``rope`` (transformers' message)."""
        rope.check_head_dim(self.rope_dim, "rope")
        check_family_rope(self.text_config, rope, self.extras)


def _text_decoder(model: nn.Module) -> nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return getattr(decoder, "language_model", decoder)


def rope_support(model: nn.Module) -> RopeSupport:
    """The model's rope as a :class:`RopeConfig` and its rotary module, or why a
    context stage cannot change it (on ``meta`` too: only shapes are read)."""
    text = model.config.get_text_config()
    # the family's class (under the adapter's and FSDP's)
    name = next((c.__name__ for c in type(model).__mro__ if c.__module__.startswith("transformers.")),
                type(model).__name__)
    max_pos = getattr(text, "max_position_embeddings", None)
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        return RopeSupport(None, f"{name} has one rope per layer type ({', '.join(params)}), which a stage's "
                                 "single rope cannot set")
    rotary = [m for m in _text_decoder(model).modules()
              if any(b.endswith("inv_freq") for b, _ in m.named_buffers(recurse=False))]
    if not rotary or not isinstance(params, dict):
        return RopeSupport(None, f"{name} has no rotary embedding module this trainer can find")
    if len(rotary) > 1:
        return RopeSupport(None, f"{name} has {len(rotary)} rotary embedding modules; only one is supported")
    module = rotary[0]
    if not isinstance(getattr(module, "rope_type", None), str) or not hasattr(module, "inv_freq"):
        return RopeSupport(None, f"{name}'s rotary module {type(module).__name__} is not transformers' "
                                 "standard one (inv_freq, one rope_type)")
    if getattr(text, "default_rope_type", "default") != "default":
        return RopeSupport(None, f"{name}'s rope type is {text.default_rope_type!r}, not one of transformers' "
                                 "standard types")
    extras = {k: v for k, v in params.items() if k not in _ROPE_KEYS}
    table = {k: v for k, v in params.items() if k in _ROPE_KEYS and v is not None}
    rope_dim = 2 * module.inv_freq.numel()
    try:
        rope = RopeConfig.from_parameters(table, where=f"{name} config.rope_parameters", head_dim=rope_dim,
                                          max_position_embeddings=max_pos)
    except RopeError as e:
        return RopeSupport(None, str(e))
    return RopeSupport(rope, "", [module], extras, rope_dim, max_pos, text)


def _config_with(text_config, rope: RopeConfig, extras: dict):
    """A copy of ``text_config`` whose rope is ``rope`` (what a config.json written by
    :func:`export_rope_fields` loads as)."""
    from ulysses_dtensor.models.llama_checkpoint import hf_rope_fields

    config = copy.deepcopy(text_config)
    config.rope_parameters = {**extras, **rope.parameters()}
    # The length the export writes for this type (dynamic: its original length; yarn:
    # factor x original), where transformers checks the rope against it.
    fields, _ = hf_rope_fields(rope, trained_len=0, source={"max_position_embeddings": config.max_position_embeddings})
    config.max_position_embeddings = fields["max_position_embeddings"]
    if getattr(config, "original_max_position_embeddings", None) is not None and rope.original_max_position_embeddings:
        # Phi-3 keeps the original length at the top level, and it wins there.
        config.original_max_position_embeddings = rope.original_max_position_embeddings
    return config


def check_family_rope(text_config, rope: RopeConfig, extras: dict) -> None:
    """ValueError with transformers' own words where the family's config refuses ``rope``
    or warns about it (Phi-3 takes only ``default`` / ``longrope``)."""
    import logging

    config = _config_with(text_config, rope, extras)
    validate = getattr(config, "validate_rope", None)
    if validate is None:
        return
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        validate()
    finally:
        logger.removeHandler(handler)
    if messages:
        raise ValueError("; ".join(messages))


def rope_inv_freq(module: nn.Module, text_config, rope: RopeConfig, extras: dict,
                  seq_len: int | None = None) -> tuple[Tensor, float]:
    """(inv_freq, attention_scaling) transformers computes for ``rope`` in ``module``'s
    family; ``seq_len``: the L of ``dynamic`` / ``longrope`` (None: within the original length)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _config_with(text_config, rope, extras)
    fn = module.compute_default_rope_parameters if rope.rope_type == "default" else ROPE_INIT_FUNCTIONS[rope.rope_type]
    device = module.inv_freq.device
    inv_freq, scaling = fn(config, device=device, seq_len=seq_len)
    return inv_freq.to(device=device, dtype=module.inv_freq.dtype), float(scaling)


def set_rotary(module: nn.Module, inv_freq: Tensor, scaling: float) -> None:
    """Give the rotary module these frequencies; transformers' per-call update is switched off."""
    with torch.no_grad():
        module.inv_freq.copy_(inv_freq)
    module.attention_scaling = scaling
    module.rope_type = "default"  # the dynamic / longrope update of transformers' forward does nothing


def export_rope_fields(config: dict, rope: RopeConfig, *, trained_len: int) -> tuple[dict, str | None]:
    """``config`` (a transformers config.json dict; a multimodal one's rope is in its
    ``text_config``) with ``rope`` written so that transformers computes it, and
    ``max_position_embeddings`` per :func:`~ulysses_dtensor.models.llama_checkpoint.hf_rope_fields`;
    family keys (``partial_rotary_factor``, ``mrope_section``) kept. Returns (config, note)."""
    from ulysses_dtensor.models.llama_checkpoint import hf_rope_fields

    config = dict(config)
    holder = config
    if "max_position_embeddings" not in config and isinstance(config.get("text_config"), dict):
        holder = config["text_config"] = dict(config["text_config"])
    fields, note = hf_rope_fields(rope, trained_len=trained_len, source=holder)
    old = holder.get("rope_parameters") or {}
    extras = {k: v for k, v in {**(holder.get("rope_scaling") or {}), **old}.items()
              if k not in _ROPE_KEYS and k != "type"}
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        holder.pop(key, None)
    if "rope_parameters" in fields:
        fields["rope_parameters"] = {**extras, **fields["rope_parameters"]}
    elif extras:
        fields["rope_scaling"] = {**extras, **(fields["rope_scaling"] or {"rope_type": "default"})}
    holder.update(fields)
    if holder.get("original_max_position_embeddings") is not None and rope.original_max_position_embeddings:
        holder["original_max_position_embeddings"] = rope.original_max_position_embeddings
    return config, note
