"""The prepared token store: its on-disk format, its reader, its checks.

``python -m ulysses_dtensor.prepare_data`` (:mod:`.prepare`) writes it once;
training memory-maps it. Format version 1, a directory::

    manifest.json        what the store holds (below); written last
    documents.npy        int64 [N + 1]: document i is tokens [off[i], off[i+1])
                         of the shards laid end to end (numpy .npy, memory-mapped)
    shard-00000.tokens   the token ids of consecutive documents, raw
                         little-endian ``token_dtype`` (uint16 for vocabularies
                         up to 65,536, else uint32), each document
                         [BOS] ... [EOS] as the tokenizer encodes it
    shard-00000.targets  optional, uint8 per token: 1 = a training target,
                         0 = context only (its label is ignored); present for
                         every shard iff ``manifest["targets"]`` is true
    ...

``manifest.json``: ``format`` ("ulysses_dtensor.token_store"), ``version`` (1),
``tokenizer`` (:func:`~.tokenizer.tokenizer_identity`: name, sha256 of the
tokenizer file, vocab_size, bos_id, eos_id), ``token_dtype``, ``documents``,
``tokens``, ``targets``, ``shards`` (per shard: ``file``, ``documents``,
``tokens``, ``first_document``, ``first_token``, ``inputs``: the input files
and the byte / row-group range it came from), ``inputs`` (the files with their
sizes), ``text_key``, ``length_histogram`` (documents and tokens per
power-of-two length bin) and ``created_by``.

Opening costs nothing that grows with the tokens: the manifest is parsed, the
document index and the shards are memory-mapped on first use (the token stream
then reads one index entry per 8,192 documents for its epoch order), and a read
touches only the pages of the tokens it returns. :meth:`TokenStore.check` looks
at the manifest, the tokenizer and the files' sizes, never at the tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .errors import DataError
from .token_docs import TokenDocs

__all__ = ["TokenStore", "is_store", "STORE_FORMAT", "STORE_VERSION", "MANIFEST", "INDEX_FILE",
           "shard_name", "targets_name", "length_histogram"]

STORE_FORMAT = "ulysses_dtensor.token_store"
STORE_VERSION = 1
MANIFEST = "manifest.json"
INDEX_FILE = "documents.npy"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.tokens"


def targets_name(i: int) -> str:
    return f"shard-{i:05d}.targets"


def is_store(path: str | os.PathLike) -> bool:
    """``path`` is a directory holding a store manifest."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def length_histogram(lengths: np.ndarray) -> dict:
    """{"bins": [lo, ...], "documents": [...], "tokens": [...]}: bin b holds lengths in
    [2^b, 2^(b+1)) (bin 0 also holds 0)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bins = np.zeros(len(lengths), dtype=np.int64)
    pos = lengths > 0
    bins[pos] = np.floor(np.log2(lengths[pos])).astype(np.int64)
    n = int(bins.max()) + 1 if len(bins) else 0
    return {
        "bins": [1 << b for b in range(n)],
        "documents": np.bincount(bins, minlength=n).tolist(),
        "tokens": np.bincount(bins, weights=lengths, minlength=n).astype(np.int64).tolist(),
    }


class TokenStore(TokenDocs):
    """A prepared store, read through memory maps (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise DataError(
                f"{mpath} does not exist: {self.path} is not a prepared token store (make one with "
                f"python -m ulysses_dtensor.prepare_data --input ... --output {self.path})"
            )
        raw = mpath.read_bytes()
        try:
            m = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{mpath} is not valid JSON ({e.msg}); prepare the store again") from None
        if not isinstance(m, dict) or m.get("format") != STORE_FORMAT:
            raise DataError(f"{mpath} is not a token store manifest (its format is "
                            f"{m.get('format') if isinstance(m, dict) else None!r}, expected {STORE_FORMAT!r})")
        if m.get("version") != STORE_VERSION:
            raise DataError(
                f"{mpath} is format version {m.get('version')!r}; this ulysses_dtensor reads version "
                f"{STORE_VERSION}: prepare the store again with this version's python -m "
                f"ulysses_dtensor.prepare_data"
            )
        self.manifest = m
        self.dtype = np.dtype(m["token_dtype"])
        self.has_targets = bool(m.get("targets", False))
        self._n = int(m["documents"])
        self._total = int(m["tokens"])
        shards = m["shards"]
        self._first_doc = np.array([s["first_document"] for s in shards], dtype=np.int64)
        self._first_tok = np.array([s["first_token"] for s in shards], dtype=np.int64)
        self._digest = hashlib.sha256(raw).hexdigest()[:16]
        self._index: np.ndarray | None = None
        self._maps: dict[int, np.memmap] = {}
        self._target_maps: dict[int, np.memmap] = {}

    # ---------------------------------------------------------------- checks
    def check(self, tokenizer=None, *, what: str | None = None) -> None:
        """The manifest suits ``tokenizer`` and every file has the size it says (DataError)."""
        from .tokenizer import tokenizer_identity

        what = what or f"{self.path}"
        m = self.manifest
        if tokenizer is not None:
            have, want = m["tokenizer"], tokenizer_identity(tokenizer)
            if any(have.get(k) != want[k] for k in ("sha256", "vocab_size", "bos_id", "eos_id")):
                raise DataError(
                    f"{what}: the store was tokenized with {_describe_tok(have)} ({self.path / MANIFEST}), "
                    f"this run uses {_describe_tok(want)}: prepare the store with this tokenizer "
                    f"(python -m ulysses_dtensor.prepare_data --tokenizer ...), or train with the store's"
                )
        if self._n < 1:
            raise DataError(f"{what}: the store {self.path} has no documents")
        index = self.path / INDEX_FILE
        try:
            arr = np.load(index, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"{what}: the document index {index} is missing or unreadable ({e}); "
                            f"prepare the store again") from None
        if arr.shape != (self._n + 1,) or int(arr[-1]) != self._total:
            raise DataError(
                f"{what}: the document index {index} has {arr.shape[0]} entries ending at token "
                f"{int(arr[-1]) if arr.shape[0] else 0}, the manifest says {self._n + 1} ending at "
                f"{self._total}; prepare the store again"
            )
        for i, s in enumerate(m["shards"]):
            files = [(self.path / s["file"], s["tokens"] * self.dtype.itemsize)]
            if self.has_targets:
                files.append((self.path / targets_name(i), s["tokens"]))
            for f, size in files:
                if not f.is_file():
                    raise DataError(f"{what}: shard {f} is missing (the manifest lists it with "
                                    f"{s['tokens']:,} tokens); prepare the store again")
                if f.stat().st_size != size:
                    raise DataError(
                        f"{what}: shard {f} has {f.stat().st_size:,} bytes, expected {size:,} "
                        f"({s['tokens']:,} tokens); it is truncated or from another store: prepare "
                        f"the store again"
                    )

    # ---------------------------------------------------------------- access
    def __len__(self) -> int:
        return self._n

    def _offsets(self) -> np.ndarray:
        if self._index is None:
            self._index = np.load(self.path / INDEX_FILE, mmap_mode="r")
        return self._index

    def cum_tokens(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self._offsets()[np.asarray(ids, dtype=np.int64)], dtype=np.int64)

    def total_tokens(self) -> int:
        return self._total

    def _shard(self, i: int) -> int:
        return int(np.searchsorted(self._first_doc, i, side="right")) - 1

    def _map(self, s: int, targets: bool = False) -> np.memmap:
        maps = self._target_maps if targets else self._maps
        if s not in maps:
            name = targets_name(s) if targets else self.manifest["shards"][s]["file"]
            dtype = np.uint8 if targets else self.dtype
            if self.manifest["shards"][s]["tokens"] == 0:
                maps[s] = np.zeros(0, dtype=dtype)
            else:
                maps[s] = np.memmap(self.path / name, dtype=dtype, mode="r")
        return maps[s]

    def _span(self, i: int, start: int, stop: int) -> tuple[int, int, int]:
        s = self._shard(i)
        off = self._offsets()
        begin, end = int(off[i]), int(off[i + 1])
        stop = min(stop, end - begin)
        base = begin - int(self._first_tok[s])
        return s, base + start, base + stop

    def tokens(self, i: int, start: int, stop: int) -> np.ndarray:
        s, a, b = self._span(int(i), start, stop)
        return self._map(s)[a:b].astype(np.int64)

    def targets(self, i: int, start: int, stop: int):
        if not self.has_targets:
            return None
        s, a, b = self._span(int(i), start, stop)
        return np.array(self._map(s, targets=True)[a:b])

    def fingerprint(self) -> str:
        return f"store:{self._digest}:{self._n}:{self._total}"

    def describe(self) -> str:
        tok = self.manifest["tokenizer"]
        return (f"prepared store {self.path}: {self._n:,} documents, {self._total:,} tokens "
                f"({self.dtype.name}, tokenizer {tok['name']})"
                + (", with target masks" if self.has_targets else ""))


def _describe_tok(identity: dict) -> str:
    return (f"{identity.get('name')!r} (vocab {identity.get('vocab_size')}, sha256 "
            f"{str(identity.get('sha256'))[:12]})")
