"""Raw document files: which formats, how their records are read, where an error is.

Formats (a directory means every such file below it, sorted by path):

========================  ===============================================
``.txt``                  the whole file is ONE document
``.jsonl``                one JSON object per non-blank line, its text under
                          ``text_key``
``.jsonl.gz``             the same, gzip-compressed (stdlib ``gzip``)
``.jsonl.zst``            the same, zstd-compressed (``zstandard``)
``.parquet``              one document per row, the string column ``text_key``
                          (``pyarrow.parquet``, read by row groups)
``.arrow``                the same in Arrow IPC files, as ``datasets``'
                          ``save_to_disk`` writes them (``pyarrow.ipc``)
========================  ===============================================

A record is a ``str`` (a whole ``.txt`` file) or a ``dict`` (a JSON object or a
table row). Blank ``.jsonl`` lines are not records. Every problem raises one
:class:`DataError` naming the file and the line, row or byte offset.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import DataError

__all__ = [
    "DATA_SUFFIXES",
    "data_suffix",
    "data_files",
    "open_binary",
    "jsonl_text",
    "decode_utf8",
    "iter_file_records",
    "record_text",
    "scan_jsonl_lines",
    "table_texts",
    "plan_units",
    "iter_unit_records",
    "with_line_numbers",
]

DATA_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".arrow")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLE_SUFFIXES = (".parquet", ".arrow")
ZSTD_EXTRA_MSG = "{path} is zstd-compressed, which needs the 'zstandard' package: pip install 'ulysses-dtensor[data]'"
ARROW_EXTRA_MSG = "{path} needs the 'pyarrow' package: pip install 'ulysses-dtensor[data]'"
_BLOCK = 16 << 20


def data_suffix(path: str | os.PathLike) -> str | None:
    """The data format suffix of ``path`` (``.jsonl.gz`` counts as one), or None."""
    name = Path(path).name
    for suffix in sorted(DATA_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix) and len(name) > len(suffix):
            return suffix
    return None


def data_files(path: str | os.PathLike) -> list[Path]:
    """The data files of ``path``: itself, or the data files below it (sorted)."""
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(f for f in p.rglob("*") if f.is_file() and data_suffix(f))


def open_binary(path: Path):
    """``path`` opened for reading bytes, decompressed when it is .gz / .zst."""
    suffix = data_suffix(path) or ""
    if suffix.endswith(".gz"):
        return gzip.open(path, "rb")
    if suffix.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(ZSTD_EXTRA_MSG.format(path=path)) from None
        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


# --------------------------------------------------------------------------- #
# Records
# --------------------------------------------------------------------------- #


def decode_utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where} is not UTF-8 text (undecodable bytes at offset {e.start}: "
            f"{raw[e.start:e.start + 8]!r}); convert it to UTF-8"
        ) from None


def jsonl_record(raw: bytes, where: str) -> dict:
    """One non-blank ``.jsonl`` line as a JSON object (DataError if it is not one)."""
    line = decode_utf8(raw, where)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where} is a JSON {type(record).__name__}, not an object")
    return record


def record_text(record, where: str, text_key: str) -> str:
    """The text of a record: a whole file's, or the string under ``text_key``."""
    if isinstance(record, str):
        return record
    if text_key not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise DataError(f"{where} has no {text_key!r} key (data.text_key); its keys: {keys}")
    text = record[text_key]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise DataError(f"{where}: {text_key!r} is a JSON {kind}, not a string")
    return text


def jsonl_text(raw: bytes, where: str, text_key: str) -> str:
    record = jsonl_record(raw, where)
    return record_text(record, where, text_key)


def _iter_jsonl(path: Path, start: int = 0, stop: int | None = None) -> Iterator[tuple[str, bytes]]:
    """(where, raw line) of the non-blank lines; a byte range [start, stop) of
    line starts for plain files (lines are then named by byte offset)."""
    with open_binary(path) as fh:
        if start or stop is not None:
            fh.seek(start)
            offset = start
            for raw in fh:
                if stop is not None and offset >= stop:
                    break
                if raw.strip():
                    yield f"{path} line at byte {offset}", raw
                offset += len(raw)
            return
        for lineno, raw in enumerate(fh, start=1):
            if raw.strip():
                yield f"{path} line {lineno}", raw


