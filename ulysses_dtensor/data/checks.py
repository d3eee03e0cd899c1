"""Check training data before a run starts, with one message naming the file and line.

:func:`check_corpus` is what a trainer runs on rank 0 (sharing the verdict):

* raw files (:class:`~ulysses_dtensor.data.FileCorpus`): every file is read once.
  Each ``.txt`` file must be UTF-8 text with something besides whitespace; each
  non-blank ``.jsonl`` line (also inside ``.gz`` / ``.zst``) must be a JSON
  object whose text key holds a string, each parquet / arrow file must have
  the text column with strings in it, and each file must hold some non-blank
  text. Then documents are tokenized until one training step's worth.
* a prepared token store (:class:`~ulysses_dtensor.data.TokenStore`): the
  manifest's format version and tokenizer against this run's, and every
  shard's and the index's size against the manifest (a missing or truncated
  file is named). Nothing is scanned: the cost does not grow with the store.

Either way a corpus smaller than one step is refused: it would repeat itself
inside a batch.
"""

from __future__ import annotations

from pathlib import Path

from . import DataError, FileCorpus, TokenStore
from .readers import (
    data_suffix,
    decode_utf8,
    iter_file_records,
    jsonl_record,
    open_binary,
    record_text,
)
from .token_docs import TokenDocs

__all__ = ["DataError", "check_corpus", "check_files", "store_of"]


def _check_txt(path: Path) -> None:
    if not decode_utf8(path.read_bytes(), f"data file {path}").strip():
        raise DataError(f"data file {path} has no usable text (it is empty or whitespace only)")


def _check_records(path: Path, text_key: str) -> None:
    records = usable = 0
    if data_suffix(path) in (".parquet", ".arrow"):
        items = iter_file_records(path, [text_key])
    else:
        items = _jsonl_items(path)
    for where, record in items:
        text = record_text(record, where, text_key)
        records += 1
        usable += bool(text.strip())
    if not usable:
        what = f"its {records} records have empty {text_key!r} text" if records else "it has no records"
        raise DataError(f"data file {path} has no usable text: {what}")


def _jsonl_items(path: Path):
    with open_binary(path) as fh:
        for lineno, raw in enumerate(fh, start=1):
            if raw.strip():
                where = f"{path} line {lineno}"
                yield where, jsonl_record(raw, where)


def check_files(source: FileCorpus) -> None:
    """Every file of ``source`` is readable text of the expected shape (DataError if not)."""
    for path in source.files:
        if data_suffix(path) == ".txt":
            _check_txt(path)
        else:
            _check_records(path, source.text_key)


def store_of(docs) -> TokenStore | None:
    """The token store under ``docs`` (a store, or a subset / up-sampled view of one)."""
    while docs is not None and not isinstance(docs, TokenStore):
        docs = getattr(docs, "base", None)
    return docs


def check_corpus(source, tokenizer, step_tokens: int, *, described: str) -> int:
    """Check ``source`` and that it holds at least ``step_tokens`` tokens.

    ``source``: text documents or tokenized ones (a store or a view of one).
    ``described`` says where the data comes from and what one step needs, for
    the message. Returns the tokens counted (for text: at least
    ``step_tokens``, counting stops there, so a large corpus costs one step's
    tokenization; for a store: all of them, from the manifest).
    """
    base = getattr(source, "base", source)  # a held-out split reads a FileCorpus's documents
    if isinstance(base, FileCorpus):
        check_files(base)
    if isinstance(source, TokenDocs):
        store = store_of(source)
        if store is not None:
            store.check(tokenizer, what=described)
        total = source.total_tokens() if len(source) else 0
    else:
        total = 0
        for i in range(len(source)):
            total += len(tokenizer.encode(source[i]))
            if total >= step_tokens:
                return total
    if total >= step_tokens:
        return total
    raise DataError(
        f"{described}: the corpus has only {total:,} tokens in {len(source):,} documents "
        f"(tokenizer {tokenizer.name}), less than the {step_tokens:,} tokens of one training "
        f"step; add data, or lower training.global_batch_size / the sequence length"
    )

