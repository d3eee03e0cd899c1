"""Tokenized documents with random access: what the token stream reads.

A :class:`TokenDocs` is ``len(docs)`` documents, the number of tokens before
any document (``cum_tokens(ids)``, vectorised: lengths and block totals come
from it without reading tokens), and the tokens of a span of one document.

* :class:`~.store.TokenStore`: a prepared store, memory-mapped (no tokenization).
* :class:`TokenizedSource`: a text :class:`~.sources.DocumentSource` tokenized on
  demand. Its length index (one int64 per document) costs one tokenization of
  the corpus, once per run, shared out over the ranks (:meth:`~TokenizedSource.build_index`);
  after it a rank tokenizes only the documents of its own rows.
* :class:`Upsampled`: documents longer than a threshold repeated in every epoch.
* :class:`TokenSubset`: some documents of another, in a given order (held-out splits).
"""

from __future__ import annotations

import numpy as np


__all__ = ["TokenDocs", "TokenizedSource", "Upsampled", "TokenSubset", "as_token_docs", "is_token_docs"]


class TokenDocs:
    """Tokenized documents: subclasses give ``__len__``, ``cum_tokens``, ``tokens``."""

    has_targets = False

    def __len__(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def cum_tokens(self, ids: np.ndarray) -> np.ndarray:  # pragma: no cover - interface
        """Tokens in documents ``[0, i)`` for each ``i`` of ``ids`` (int64; ``0 <= i <= len``)."""
        raise NotImplementedError

    def tokens(self, i: int, start: int, stop: int) -> np.ndarray:  # pragma: no cover - interface
        """Tokens ``[start, stop)`` of document ``i`` (int64)."""
        raise NotImplementedError

    def targets(self, i: int, start: int, stop: int) -> np.ndarray | None:
        """Per-token target flags (uint8, 1: trained on) of that span, or None (all)."""
        return None

    def fingerprint(self) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def doc_key(self, i: int) -> str:
        return str(i)

    # ---------------------------------------------------------------- derived
    def lengths(self, lo: int, hi: int) -> np.ndarray:
        return np.diff(self.cum_tokens(np.arange(lo, hi + 1, dtype=np.int64)))

    def lengths_at(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        return self.cum_tokens(ids + 1) - self.cum_tokens(ids)

    def total_tokens(self) -> int:
        return int(self.cum_tokens(np.array([len(self)], dtype=np.int64))[0])


def is_token_docs(source) -> bool:
    return isinstance(source, TokenDocs)


def as_token_docs(source, tokenizer=None) -> TokenDocs:
    """``source`` itself if tokenized, else the text source tokenized with ``tokenizer``."""
    if isinstance(source, TokenDocs):
        return source
    if tokenizer is None:
        raise ValueError(f"{source.fingerprint()} holds text: give the tokenizer")
    return TokenizedSource(source, tokenizer)


class TokenizedSource(TokenDocs):
    """A text source tokenized on demand, with a length index built once."""

    def __init__(self, source, tokenizer):
        self.source = source
        self.tokenizer = tokenizer
        self._cum: np.ndarray | None = None
        self._cached: tuple[int, np.ndarray] | None = None  # the last document tokenized

    def __len__(self) -> int:
        return len(self.source)

    def _encode(self, i: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != i:
            self._cached = (i, self.tokenizer.encode(self.source[i]))
        return self._cached[1]

    def _count(self, i: int) -> int:
        return len(self.tokenizer.encode(self.source[i]))

    def build_index(self, rank: int = 0, world: int = 1, gather=None) -> None:
        """Count every document's tokens: this rank documents ``rank, rank + world, ...``.

        ``gather(local_lengths) -> list of every rank's`` joins the shares
        (``torch.distributed.all_gather_object`` in the trainer); without it
        ``world`` must be 1. Cost: one tokenization of the corpus, split over
        the ranks, and 8 bytes per document.
        """
        n = len(self)
        mine = np.array([self._count(i) for i in range(rank, n, world)], dtype=np.int64)
        shares = gather(mine) if gather is not None else [mine]
        if len(shares) != world:
            raise ValueError(f"build_index: {len(shares)} shares for a world of {world}")
        lengths = np.empty(n, dtype=np.int64)
        for r, share in enumerate(shares):
            lengths[r::world] = share
        self._cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def cum_tokens(self, ids: np.ndarray) -> np.ndarray:
        if self._cum is None:
            self.build_index()
        return self._cum[np.asarray(ids, dtype=np.int64)]

    def tokens(self, i: int, start: int, stop: int) -> np.ndarray:
        return self._encode(int(i))[start:stop]

    def fingerprint(self) -> str:
        return self.source.fingerprint()

    def doc_key(self, i: int) -> str:
        return self.source.doc_key(i)


class Upsampled(TokenDocs):
    """``docs`` plus extra copies of its documents longer than ``min_tokens``, so
    that each appears ``factor`` times per epoch (a fractional part: that share
    of them once more). Finding them reads every length once (vectorised, in
    chunks); the copies cost 8 bytes each."""

    _CHUNK = 1 << 20

    def __init__(self, docs: TokenDocs, min_tokens: int, factor: float):
        if factor < 1:
            raise ValueError(f"upsample_factor={factor} must be >= 1")
        self.base = docs
        self.min_tokens = int(min_tokens)
        self.factor = float(factor)
        n = len(docs)
        long_ids = [np.flatnonzero(docs.lengths(lo, min(lo + self._CHUNK, n)) > self.min_tokens) + lo
                    for lo in range(0, n, self._CHUNK)]
        self.long_ids = np.concatenate(long_ids) if long_ids else np.zeros(0, np.int64)
        extra = int(round((self.factor - 1.0) * len(self.long_ids)))
        self.extra_ids = np.resize(self.long_ids, extra).astype(np.int64) if extra else np.zeros(0, np.int64)
        self._n = n
        self._base_total = docs.total_tokens()
        self._extra_cum = np.concatenate([[0], np.cumsum(docs.lengths_at(self.extra_ids))]).astype(np.int64)
        self.has_targets = docs.has_targets

    def __len__(self) -> int:
        return self._n + len(self.extra_ids)

    def _base_id(self, i: int) -> int:
        return i if i < self._n else int(self.extra_ids[i - self._n])

    def cum_tokens(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty(ids.shape, dtype=np.int64)
        low = ids <= self._n
        out[low] = self.base.cum_tokens(ids[low])
        out[~low] = self._base_total + self._extra_cum[ids[~low] - self._n]
        return out

    def tokens(self, i: int, start: int, stop: int) -> np.ndarray:
        return self.base.tokens(self._base_id(i), start, stop)

    def targets(self, i: int, start: int, stop: int):
        return self.base.targets(self._base_id(i), start, stop)

    def fingerprint(self) -> str:
        return f"{self.base.fingerprint()}|upsample(>{self.min_tokens},x{self.factor:g})"

    def doc_key(self, i: int) -> str:
        return self.base.doc_key(self._base_id(i))

    def describe(self) -> str:
        return (f"{len(self.long_ids):,} documents > {self.min_tokens:,} tokens up-sampled "
                f"x{self.factor:g} (+{len(self.extra_ids):,} copies)")


class TokenSubset(TokenDocs):
    """The documents ``indices`` of ``base``, in that order (8 bytes per document
    for their token counts, computed on first use)."""

    def __init__(self, base: TokenDocs, indices, tag: str):
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.tag = tag
        self.has_targets = base.has_targets
        self._cum: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def cum_tokens(self, ids: np.ndarray) -> np.ndarray:
        if self._cum is None:
            self._cum = np.concatenate([[0], np.cumsum(self.base.lengths_at(self.indices))]).astype(np.int64)
        return self._cum[np.asarray(ids, dtype=np.int64)]

    def tokens(self, i: int, start: int, stop: int) -> np.ndarray:
        return self.base.tokens(int(self.indices[i]), start, stop)

    def targets(self, i: int, start: int, stop: int):
        return self.base.targets(int(self.indices[i]), start, stop)

    def doc_key(self, i: int) -> str:
        return self.base.doc_key(int(self.indices[i]))

    def fingerprint(self) -> str:
        return f"{self.tag}:{len(self.indices)}:{self.base.fingerprint()}"
