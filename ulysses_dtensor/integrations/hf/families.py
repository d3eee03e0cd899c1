"""Whether ``parallelize_hf_model`` runs a transformers family, and how it finds
its decoder layers.

A family is accepted because the family matrix MEASURED it for the installed
transformers version (:mod:`~ulysses_dtensor.integrations.hf.matrix.results`: loss and every gradient equal to
transformers' own unsharded model, packed documents, sp 2 and, for windows,
soft-caps, sinks, MLA and hybrid layers, sp 4 and dp_shard 2 x sp 2). A family
the matrix refused is refused with the matrix's reason. A family it has not
measured (newer than the matrix, or another transformers version) is checked at
start on the mesh's own ranks (:func:`~.family_check.verify_at_start`).
``allow_untested=True`` skips all of that and runs the model under the
structural checks alone.
"""

from __future__ import annotations

from torch import nn

from .matrix.results import FamilyStatus, family_status

__all__ = ["check_known_family", "decoder_layers", "is_attention_module", "text_config_key"]


def check_known_family(model: nn.Module, allow_untested: bool) -> FamilyStatus:
    """The family's status (:class:`~ulysses_dtensor.integrations.hf.matrix.results.FamilyStatus`); ValueError naming the
    class, the model type and the matrix's reason for a refused family (unless ``allow_untested``)."""
    status = family_status(model)
    if allow_untested:
        return FamilyStatus(status.model_type, "untested", "allow_untested=True: not checked against the family "
                                                           f"matrix nor at start ({status.state})")
    if status.state == "refused":
        raise ValueError(
            f"{type(model).__name__} (model_type={status.model_type!r}) is refused by the family matrix: "
            f"{status.detail}. Pass allow_untested=True to run it under the structural checks alone"
        )
    return status


def text_config_key(model: nn.Module) -> str | None:
    """The sub-config key of the text model of a multimodal model (``"text_config"``), else None."""
    config = model.config
    text = config.get_text_config()
    if text is config:
        return None
    for key in getattr(config, "sub_configs", {}):
        if getattr(config, key, None) is text:
            return key
    raise ValueError(f"{type(model).__name__}: its text config is not one of its sub-configs {list(config.sub_configs)}")


def is_attention_module(module: nn.Module) -> bool:
    """A transformers attention module (its class ends in ``Attention``, or ``MLA`` for the
    multi-head latent attention of DeepSeek-style families)."""
    return type(module).__name__.endswith(("Attention", "MLA"))


def decoder_layers(model: nn.Module) -> list[nn.ModuleList]:
    """Candidate decoder-layer lists: module lists of ``_no_split_modules`` blocks
    (for a model that declares none: of blocks that each hold an attention module),
    inside the text decoder for a multimodal model (its vision tower's blocks
    are left alone: they attend bidirectionally and stay unwrapped)."""
    root = model
    if text_config_key(model) is not None:
        root = model.get_decoder()
    block_names = set(getattr(model, "_no_split_modules", None) or ())

    def is_block(m: nn.Module) -> bool:
        if block_names:
            return type(m).__name__ in block_names
        return any(is_attention_module(c) for c in m.modules())

    return [m for m in root.modules() if isinstance(m, nn.ModuleList) and len(m) and all(is_block(c) for c in m)]
