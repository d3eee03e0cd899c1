"""Create a tiny random Hugging Face model directory, with a tokenizer, offline.

    python scripts/make_tiny_hf_model.py --out outputs/tiny_hf_llama [--family llama]

Writes what ``save_pretrained`` writes (config.json, model.safetensors) plus a
byte-level BPE ``tokenizer.json`` trained on the built-in corpus (the Python
standard library's sources) and a ``tokenizer_config.json``, so that the
trainer (``model.hf_path``) and ``transformers`` both load it. Nothing is
downloaded. Families this package's Llama loads: llama (llama3 rope scaling),
qwen2 (q/k/v bias, tied embeddings), qwen3 (q/k norm, head_dim != hidden/heads),
mistral. Families the trainer runs with transformers' own model
(``model.implementation``): qwen3_moe (4 experts, 2 per token), mixtral,
granite (logit, embedding and residual multipliers), olmo2 (post-norms, q/k norm).

Needs ``pip install 'ulysses-dtensor[hf]'``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # load into this package's Llama
TRANSFORMERS_FAMILIES = ("qwen3_moe", "mixtral", "granite", "olmo2")  # trained as transformers models


def hf_config(family: str, *, vocab_size: int = 512, dim: int = 64, layers: int = 2, heads: int = 8,
              kv_heads: int = 4, ffn_dim: int = 96, init_std: float = 0.02):
    """A transformers config of ``family`` at a tiny size, exercising its special features."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size, hidden_size=dim, intermediate_size=ffn_dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, initializer_range=init_std,
        rms_norm_eps=1e-5, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
    )
    if family == "llama":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**common, rope_parameters={"rope_theta": 10000.0, **scaling})
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=2 * dim // heads,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    experts = dict(num_experts_per_tok=2, router_aux_loss_coef=0.01, output_router_logits=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=2 * dim // heads, num_experts=4, moe_intermediate_size=ffn_dim // 2,
                                 norm_topk_prob=True, **experts,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, sliding_window=None, **experts,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "granite":
        return tf.GraniteConfig(**common, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0,
                                attention_multiplier=1.0 / (dim // heads), tie_word_embeddings=True)
    if family == "olmo2":
        return tf.Olmo2Config(**common, pad_token_id=1)
    raise ValueError(f"family={family!r}; valid: {', '.join(FAMILIES + TRANSFORMERS_FAMILIES)}")


def hf_model(config, seed: int = 0, perturb: float = 0.0):
    """A random ``AutoModelForCausalLM`` of ``config`` in fp32; ``perturb`` adds noise of that
    std to the norm weights and biases (which init sets to 1 and 0) so that they matter."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * perturb)
    return model


def train_tokenizer(vocab_size: int = 512, max_bytes: int = 1 << 20):
    """A byte-level BPE tokenizer (``tokenizers``) trained on the stdlib corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ulysses_dtensor.data import StdlibCorpus

    corpus = StdlibCorpus(max_bytes=max_bytes)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((corpus[i] for i in range(len(corpus))), trainer)
    return tok


def save_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}, indent=1))


def make_tiny_hf_model(out: str | os.PathLike, family: str = "llama", *, tokenizer: bool = True,
                       seed: int = 0, perturb: float = 0.0, max_shard_size: str | None = None, **shape):
    """Write a tiny ``family`` model (and, if asked, a tokenizer) to ``out``; return the model."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = hf_model(hf_config(family, **shape), seed=seed, perturb=perturb)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    if tokenizer:
        save_tokenizer(train_tokenizer(model.config.vocab_size), out)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--family", default="llama", choices=FAMILIES + TRANSFORMERS_FAMILIES)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    make_tiny_hf_model(a.out, a.family, seed=a.seed, vocab_size=a.vocab_size, dim=a.dim, layers=a.layers)
    print(f"wrote a tiny {a.family} model with its tokenizer to {a.out}")


if __name__ == "__main__":
    main()
