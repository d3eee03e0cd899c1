"""Check training data before a run starts, with one message naming the file and line.

:func:`check_corpus` reads every data file once (a trainer runs it on rank 0
and shares the verdict): each ``.txt`` file must be UTF-8 text with something
besides whitespace; each non-blank ``.jsonl`` line must be a JSON object whose
text key holds a string, and each file must hold some non-blank text. Then it
tokenizes documents until it has one training step's worth of tokens: a corpus
smaller than one step would repeat itself inside a batch.
"""

from __future__ import annotations

import json
from pathlib import Path

from .data import DataError, DocumentSource, FileCorpus

__all__ = ["DataError", "check_corpus", "check_files"]


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where} is not UTF-8 text (undecodable bytes at offset {e.start}: "
            f"{raw[e.start:e.start + 8]!r}); convert it to UTF-8"
        ) from None


def _check_txt(path: Path) -> None:
    if not _decode(path.read_bytes(), f"data file {path}").strip():
        raise DataError(f"data file {path} has no usable text (it is empty or whitespace only)")


def _check_jsonl(path: Path, text_key: str) -> None:
    records = usable = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path} line {lineno}"
            line = _decode(raw, where)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{where} is a JSON {type(record).__name__}, not an object with a "
                    f"{text_key!r} key (data.text_key)"
                )
            if text_key not in record:
                keys = ", ".join(map(repr, list(record)[:8])) or "none"
                raise DataError(
                    f"{where} has no {text_key!r} key (data.text_key); its keys: {keys}"
                )
            text = record[text_key]
            if not isinstance(text, str):
                raise DataError(
                    f"{where}: {text_key!r} is a JSON {type(text).__name__}, not a string"
                )
            records += 1
            usable += bool(text.strip())
    if not usable:
        what = f"its {records} records have empty {text_key!r} text" if records else "it has no records"
        raise DataError(f"data file {path} has no usable text: {what}")


def check_files(source: FileCorpus) -> None:
    """Every file of ``source`` is readable text of the expected shape (DataError if not)."""
    for path in sorted({f for f, _ in source.index}):
        if path.suffix == ".jsonl":
            _check_jsonl(path, source.text_key)
        else:
            _check_txt(path)


def check_corpus(source: DocumentSource, tokenizer, step_tokens: int, *, described: str) -> int:
    """Check ``source`` and that it holds at least ``step_tokens`` tokens.

    ``described`` says where the data comes from and what one step needs, for
    the message. Returns the tokens counted (at least ``step_tokens``; counting
    stops there, so a large corpus costs one step's tokenization).
    """
    base = getattr(source, "base", source)  # a held-out split reads a FileCorpus's documents
    if isinstance(base, FileCorpus):
        check_files(base)
    total = 0
    for i in range(len(source)):
        total += len(tokenizer.encode(source[i]))
        if total >= step_tokens:
            return total
    raise DataError(
        f"{described}: the corpus has only {total:,} tokens in {len(source):,} documents "
        f"(tokenizer {tokenizer.name}), less than the {step_tokens:,} tokens of one training "
        f"step; add data, or lower training.global_batch_size / the sequence length"
    )
