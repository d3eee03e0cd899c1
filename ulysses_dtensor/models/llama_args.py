"""The shape of a Llama-3-style model: :class:`LlamaArgs`, the named :data:`FLAVORS`, and
:func:`llama_args` (a flavor with fields replaced). Checked when made: a bad field fails
here with the valid values, before any module is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..attention import check_backend
from ..runtime.suggest import unknown_name
from .rope import LLAMA31_ROPE, ROPE_LAYOUTS, RopeConfig

__all__ = ["FLAVORS", "LlamaArgs", "llama_args"]


@dataclass
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    # The rope the model starts with (any transformers rope type; models/rope.py).
    # Llama 3.1's llama3 scaling by default; the tied Llama 3.2 1B/3B use factor 32.
    # A run may change it per context stage (Llama.set_rope); weights do not depend on it.
    rope: RopeConfig = LLAMA31_ROPE
    tie_embeddings: bool = False
    attn_backend: str = "auto"
    # Which q/k dims rope rotates together: "interleaved" pairs (2i, 2i+1)
    # (Meta's layout, our flavors) or "half" pairs (i, i + head_dim/2) (the
    # rotate-half layout of Hugging Face checkpoints, loaded unpermuted).
    rope_layout: str = "interleaved"
    # Width of one attention head; 0: dim // n_heads. Qwen3 and Mistral-Nemo
    # set their own (n_heads * head_dim != dim).
    explicit_head_dim: int = 0
    qkv_bias: bool = False  # bias on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head over head_dim, before rope (Qwen3)

    def __post_init__(self) -> None:
        check_backend(self.attn_backend)
        if isinstance(self.rope, dict):  # from dataclasses.asdict / model.json
            self.rope = RopeConfig.from_dict(self.rope)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaArgs.{name}={value!r} must be an integer >= 1")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(
                f"LlamaArgs.rope_layout={self.rope_layout!r}; valid: {', '.join(ROPE_LAYOUTS)}"
            )
        if not isinstance(self.explicit_head_dim, int) or self.explicit_head_dim < 0:
            raise ValueError(
                f"LlamaArgs.explicit_head_dim={self.explicit_head_dim!r} must be an integer "
                ">= 0 (0: dim // n_heads)"
            )
        if not self.explicit_head_dim and self.dim % self.n_heads:
            raise ValueError(
                f"LlamaArgs.dim={self.dim} must be divisible by n_heads={self.n_heads} "
                "(or set explicit_head_dim)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim = {self.head_dim} must be even for rope")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaArgs.n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads} (GQA)"
            )
        self.rope.check_head_dim(self.head_dim, "LlamaArgs.rope")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @classmethod
    def from_dict(cls, d: dict) -> LlamaArgs:
        """From ``dataclasses.asdict`` (a checkpoint's model.json), including those
        written before ``rope`` replaced the llama3-only fields."""
        d = dict(d)
        legacy = {k: d.pop(k) for k in _LEGACY_ROPE_FIELDS if k in d}
        if legacy and "rope" not in d:
            theta = float(legacy.get("rope_theta", 500000.0))
            d["rope"] = RopeConfig(theta=theta) if not legacy.get("rope_scaling", True) else RopeConfig(
                rope_type="llama3", theta=theta, factor=float(legacy.get("rope_scaling_factor", 8.0)),
                low_freq_factor=float(legacy.get("rope_low_freq_factor", 1.0)),
                high_freq_factor=float(legacy.get("rope_high_freq_factor", 4.0)),
                original_max_position_embeddings=int(legacy.get("rope_original_max_len", 8192)))
        return cls(**d)


# LlamaArgs fields of checkpoints saved before LlamaArgs.rope (llama3 rope or none).
_LEGACY_ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor",
                       "rope_high_freq_factor", "rope_original_max_len")


FLAVORS: dict[str, LlamaArgs] = {
    # Tiny: trains on CPU in tests. head_dim 8, GQA 2:1.
    "debug": LlamaArgs(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_dim=192
    ),
    # kv heads 2 < sp 4 or 8: exercises kv-head replication in Ulysses.
    "debug_gqa": LlamaArgs(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=512, ffn_dim=192
    ),
    # Llama 3.2 1B / 3B (tied embeddings, rope scaling factor 32).
    "llama3_1b": LlamaArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
        tie_embeddings=True, rope=dataclasses.replace(LLAMA31_ROPE, factor=32.0),
    ),
    "llama3_3b": LlamaArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
        tie_embeddings=True, rope=dataclasses.replace(LLAMA31_ROPE, factor=32.0),
    ),
    # Llama 3.1 8B / 70B.
    "llama3_8b": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336
    ),
    "llama3_70b": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672
    ),
}


def llama_args(flavor: str, **overrides) -> LlamaArgs:
    """The args of a named flavor, with fields replaced by ``overrides``."""
    if flavor not in FLAVORS:
        raise ValueError(_unknown("model flavor", flavor, FLAVORS))
    fields = {f.name for f in dataclasses.fields(LlamaArgs)}
    for key in overrides:
        if key not in fields:
            raise ValueError(_unknown(f"LlamaArgs field (override for {flavor!r})", key, fields))
    return dataclasses.replace(FLAVORS[flavor], **overrides)


def _unknown(what: str, name, valid) -> str:
    return unknown_name(what, name, sorted(valid))