def _arrow_table_reader(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.ipc
    except ImportError:
        raise DataError(ARROW_EXTRA_MSG.format(path=path)) from None
    source = pa.memory_map(str(path))
    try:
        return pyarrow.ipc.open_file(source)
    except pa.ArrowInvalid:
        return pyarrow.ipc.open_stream(pa.memory_map(str(path)))


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(ARROW_EXTRA_MSG.format(path=path)) from None
    try:
        return pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a broken file
        raise DataError(f"{path} is not a readable parquet file ({e})") from None


def _check_columns(path: Path, names: list[str], columns: list[str]) -> None:
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(
            f"{path} has no column {missing[0]!r} (data.text_key); its columns: "
            f"{', '.join(map(repr, names[:8]))}"
        )


def _table_batches(path: Path, columns: list[str], start: int = 0, stop: int | None = None):
    """(first row number, RecordBatch) of a parquet row-group range or an arrow file."""
    if data_suffix(path) == ".parquet":
        pf = _parquet_file(path)
        _check_columns(path, pf.schema_arrow.names, columns)
        stop = pf.num_row_groups if stop is None else stop
        row = sum(pf.metadata.row_group(g).num_rows for g in range(start))
        for g in range(start, stop):
            for batch in pf.iter_batches(row_groups=[g], columns=columns, batch_size=4096):
                yield row, batch
                row += batch.num_rows
        return
    reader = _arrow_table_reader(path)
    _check_columns(path, reader.schema.names, columns)
    row = 0
    n = getattr(reader, "num_record_batches", None)
    batches = (reader.get_batch(i) for i in range(n)) if n is not None else reader
    for batch in batches:
        yield row, batch.select(columns)
        row += batch.num_rows


def _table_records(path: Path, columns: list[str], start: int = 0, stop: int | None = None):
    for row, batch in _table_batches(path, columns, start, stop):
        for i, record in enumerate(batch.to_pylist()):
            yield f"{path} row {row + i}", record


def table_texts(path: Path, text_key: str) -> list[str]:
    """Every row's ``text_key`` string of a parquet / arrow file (DataError on a null)."""
    return [record_text(r, w, text_key) for w, r in _table_records(path, [text_key])]


def iter_file_records(path: Path, columns: list[str]) -> Iterator[tuple[str, object]]:
    """(where, record) of every record of one file, in order."""
    suffix = data_suffix(path)
    if suffix == ".txt":
        yield str(path), decode_utf8(path.read_bytes(), f"data file {path}")
    elif suffix in JSONL_SUFFIXES:
        for where, raw in _iter_jsonl(path):
            yield where, jsonl_record(raw, where)
    elif suffix in TABLE_SUFFIXES:
        yield from _table_records(path, columns)
    else:
        raise DataError(f"{path} has no data suffix; valid: {', '.join(DATA_SUFFIXES)}")


def scan_jsonl_lines(path: Path) -> np.ndarray:
    """Byte offsets of the non-blank lines of a plain ``.jsonl`` file.

    The file is read in 16 MiB blocks and its newlines found with numpy; a line
    whose first byte is not whitespace is non-blank (a JSON object starts with
    ``{``), and only the others are looked at in Python (blank lines, leading
    spaces).
    """
    ws = np.zeros(256, dtype=bool)
    ws[list(b" \t\n\r\x0b\x0c")] = True
    found = []
    base = 0  # file offset of buf[0]
    carry = b""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(_BLOCK)
            buf = carry + block if carry else block
            if not buf:
                break
            arr = np.frombuffer(buf, dtype=np.uint8)
            ends = np.flatnonzero(arr == 10) + 1  # one past each newline
            if not block and (len(ends) == 0 or ends[-1] != len(buf)):
                ends = np.append(ends, len(buf))  # the last line has no newline
            if len(ends) == 0:
                carry = buf
                continue
            starts = np.concatenate([[0], ends[:-1]])
            keep = ~ws[arr[starts]]
            for i in np.flatnonzero(~keep):  # a first byte of whitespace: look closer
                keep[i] = bool(buf[starts[i]:ends[i]].strip())
            found.append(starts[keep] + base)
            complete = int(ends[-1])
            carry = buf[complete:]
            base += complete
            if not block:
                break
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------- #
# Work units of a prepare run
# --------------------------------------------------------------------------- #


def _stamp(path: Path) -> list:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def plan_units(files: list[Path], target_bytes: int) -> list[dict]:
    """Split the input files into ordered work units of about ``target_bytes``.

    ``.txt`` files are grouped, plain ``.jsonl`` files cut at line starts,
    parquet files at row groups; a compressed or arrow file is one unit. A
    unit records each file's size and modification time, so a resumed run
    redoes a unit whose input changed. Deterministic: the same files give
    the same units.
    """
    units: list[dict] = []
    group: list[Path] = []
    group_bytes = 0

    def flush():
        nonlocal group, group_bytes
        if group:
            units.append({"kind": "txt", "files": [_stamp(p) for p in group]})
            group, group_bytes = [], 0

    for path in files:
        suffix = data_suffix(path)
        size = path.stat().st_size
        if suffix == ".txt":
            group.append(path)
            group_bytes += size
            if group_bytes >= target_bytes:
                flush()
            continue
        flush()
        if suffix == ".jsonl":
            cuts = [0]
            with open(path, "rb") as fh:
                while cuts[-1] + target_bytes < size:
                    fh.seek(cuts[-1] + target_bytes)
                    fh.readline()
                    if fh.tell() >= size:
                        break
                    cuts.append(fh.tell())
            cuts.append(size)
            for a, b in zip(cuts[:-1], cuts[1:]):
                units.append({"kind": "jsonl", "files": [_stamp(path)], "start": a, "stop": b})
        elif suffix == ".parquet":
            meta = _parquet_file(path).metadata
            first, acc = 0, 0
            for g in range(meta.num_row_groups):
                acc += meta.row_group(g).total_byte_size
                if acc >= target_bytes:
                    units.append({"kind": "parquet", "files": [_stamp(path)], "start": first, "stop": g + 1})
                    first, acc = g + 1, 0
            if first < meta.num_row_groups or meta.num_row_groups == 0:
                units.append({"kind": "parquet", "files": [_stamp(path)], "start": first,
                              "stop": meta.num_row_groups})
        else:
            units.append({"kind": "whole", "files": [_stamp(path)]})
    flush()
    return units


def iter_unit_records(unit: dict, columns: list[str]) -> Iterator[tuple[str, object]]:
    """(where, record) of one work unit, in order."""
    paths = [Path(f[0]) for f in unit["files"]]
    kind = unit["kind"]
    if kind == "jsonl":
        for where, raw in _iter_jsonl(paths[0], unit["start"], unit["stop"]):
            yield where, jsonl_record(raw, where)
    elif kind == "parquet":
        yield from _table_records(paths[0], columns, unit["start"], unit["stop"])
    else:  # txt groups and whole files
        for p in paths:
            yield from iter_file_records(p, columns)


_AT_BYTE = re.compile(r"^(?P<path>.+?) line at byte (?P<offset>\d+)")


def with_line_numbers(message: str) -> str:
    """``message`` with a leading ``PATH line at byte N`` (how a work unit of a plain
    .jsonl names its lines) turned into ``PATH line L``: the newlines before byte N
    are counted, so only an error pays for it."""
    m = _AT_BYTE.match(message)
    if not m or not Path(m["path"]).is_file():
        return message
    offset, newlines = int(m["offset"]), 0
    with open(m["path"], "rb") as fh:
        while offset > 0:
            block = fh.read(min(_BLOCK, offset))
            if not block:
                break
            newlines += block.count(b"\n")
            offset -= len(block)
    return f"{m['path']} line {newlines + 1}" + message[m.end():]
