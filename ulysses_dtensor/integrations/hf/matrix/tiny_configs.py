"""Every model type transformers maps to a causal LM, as a tiny model: the family matrix's table.

The matrix (``scripts/family_matrix.py``: every family; ``tests/test_family_matrix.py``
re-measures a sample and checks the results) measures each decoder family by parity (:mod:`.check`); this module says
WHAT it builds. A tiny config is the family's own config class with its sizes
shrunk generically -- :func:`shrink_config` reads the class's ``__init__``
keywords (hidden size, heads, experts, MLA ranks, linear / Mamba dims, ...), keeps
one layer of each distinct kind the default config lays out, switches dropout,
router jitter and noise off (the reference must be deterministic), and makes
every pattern bite at a short length (a window of 4, soft-caps that change the
scores) -- plus the per-family overrides of :data:`OVERRIDES`, each with its reason.

Categories (:func:`category`): ``decoder`` (measured), ``multimodal`` (their text
path stands or falls with the text family named in :data:`TEXT_FAMILIES`),
``encoder_decoder`` (decoder halves of seq2seq models), ``encoder`` (bidirectional
encoders that can be flagged as decoders) and ``attention_free`` (no attention at
all): the last three are refused for what they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = [
    "CATEGORIES",
    "OVERRIDES",
    "TEXT_FAMILIES",
    "Override",
    "category",
    "causal_lm_types",
    "shrink_config",
    "tiny_config",
    "tiny_model",
]

CATEGORIES = ("decoder", "multimodal", "encoder_decoder", "encoder", "attention_free")

# The sizes of every tiny model: 4 heads of 8 (2 kv heads), MLPs of 64, 64 token ids.
TINY = dict(
    vocab_size=64, hidden_size=32, d_model=32, n_embd=32, intermediate_size=64, ffn_dim=64, n_inner=64,
    num_attention_heads=4, n_head=4, num_heads=4, n_heads=4, num_key_value_heads=2, head_dim=8,
    max_position_embeddings=64, n_positions=64, n_ctx=64, initializer_range=0.1, rotary_dim=4,
    # MoE: 4 experts, 2 per token, narrow experts, one group.
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_topk=2,
    moe_k=2, top_k_experts=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, shared_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, expert_ffn_hidden_size=32, n_group=1, topk_group=1,
    # MLA: a latent of 16, q/k head dim 8 + 4 rope dims, a v head dim of its own.
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, qk_head_dim=12,
    # Gated delta-nets: 4 key heads of 8, 8 value heads of 16.
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    # Mamba mixers: 8 heads of 8 (64 channels), 2 groups, state 8, chunks of 8 (29 tokens cross 4).
    mamba_n_heads=8, mamba_num_heads=8, n_mamba_heads=8, mamba_d_head=8, mamba_head_dim=8, mamba_expand=2,
    expand=2, mamba_d_state=8, ssm_state_size=8, state_size=8, mamba_n_groups=2, n_groups=2, mamba_ngroups=2,
    mamba_chunk_size=8, chunk_size=8, mamba_d_conv=4, conv_kernel=4, mamba_d_ssm=64, mamba_dt_rank=4, time_step_rank=4,
    use_mamba_kernels=False,
    # Per-layer input embeddings (Gemma-3n / Gemma-4).
    vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
)
# Reference numerics: a window shorter than every test document; soft-caps small enough to change the scores.
WINDOW = 4
SOFTCAP = 0.5
# Keys that make the reference random when non-zero.
_NOISE_WORDS = ("dropout", "pdrop", "jitter", "noise", "layerdrop")
# Per-layer lists longer than this many kinds are cut (cost).
MAX_LAYERS = 4
# Lists of layer INDICES (not one entry per layer): remapped onto the kept layers.
_INDEX_LISTS = ("full_attn_idxs", "attn_layer_indices", "mlp_only_layers", "moe_layers", "local_layer_ids")

# Model types by category where the config alone does not say it.
_ATTENTION_FREE = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}
_ENCODERS = {"bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
             "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl",
             "xmod"}
_DECODER_HALVES = {"trocr", "musicgen", "musicgen_melody"}  # besides is_encoder_decoder configs
_MULTIMODAL = {"git", "phi4_multimodal"}  # besides configs with a text sub-config
_DRAFT_MODELS = {"gemma4_assistant"}  # a text sub-config, but a decoder-only (draft) model
# A multimodal model type -> the model type of its text decoder in this matrix (its text path).
TEXT_FAMILIES = {
    "gemma3": "gemma3_text", "gemma3n": "gemma3n_text", "gemma4": "gemma4_text", "gemma4_unified": "gemma4_unified_text",
    "gemma4_unified_assistant": "gemma4_unified_text", "llama4": "llama4_text", "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text", "qwen4_exp": "qwen4_exp_text", "dots3_note": "dots3_note_text",
    "qwen2_5_vl": "qwen2_5_vl",
}


@dataclass(frozen=True)
class Override:
    """Config values one family needs on top of the generic shrink, and why."""

    values: dict = field(default_factory=dict)
    reason: str = ""
    # Not built at all: why (the matrix records it as refused with this reason).
    refused: str = ""


# model_type -> what its tiny config needs beyond the generic shrink (each with its reason).
OVERRIDES: dict[str, Override] = {
    "bamba": Override(dict(num_hidden_layers=2, attn_layer_indices=[1]), "the default has no attention layer"),
    "granitemoehybrid": Override(dict(layer_types=["mamba", "attention"]), "the default has no attention layer"),
    "jamba": Override(dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                           expert_layer_offset=1),
                      "a Mamba layer with a dense MLP and an attention layer with experts"),
    "cohere_compass_text": Override(dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}),
        "rope parameters per layer type, which the default leaves empty (does not build)"),
    "dbrx": Override(dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0), n_layers=1, max_seq_len=64,
                          ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
                     "the default attention sub-config has no rope_theta (does not build); sizes live in sub-configs"),
    "dots1": Override(dict(n_routed_experts=4, n_shared_experts=1),
                      "the default leaves the expert counts to the checkpoint (does not build)"),
    "ernie4_5_moe": Override(dict(moe_layer_start_index=0), "MoE starts at layer 1 by default; the tiny model has one"),
    "gemma3n_text": Override(dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                                  num_kv_shared_layers=2, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
                                  laurel_rank=4, activation_sparsity_pattern=[0.0] * 4),
                             "four layers: two compute keys / values, two reuse them (KV sharing needs both kinds)"),
    "gemma4_assistant": Override(refused="a speculative-decoding draft model whose default config is invalid "
                                         "(hidden_size_per_layer_input must be 0; does not build)"),
    "gpt_neo": Override(dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=WINDOW),
                        "its layer kinds are a run-length list"),
    "lfm2": Override(dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
                     "the default has no convolution layer"),
    "lfm2_moe": Override(dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
                         "the default leaves the layer kinds to the checkpoint (does not build)"),
    "longcat_flash": Override(dict(ffn_hidden_size=64, expert_ffn_hidden_size=32, zero_expert_num=2),
                              "its dense MLPs and zero experts are sized by their own keys"),
    "reformer": Override(refused="ReformerModelWithLMHead does not dispatch attention through transformers' "
                                 "AttentionInterface: LSH and local chunked attention of its own (and training "
                                 "needs the sequence length to equal its axial position shape)"),
    "xlm": Override(dict(emb_dim=32, n_layers=1, n_heads=4), "sized by its own keys (600M parameters by default)"),
    "zaya": Override(dict(num_experts_per_tok=1), "one expert per token is all it supports"),
    "blt": Override(refused="byte latent transformer: local byte encoder / decoder cross-attending to patches of a "
                            "global model (not one causal decoder); its default config does not shrink (GBs to build)"),
}


# Multimodal families outside the causal-LM mapping, measured through their own class's text path.
EXTRA_FAMILIES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def causal_lm_types() -> dict[str, str]:
    """transformers' causal-LM mapping: model_type -> model class name (this version's),
    plus :data:`EXTRA_FAMILIES`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {**MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **EXTRA_FAMILIES}


