"""Text document sources: random access to documents by index (no tokenization).

* :class:`StdlibCorpus` (``data.path = ""``): the Python standard library's own
  ``*.py`` files in sorted path order (test directories and site-packages
  skipped), up to a size cap; each file is one document. Real text that every
  Python installation has.
* :class:`FileCorpus`: local files of any format of :mod:`.readers`, or a
  directory of them. Plain ``.txt`` and ``.jsonl`` files are indexed by byte
  offset (a vectorised newline scan, no Python per line) and read on demand;
  compressed and table files are read into memory once (for small data:
  prepare large data into a token store with ``python -m
  ulysses_dtensor.prepare_data``).

A source is ``len(src)`` and ``src[i] -> str``; ``doc_key(i)`` names a document
independently of the others (held-out splits hash it), ``fingerprint()`` names
the whole source (checkpoints record it).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from .errors import DataError
from .readers import data_files, data_suffix, decode_utf8, jsonl_text, open_binary, scan_jsonl_lines, table_texts

__all__ = ["DocumentSource", "StdlibCorpus", "FileCorpus", "build_source", "open_source"]

_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idlelib"}


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


class FileCorpus(DocumentSource):
    """Local document files (see :mod:`.readers`): ``.txt`` is one document, every
    ``.jsonl`` line / table row one more.

    Per document it keeps a file number and a byte offset (plain files; -1: a
    whole ``.txt`` file) or a position in the texts read into memory
    (compressed and table files).
    """

    def __init__(self, path: str | os.PathLike, text_key: str = "text"):
        self.text_key = text_key
        self.root = Path(path)
        self.files = data_files(path)
        self._texts: list[str] = []
        file_ids, refs = [], []
        for n, f in enumerate(self.files):
            suffix = data_suffix(f)
            if suffix == ".txt":
                found = np.array([-1], dtype=np.int64)
            elif suffix == ".jsonl":
                found = scan_jsonl_lines(f)
            else:  # compressed or table files: read into memory once
                first = len(self._texts)
                self._texts.extend(self._read_all(f))
                found = np.arange(first, len(self._texts), dtype=np.int64)
            file_ids.append(np.full(len(found), n, dtype=np.int32))
            refs.append(found)
        self._file = np.concatenate(file_ids) if file_ids else np.zeros(0, np.int32)
        self._ref = np.concatenate(refs) if refs else np.zeros(0, np.int64)
        if not len(self._ref):
            raise DataError(f"{str(path)!r} holds no documents: its files have no non-blank record")

    def _read_all(self, f: Path) -> list[str]:
        if data_suffix(f) in (".parquet", ".arrow"):
            return table_texts(f, self.text_key)
        out = []
        with open_binary(f) as fh:
            for lineno, raw in enumerate(fh, start=1):
                if raw.strip():
                    out.append(jsonl_text(raw, f"{f} line {lineno}", self.text_key))
        return out

    def __len__(self) -> int:
        return len(self._ref)

    def doc_key(self, i: int) -> str:
        f, ref = self.files[self._file[i]], int(self._ref[i])
        name = f.name if self.root.is_file() else f.relative_to(self.root).as_posix()
        if ref < 0:
            return name
        # in-memory files: the record's position within its file
        if data_suffix(f) not in (".txt", ".jsonl"):
            ref -= int(self._ref[np.searchsorted(self._file, self._file[i])])
            return f"{name}#{ref}"
        return f"{name}@{ref}"

    def __getitem__(self, i: int) -> str:
        f, ref = self.files[self._file[i]], int(self._ref[i])
        suffix = data_suffix(f)
        if suffix == ".txt":
            return decode_utf8(f.read_bytes(), f"data file {f}")
        if suffix != ".jsonl":
            return self._texts[ref]
        with open(f, "rb") as fh:
            fh.seek(ref)
            line = fh.readline()
        return jsonl_text(line, f"{f} line at byte {ref}", self.text_key)


def build_source(path: str = "", text_key: str = "text", max_corpus_mb: float = 8.0):
    """The documents of ``path``: the built-in corpus (``""``), a prepared token
    store (a directory with a manifest), or raw files."""
    if not path:
        return StdlibCorpus(max_bytes=int(max_corpus_mb * (1 << 20)))
    from .store import TokenStore, is_store

    if is_store(path):
        return TokenStore(path)
    return FileCorpus(path, text_key=text_key)


def open_source(path: str, fmt: str, tokenizer_spec: str, text_key: str = "text", max_corpus_mb: float = 8.0,
                *, key: str = "data.path"):
    """The documents of ``path`` read as ``fmt``: a store prepared with that format, raw
    records rendered at load (chat / prompt_completion, :mod:`.sft`), or text
    (:func:`build_source`). Every data source of a run is opened here."""
    from .sft import FORMATS, RenderedDocs, build_renderer, check_store_format
    from .store import TokenStore, is_store

    if path and is_store(path):
        store = TokenStore(path)
        if store.manifest.get("renderer", "text") in FORMATS or fmt != "text":  # a library's own renderer reads as text
            check_store_format(store, fmt, key)
        return store
    if fmt == "text" or not path:
        return build_source(path, text_key, max_corpus_mb)
    return RenderedDocs(path, build_renderer(fmt, tokenizer_spec))
