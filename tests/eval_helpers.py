"""Shared by the evaluation tests: a small HF tokenizer built offline, held-out files."""

from __future__ import annotations

import json
from pathlib import Path

from ulysses_dtensor.evaluation.tasks import _ADJECTIVES, _INSTRUCTIONS, _NOUNS, FILLER

# Held-out documents: different lengths, so loss rows hold document boundaries.
HELD_OUT_DOCS = [
    "def add(a, b):\n    return a + b\n" * 3,
    "The quick brown fox jumps over the lazy dog. " * 9,
    "x = 1\n",
    "Special magic numbers and pass keys are easy to remember. " * 5,
    "for i in range(10):\n    print(i * i)\n" * 4,
    "VAR ABCDE = 12345. The sky is blue. " * 7,
]


def build_bpe_tokenizer(path: Path) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained here on the task texts (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [FILLER * 4, *(_INSTRUCTIONS.values()), *HELD_OUT_DOCS,
              " ".join(f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS[:3]),
              "The pass key is 12345. Remember it. What is the special magic number for VAR = "
              "Question: which variables are assigned the value Answer: the variables"]
    tok.train_from_iterator(corpus, trainer)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def write_held_out(path: Path) -> Path:
    out = path / "held_out.jsonl"
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in HELD_OUT_DOCS))
    return out