def config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def category(model_type: str) -> str:
    """What kind of model the type is (:data:`CATEGORIES`): the sets above, else its config
    class (a text sub-config: multimodal; ``is_encoder_decoder``: a seq2seq decoder half)."""
    if model_type in EXTRA_FAMILIES:
        return "decoder"  # measured on its text path like a decoder family
    if model_type in _ATTENTION_FREE:
        return "attention_free"
    if model_type in _ENCODERS:
        return "encoder"
    if model_type in _DECODER_HALVES:
        return "encoder_decoder"
    cls = config_class(model_type)
    if model_type in _MULTIMODAL or "text_config" in (getattr(cls, "sub_configs", None) or {}) and \
            model_type not in _DRAFT_MODELS:
        return "multimodal"
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if getattr(fields.get("is_encoder_decoder"), "default", False) is True:
        return "encoder_decoder"
    return "decoder"


def _get(config, key: str, default=None):
    """``config.key``, or ``default`` where the config has none or declares it per layer."""
    try:
        return getattr(config, key, default)
    except Exception:  # transformers raises its own error for per-layer attributes
        return default


def _init_keys(cls) -> set[str]:
    import inspect

    return {k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "kwargs")}


def _per_layer_lists(config, layers: int) -> dict[str, list]:
    """Config attributes holding one entry per layer."""
    out = {}
    for key, value in vars(config).items():  # noqa: B007
        if isinstance(value, (list, tuple)) and len(value) == layers and layers > 1 and not key.startswith("_") \
                and key not in _INDEX_LISTS:
            out[key] = list(value)
    return out


