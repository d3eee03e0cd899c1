"""Tokenizers: UTF-8 bytes, or a Hugging Face ``tokenizer.json`` (no downloads).

Every document is encoded as ``[BOS] tokens [EOS]`` with the specials the
tokenizer has. :func:`tokenizer_identity` names a tokenizer by what decides its
output (the bytes of its ``tokenizer.json``, vocabulary size, specials): a
prepared token store records it, and a run with another tokenizer is refused.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "padded_vocab_size",
    "tokenizer_identity",
    "token_dtype",
    "TOKENIZERS_EXTRA_MSG",
]

TOKENIZERS_EXTRA_MSG = (
    "data.tokenizer={path!r} is an HF tokenizer.json, which needs the optional "
    "'tokenizers' package: pip install 'ulysses-dtensor[tokenizers]'"
)


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus BOS (256) and EOS (257)."""

    name = "byte"

    def __init__(self):
        self.bos_id = 256
        self.eos_id = 257
        self.vocab_size = 258

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray:
        body = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
        out = np.empty(len(body) + bos + eos, dtype=np.int64)
        out[bos : bos + len(body)] = body
        if bos:
            out[0] = self.bos_id
        if eos:
            out[-1] = self.eos_id
        return out

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (needs the optional ``tokenizers`` package)."""

    _BOS = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]", "<|startoftext|>")
    _EOS = ("<|end_of_text|>", "</s>", "<eos>", "[SEP]", "<|endoftext|>", "<|im_end|>")

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(TOKENIZERS_EXTRA_MSG.format(path=str(path))) from None
        self.name = str(path)
        self.path = Path(path)
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._first_id(self._BOS)
        self.eos_id = self._first_id(self._EOS)

    def _first_id(self, names) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def _wrap(self, ids: list[int]) -> np.ndarray:
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else []
        return np.asarray(head + ids + tail, dtype=np.int64)

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return np.asarray(head + ids + tail, dtype=np.int64)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text, in one call into the library (less Python per text)."""
        return [self._wrap(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``text``'s ids as written (special tokens in it parsed, none added) and each
        token's first character (chat rendering maps character spans to tokens)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return (np.asarray(enc.ids, dtype=np.int64),
                np.asarray([s for s, _ in enc.offsets], dtype=np.int64).reshape(-1))

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(spec: str):
    """``"byte"`` or the path of an HF tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


def padded_vocab_size(tokenizer_vocab: int, multiple_of: int = 64) -> int:
    """The model's vocabulary: the tokenizer's rounded up to ``multiple_of``."""
    return -(-tokenizer_vocab // multiple_of) * multiple_of


def tokenizer_identity(tokenizer) -> dict:
    """What decides the token ids: kind, a hash of the tokenizer file, vocabulary, specials."""
    if isinstance(tokenizer, ByteTokenizer):
        digest = "byte"
    else:
        digest = hashlib.sha256(Path(tokenizer.path).read_bytes()).hexdigest()
    return {
        "name": "byte" if digest == "byte" else Path(tokenizer.name).name,
        "sha256": digest,
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
    }


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id: uint16 up to 65,536 tokens."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)
