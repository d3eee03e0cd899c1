"""The transformers families ``parallelize_hf_model`` knows, and how it finds
their decoder layers.

A family is known when its parity with transformers' own unsharded model
(loss and every gradient, packed documents, sp 2 / sp 4 / dp 2 x sp 2) is a
test (``tests/test_hf_integration.py``). Anything else is refused by default
with its class and ``model_type`` named: a model can pass every structural
check and still shape attention in a way nobody verified (a new keyword, a
mask of its own). ``allow_untested=True`` runs it anyway, under the same
structural checks.
"""

from __future__ import annotations

from torch import nn

__all__ = ["KNOWN_MODEL_TYPES", "check_known_family", "decoder_layers", "text_config_key"]

# model_type -> what of it the parity test covers.
KNOWN_MODEL_TYPES = {
    "llama": "GQA",
    "qwen2": "GQA, qkv bias",
    "qwen3": "MQA, q/k norms, tied embeddings",
    "mistral": "sliding window shorter than the sequence",
    "gemma2": "sliding / full layers, soft-capping, query_pre_attn_scalar scaling",
    "gemma3_text": "sliding / full layers with their own rope bases",
    "cohere2": "sliding layers with rope, full layers without",
    "gpt_oss": "attention sinks, sliding / full layers, MoE router loss",
    "qwen3_moe": "MoE router loss",
    "mixtral": "MoE router loss",
    "deepseek_v3": "MLA (v head dim of its own), MoE",
    "phi3": "fused qkv projection",
    "olmo2": "q/k norms over all heads",
    "glm4": "partial rotary, extra norms",
    "granite": "attention multiplier as scaling",
    "smollm3": "layers without rope",
    "qwen2_5_vl": "text path, multimodal rope position ids (3, B, S)",
    "qwen3_next": "hybrid: gated delta-net layers (tests/test_hf_linear_attention.py), gated full attention, MoE",
    "qwen3_5_text": "hybrid: gated delta-net layers (tests/test_hf_linear_attention.py)",
    "qwen3_5_moe_text": "hybrid: gated delta-net layers (tests/test_hf_linear_attention.py), MoE",
}


def check_known_family(model: nn.Module, allow_untested: bool) -> None:
    model_type = getattr(model.config, "model_type", None)
    if allow_untested or model_type in KNOWN_MODEL_TYPES:
        return
    raise ValueError(
        f"{type(model).__name__} (model_type={model_type!r}) is not a family parallelize_hf_model has been "
        f"tested on; known: {', '.join(sorted(KNOWN_MODEL_TYPES))}. Pass allow_untested=True to run it under "
        "the structural checks alone"
    )


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


def decoder_layers(model: nn.Module) -> list[nn.ModuleList]:
    """Candidate decoder-layer lists: module lists of ``_no_split_modules`` blocks,
    inside the text decoder for a multimodal model (its vision tower's blocks
    are left alone: they attend bidirectionally and stay unwrapped)."""
    root = model
    if text_config_key(model) is not None:
        root = model.get_decoder()
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    return [
        m for m in root.modules()
        if isinstance(m, nn.ModuleList) and len(m) and all(type(c).__name__ in block_names for c in m)
    ]
