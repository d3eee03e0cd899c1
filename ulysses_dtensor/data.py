"""Tokenizers, document sources and packing into fixed-length training sequences.

Nothing here downloads anything.

Documents
    * ``path=""``: the built-in corpus, the Python standard library's own source
      files (``sysconfig.get_paths()["stdlib"]``): every ``*.py`` file in sorted
      path order, skipping test directories and site-packages, up to a size cap.
      Each file is one document. Real text that every Python installation has.
    * a ``.txt`` file: the whole file is ONE document;
    * a ``.jsonl`` file: one document per line, its ``{"text": ...}`` field;
    * a directory: every ``.txt`` / ``.jsonl`` file below it, in sorted order.

Token stream
    Each document is tokenized as ``[BOS] tokens [EOS]`` (the specials the
    tokenizer has). Documents follow each other in a fixed order per epoch (a
    seeded shuffle, or the listed order), epochs repeat forever: one
    deterministic global token stream, the same on every rank.

Packing
    A global batch of ``B`` sequences of ``S`` tokens takes the next ``B * S``
    tokens of the stream; sequence ``i`` is tokens ``[i*S, (i+1)*S)`` of it. No
    token is dropped, repeated or padded. A document cut by a sequence boundary
    continues at the start of the next sequence, where its positions restart at
    0 (the two parts are trained as two documents). ``position_ids`` restart at
    0 at every document start, which is how ``shard_batch`` finds documents.

Data parallelism
    Data-parallel rank ``r`` of ``dp`` takes the contiguous rows
    ``[r*B/dp, (r+1)*B/dp)`` of each global batch, so the global batch, and the
    token stream, are the same whatever the dp degree. All sp ranks of a group
    take the same rows. Every rank walks the whole global batch to keep its
    cursor in step, so the cursor (``state_dict()``) is global.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "padded_vocab_size",
    "DocumentSource",
    "StdlibCorpus",
    "FileCorpus",
    "build_source",
    "TokenStream",
    "PackedLoader",
    "DATA_SUFFIXES",
    "DataError",
    "TOKENIZERS_EXTRA_MSG",
    "data_files",
]

DATA_SUFFIXES = (".txt", ".jsonl")


class DataError(ValueError):
    """Unusable training data; the message names the file (and line) and what is wrong."""


TOKENIZERS_EXTRA_MSG = (
    "data.tokenizer={path!r} is an HF tokenizer.json, which needs the optional "
    "'tokenizers' package: pip install 'ulysses-dtensor[tokenizers]'"
)
_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idlelib"}


# --------------------------------------------------------------------------- #
# Tokenizers
# --------------------------------------------------------------------------- #


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

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return np.asarray(head + ids + tail, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(spec: str):
    """``"byte"`` or the path of an HF tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