def _kept_layers(lists: dict[str, list], layers: int) -> list[int]:
    """One layer of each distinct combination of the per-layer lists, in order, at most MAX_LAYERS."""
    seen, kept = set(), []
    for i in range(layers):
        kind = tuple(repr(v[i]) for v in lists.values())
        if kind not in seen:
            seen.add(kind)
            kept.append(i)
    return kept[:MAX_LAYERS]


def shrink_config(config, **overrides):
    """A tiny config of ``config``'s class keeping its kinds of layers and patterns (see the module doc).

    ``config``: a text config (the family's default, or a user's config for the
    check at start). ``overrides`` win over everything.
    """
    cls = type(config)
    keys = _init_keys(cls)
    new = {}
    for key in keys:
        old = _get(config, key)
        if key in TINY:
            if key in ("q_lora_rank",):
                continue
            if old is None and key not in ("num_key_value_heads", "head_dim", "use_mamba_kernels"):
                continue  # an optional feature the family leaves off stays off
            new[key] = TINY[key]
        elif any(w in key for w in _NOISE_WORDS) and isinstance(old, (int, float)) and not isinstance(old, bool):
            new[key] = 0.0 if isinstance(old, float) else 0
    if "q_lora_rank" in keys and _get(config, "q_lora_rank", None):
        new["q_lora_rank"] = 16
    if _get(config, "kv_lora_rank", None):
        new["num_key_value_heads"] = TINY["num_attention_heads"]  # MLA expands its latent into every head
        if "head_dim" in keys:
            new["head_dim"] = TINY["qk_rope_head_dim"]  # MLA's rotary dims
    for key in ("sliding_window", "attention_chunk_size", "sliding_window_size"):
        if key in keys and _get(config, key, None):
            new[key] = WINDOW
    if "attn_logit_softcapping" in keys and _get(config, "attn_logit_softcapping", None):
        new["attn_logit_softcapping"] = SOFTCAP
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if key in keys and _get(config, key, None) is not None:
            new[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    # Layers: one of each kind the config lays out.
    for key in ("n_layer", "num_layers", "n_layers"):  # older spellings of the depth
        if key in keys and "num_hidden_layers" not in keys and isinstance(_get(config, key, None), int):
            new[key] = 1
    layers = _get(config, "num_hidden_layers", None)
    if "num_hidden_layers" in keys and isinstance(layers, int):
        lists = {k: v for k, v in _per_layer_lists(config, layers).items() if k in keys}
        kept = _kept_layers(lists, layers) if lists else [0]
        new["num_hidden_layers"] = len(kept)
        for key, value in lists.items():
            new[key] = [value[i] for i in kept]
        for key in _INDEX_LISTS:
            old = _get(config, key, None)
            if key in keys and isinstance(old, (list, tuple)):
                new[key] = [j for j, i in enumerate(kept) if i in old]
        if "first_k_dense_replace" in keys:
            new["first_k_dense_replace"] = 0
    new.update(overrides)
    experts = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if any(new.get(k) for k in experts) and "num_experts_per_tok" in keys and new.get("num_experts_per_tok") is None:
        new["num_experts_per_tok"] = TINY["num_experts_per_tok"]  # some MoE defaults leave it to the checkpoint
    if "layer_types" in overrides and "num_hidden_layers" not in overrides:
        new["num_hidden_layers"] = len(overrides["layer_types"])
    return cls(**new)


def tiny_config(model_type: str):
    """The matrix's tiny config of ``model_type`` (its default config shrunk, plus :data:`OVERRIDES`)."""
    cls = config_class(model_type)
    if model_type == "qwen2_5_vl":
        return _tiny_qwen2_5_vl(cls)
    return shrink_config(cls(), **OVERRIDES.get(model_type, Override()).values)


def _tiny_qwen2_5_vl(cls):
    """Qwen2.5-VL: a tiny text decoder whose multimodal rope sections cover a head dim of 8, and a
    one-block vision tower (left as it is: the text path is what runs under SP)."""
    text = shrink_config(cls.sub_configs["text_config"](), rope_parameters={
        "rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0})
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, window_size=4, fullatt_block_indexes=[0], spatial_merge_size=1)
    return cls(text_config=text.to_dict(), vision_config=vision, image_token_id=60, video_token_id=61,
               vision_start_token_id=62)


def tiny_model(config, seed: int = 0, attn_implementation: str = "eager", noise: bool = True):
    """transformers' causal LM of ``config`` in fp32 (on the default device), seeded; with
    ``noise`` every parameter its init left constant (norm weights, biases, sinks, gates)
    gets noise, so that no gradient path is dead and every pattern weighs in."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if config.model_type in EXTRA_FAMILIES:
        import transformers

        cls = getattr(transformers, EXTRA_FAMILIES[config.model_type])
        model = cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    if not noise:
        return model
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.reshape(-1)[0]).all()) or p.numel() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))
    return model
