"""The model's shape a config describes: this package's Llama args (a flavor and its
overrides, or a Hugging Face checkpoint's config.json), or a transformers model's
``CausalLMShape``. Read by the checks, the mesh fitting and the planner."""

from __future__ import annotations

from ..runtime.suggest import did_you_mean
from .config_schema import ConfigError, JobConfig
from .hf_start import hf_model_args

__all__ = ["model_args"]


def model_args(cfg: JobConfig, vocab_size: int):
    """The LlamaArgs for this config (flavor + overrides, or model.hf_path's
    config.json, whose vocabulary wins over ``vocab_size``; with the transformers
    implementation the model's ``CausalLMShape``), or a ConfigError."""
    if cfg.model.hf_path:
        from .hf_model import transformers_args, uses_transformers

        return transformers_args(cfg) if uses_transformers(cfg) else hf_model_args(cfg)
    from ..models.llama import FLAVORS, llama_args

    m = cfg.model
    if m.flavor not in FLAVORS:
        raise ConfigError(
            f"model.flavor={m.flavor!r} is unknown{did_you_mean(m.flavor, FLAVORS, cutoff=0.5)}; "
            f"valid: {', '.join(FLAVORS)}"
        )
    overrides = {
        k: getattr(m, k)
        for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
        if getattr(m, k)
    }
    if m.rope_theta:  # the base of the flavor's own rope type
        overrides["rope"] = FLAVORS[m.flavor].rope.with_theta(m.rope_theta)
    try:
        return llama_args(m.flavor, vocab_size=vocab_size, attn_backend=m.attn_backend, **overrides)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.flavor={m.flavor!r} with overrides {overrides}: {e}") from None