def padded_vocab_size(tokenizer_vocab: int, multiple_of: int = 64) -> int:
    """The model's vocabulary: the tokenizer's rounded up to ``multiple_of``."""
    return -(-tokenizer_vocab // multiple_of) * multiple_of


# --------------------------------------------------------------------------- #
# Document sources (random access by index, so resuming needs no replay)
# --------------------------------------------------------------------------- #


class DocumentSource:
    """A fixed, ordered list of documents: ``len(src)`` and ``src[i] -> str``."""

    def __len__(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def __getitem__(self, i: int) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def fingerprint(self) -> str:
        return f"{type(self).__name__}:{len(self)}"

    def doc_key(self, i: int) -> str:
        """A name of document ``i`` that does not change when other documents are
        added or reordered (held-out splits are decided by it)."""
        return str(i)


class StdlibCorpus(DocumentSource):
    """The standard library's ``*.py`` files (sorted; tests and site-packages skipped)."""

    def __init__(self, max_bytes: int = 8 << 20, root: str | os.PathLike | None = None):
        root = Path(root or sysconfig.get_paths()["stdlib"])
        files, total = [], 0
        for f in _walk_py(root):
            try:
                size = f.stat().st_size
            except OSError:
                continue
            if total + size > max_bytes:
                if files:
                    break
                continue
            files.append(f)
            total += size
        if not files:
            raise RuntimeError(f"no Python source files found under {root}")
        self.root = root
        self.files = files
        self.total_bytes = total

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> str:
        return self.files[i].read_text(encoding="utf-8", errors="replace")

    def fingerprint(self) -> str:
        return f"stdlib:{len(self.files)}:{self.total_bytes}"

    def doc_key(self, i: int) -> str:
        return self.files[i].relative_to(self.root).as_posix()


def _walk_py(root: Path) -> list[Path]:
    """Sorted ``*.py`` paths under ``root``, not descending into skipped directories."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found)


def data_files(path: str | os.PathLike) -> list[Path]:
    """The data files of ``path``: itself, or the .txt/.jsonl files below it (sorted)."""
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES)


class FileCorpus(DocumentSource):
    """Local ``.txt`` (one document per file) and ``.jsonl`` (one per line) files."""

    def __init__(self, path: str | os.PathLike, text_key: str = "text"):
        self.text_key = text_key
        self.root = Path(path)
        # (file, byte offset or None for a whole .txt file)
        self.index: list[tuple[Path, int | None]] = []
        for f in data_files(path):
            if f.suffix == ".txt":
                self.index.append((f, None))
                continue
            offset = 0
            with open(f, "rb") as fh:
                for line in fh:
                    if line.strip():
                        self.index.append((f, offset))
                    offset += len(line)
        if not self.index:
            raise DataError(
                f"data.path={str(path)!r} holds no documents: its .jsonl files have no "
                f"non-blank line"
            )

    def __len__(self) -> int:
        return len(self.index)

    def doc_key(self, i: int) -> str:
        f, offset = self.index[i]
        name = f.name if self.root.is_file() else f.relative_to(self.root).as_posix()
        return name if offset is None else f"{name}@{offset}"

    def __getitem__(self, i: int) -> str:
        f, offset = self.index[i]
        if offset is None:
            return f.read_text(encoding="utf-8", errors="replace")
        with open(f, "rb") as fh:
            fh.seek(offset)
            line = fh.readline()
        try:
            record = json.loads(line)
            return record[self.text_key]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{f} line at byte {offset}: expected a JSON object with a "
                f"{self.text_key!r} string (data.text_key): {e}"
            ) from None


def build_source(path: str = "", text_key: str = "text", max_corpus_mb: float = 8.0) -> DocumentSource:
    if not path:
        return StdlibCorpus(max_bytes=int(max_corpus_mb * (1 << 20)))
    return FileCorpus(path, text_key=text_key)


# --------------------------------------------------------------------------- #
# The token stream and packing
# --------------------------------------------------------------------------- #


class TokenStream:
    """The global token stream: documents tokenized one after another, forever.

    The cursor is ``(epoch, doc_index, doc_offset)`` plus ``tokens_seen``; it is
    all a resume needs (documents are read by index, nothing is replayed).
    """

    def __init__(self, source: DocumentSource, tokenizer, *, seed: int = 0, shuffle: bool = True):
        self.source = source
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.doc_index = 0  # position in this epoch's order
        self.doc_offset = 0  # tokens of the current document already consumed
        self.tokens_seen = 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1
        self._doc: np.ndarray | None = None
        self._doc_key: tuple[int, int] | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.source)
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.epoch])
                self._order = rng.permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self.epoch
        return self._order

    def _current_doc(self) -> np.ndarray:
        key = (self.epoch, self.doc_index)
        if self._doc_key != key:
            doc_id = int(self._epoch_order()[self.doc_index])
            self._doc = self.tokenizer.encode(self.source[doc_id])
            self._doc_key = key
        return self._doc

    def _next_doc(self) -> None:
        self.doc_index += 1
        self.doc_offset = 0
        if self.doc_index >= len(self.source):
            self.doc_index = 0
            self.epoch += 1

    def take(self, n: int, materialize: bool = True):
        """The next ``n`` tokens as ``(tokens, positions)`` int64 arrays.

        ``positions`` restart at 0 at every document start and at the start of
        the returned span. With ``materialize=False`` the tokens are skipped and
        ``None`` is returned.
        """
        toks = np.empty(n, dtype=np.int64) if materialize else None
        pos = np.empty(n, dtype=np.int64) if materialize else None
        filled = 0
        empty_docs = 0
        while filled < n:
            doc = self._current_doc()
            avail = len(doc) - self.doc_offset
            if avail <= 0:
                empty_docs = empty_docs + 1 if len(doc) == 0 else 0
                if empty_docs > len(self.source):
                    raise ValueError("every document of the data source is empty")
                self._next_doc()
                continue
            k = min(avail, n - filled)
            if materialize:
                toks[filled : filled + k] = doc[self.doc_offset : self.doc_offset + k]
                pos[filled : filled + k] = np.arange(k)
            filled += k
            self.doc_offset += k
            if self.doc_offset >= len(doc):
                self._next_doc()
        self.tokens_seen += n
        return (toks, pos) if materialize else None

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "doc_index": self.doc_index,
            "doc_offset": self.doc_offset,
            "tokens_seen": self.tokens_seen,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "source": self.source.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("source") not in (None, self.source.fingerprint()):
            raise ValueError(
                f"checkpointed data position is for data source {state['source']!r} but this "
                f"run reads {self.source.fingerprint()!r}; resume with the same data.path, "
                f"data.max_corpus_mb and Python installation"
            )
        for key in ("seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"checkpointed data {key}={state[key]!r} differs from this run's "
                    f"{getattr(self, key)!r} (job.seed / data.shuffle); the data position "
                    f"would not continue the same stream"
                )
        self.epoch = int(state["epoch"])
        self.doc_index = int(state["doc_index"])
        self.doc_offset = int(state["doc_offset"])
        self.tokens_seen = int(state["tokens_seen"])
        self._doc_key = None


class PackedLoader:
    """Global batches of packed sequences; yields this dp rank's rows.

    ``next_batch(batch_size, seq_len)`` consumes ``batch_size * seq_len`` tokens
    of the global stream and returns rows ``[r*B/dp, (r+1)*B/dp)`` as
    ``input_ids`` and ``position_ids`` of shape ``(B/dp, seq_len)``.
    """

    def __init__(self, stream: TokenStream, *, dp_rank: int = 0, dp_size: int = 1):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.stream = stream
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def next_batch(self, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        if batch_size % self.dp_size:
            raise ValueError(
                f"global batch of {batch_size} sequences is not divisible by dp={self.dp_size}"
            )
        local = batch_size // self.dp_size
        first = self.dp_rank * local
        self.stream.take(first * seq_len, materialize=False)
        # One take per row: positions restart at every row start.
        rows = [self.stream.take(seq_len) for _ in range(local)]
        self.stream.take((batch_size - first - local) * seq_len, materialize=False)
        return {
            "input_ids": torch.from_numpy(np.stack([r[0] for r in rows])),
            "position_ids": torch.from_numpy(np.stack([r[1] for r in rows])),
        }

    @property
    def tokens_seen(self) -> int:
        return self.stream.tokens_seen

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)
