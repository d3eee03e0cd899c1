"""Starting a run from a Hugging Face model directory (``model.hf_path``).

With ``hf_path`` the model's shapes, vocabulary and starting rope (context
stages may change it: ``rope_stages.py``) come from ``DIR/config.json`` and
its weights from ``DIR/*.safetensors`` (loaded after parallelize +
``to_empty``, in place of ``init_weights``; a resumed run takes them from its
own checkpoint instead). The tokenizer is ``DIR/tokenizer.json``
unless ``data.tokenizer`` is given. The [model] keys that then have no effect
are checked like every such key (``config_effects.EFFECT_RULES``): an error when
the user set them in the same or a later source than ``hf_path``.
"""

from __future__ import annotations

from pathlib import Path

from .config_schema import SOURCE_DEFAULT, ConfigError

__all__ = [
    "HF_IGNORED_MODEL_KEYS",
    "hf_model_args",
    "check_hf_weights",
    "hf_source_config",
    "tokenizer_spec",
]

# [model] keys that have no effect when the model comes from hf_path.
HF_IGNORED_MODEL_KEYS = (
    "flavor", "vocab_size", "vocab_multiple_of", "dim", "n_layers", "n_heads", "n_kv_heads",
    "ffn_dim", "rope_theta",
)


def hf_source_config(cfg) -> dict:
    """The parsed ``hf_path/config.json`` (ConfigError if it cannot be read)."""
    from ..models.llama_checkpoint import HFCheckpointError, read_hf_config

    try:
        return read_hf_config(cfg.model.hf_path)
    except HFCheckpointError as e:
        raise ConfigError(str(e)) from None


def hf_model_args(cfg):
    """LlamaArgs from ``hf_path/config.json``, or a ConfigError naming what is unsupported."""
    from ..models.llama_checkpoint import HFCheckpointError, args_from_hf_config

    where = f"model.hf_path={cfg.model.hf_path!r}: config.json"
    try:
        return args_from_hf_config(hf_source_config(cfg), attn_backend=cfg.model.attn_backend, where=where)
    except HFCheckpointError as e:
        raise ConfigError(str(e)) from None


def check_hf_weights(cfg) -> None:
    """``hf_path`` holds safetensors weights (their names are checked at load); the memory
    planner, which needs config.json only, skips this."""
    from ..models.llama_checkpoint import HFCheckpointError, safetensors_files

    try:
        safetensors_files(cfg.model.hf_path)
    except HFCheckpointError as e:
        raise ConfigError(str(e)) from None


def tokenizer_spec(cfg) -> str:
    """``data.tokenizer``, or ``hf_path/tokenizer.json`` when that exists and
    ``data.tokenizer`` was left at its default."""
    d = cfg.data
    explicit = cfg.source_of("data.tokenizer") != SOURCE_DEFAULT or d.tokenizer != "byte"
    if cfg.model.hf_path and not explicit:
        tok = Path(cfg.model.hf_path) / "tokenizer.json"
        if tok.is_file():
            return str(tok)
    return d.tokenizer
