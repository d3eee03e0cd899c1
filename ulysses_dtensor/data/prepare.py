"""Tokenize raw documents once into a token store (see :mod:`.store` for the format).

Steps of :func:`prepare_store`:

1. List the input files (:func:`~.readers.data_files`, in the order given) and cut
   them into work units of about ``shard_mb`` MiB (:func:`~.readers.plan_units`):
   unit ``i`` becomes ``shard-i``, so the store does not depend on the number of
   workers or on interruptions.
2. Worker processes (``multiprocessing``) each read a unit, render its records to
   tokens (and optional target masks), and write the shard into
   ``OUTPUT.partial/``: the tokens under a temporary name, renamed when complete,
   then a ``.done.json`` marker naming the unit (its files' sizes and
   modification times). The main process prints progress.
3. When every unit is done, the document index and ``manifest.json`` are
   written and ``OUTPUT.partial`` is renamed to ``OUTPUT``: a store is
   complete or absent, never half-written.

Interrupted (a kill, Ctrl-C, an error in a record), a run leaves
``OUTPUT.partial``; the same command then redoes only the units without a
marker (or whose input changed) and produces the same bytes as an
uninterrupted run.

Rendering is one seam: a renderer maps a batch of ``(where, record)`` to
``(token ids, target flags or None)`` per document. :class:`TextRenderer`
tokenizes ``record[text_key]`` and trains on every token; the renderers of
:mod:`.sft` (chat, prompt/completion) return target flags, which the store
keeps as ``.targets`` shards and the loader turns into ignored labels. The
manifest's ``renderer`` names the one used.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import DataError
from .readers import (
    DATA_SUFFIXES,
    data_files,
    data_suffix,
    iter_unit_records,
    plan_units,
    record_text,
    with_line_numbers,
)
from .store import (
    INDEX_FILE,
    MANIFEST,
    STORE_FORMAT,
    STORE_VERSION,
    is_store,
    length_histogram,
    shard_name,
    targets_name,
)
from .tokenizer import build_tokenizer, token_dtype, tokenizer_identity

__all__ = ["prepare_store", "Renderer", "TextRenderer", "format_summary"]

_BATCH = 256
_SETTINGS = "settings.json"


class Renderer:
    """What every renderer shares: its tokenizer spec, the tokenizer built on first use
    (in the worker process that renders, not in the parent that pickles it), and
    ``render_batch`` as one ``render(where, record)`` per item."""

    name = ""

    def __init__(self, tokenizer_spec: str):
        self.tokenizer_spec = tokenizer_spec
        self._tok = None

    @property
    def tokenizer(self):
        if self._tok is None:
            self._tok = build_tokenizer(self.tokenizer_spec)
        return self._tok

    def render_batch(self, items):
        return [self.render(where, record) for where, record in items]


class TextRenderer(Renderer):
    """``record[text_key]`` (or a whole ``.txt`` file) -> ``[BOS] tokens [EOS]``, all trained on."""

    name = "text"

    def __init__(self, tokenizer_spec: str, text_key: str = "text"):
        super().__init__(tokenizer_spec)
        self.text_key = text_key

    @property
    def columns(self) -> list[str]:
        return [self.text_key]

    def settings(self) -> dict:
        return {"renderer": self.name, "text_key": self.text_key}

    def render_batch(self, items: list[tuple[str, object]]) -> list[tuple[np.ndarray, None]]:
        texts = [record_text(rec, where, self.text_key) for where, rec in items]
        return [(ids, None) for ids in self.tokenizer.encode_many(texts)]


# --------------------------------------------------------------------------- #
# One unit -> one shard (runs in a worker)
# --------------------------------------------------------------------------- #

_renderer = None


def _init_worker(renderer, in_pool: bool = False) -> None:
    global _renderer
    if in_pool:  # one core per worker process (in-process: the library's own threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _renderer = renderer


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)


def _write_shard(task) -> dict:
    index, unit, folder, dtype_name = task
    folder = Path(folder)
    dtype = np.dtype(dtype_name)
    tok_tmp = folder / (shard_name(index) + ".tmp")
    tgt_tmp = folder / (targets_name(index) + ".tmp")
    lengths: list[int] = []
    with_targets = None
    t0 = time.perf_counter()

    def flush(batch, tok_fh, tgt_fh):
        nonlocal with_targets
        try:
            rendered = _renderer.render_batch(batch)
        except DataError as e:
            raise DataError(with_line_numbers(str(e))) from None
        for ids, targets in rendered:
            if with_targets is None:
                with_targets = targets is not None
            if (targets is not None) != with_targets:
                raise DataError(f"{batch[0][0]}: a renderer gave target masks for some documents only")
            tok_fh.write(np.asarray(ids).astype(dtype, copy=False).tobytes())
            if targets is not None:
                if len(targets) != len(ids):
                    raise DataError(f"{batch[0][0]}: {len(targets)} target flags for {len(ids)} tokens")
                tgt_fh.write(np.asarray(targets, dtype=np.uint8).tobytes())
            lengths.append(len(ids))

    with open(tok_tmp, "wb") as tok_fh, open(tgt_tmp, "wb") as tgt_fh:
        batch = []
        for item in iter_unit_records(unit, _renderer.columns):
            batch.append(item)
            if len(batch) >= _BATCH:
                flush(batch, tok_fh, tgt_fh)
                batch = []
        if batch:
            flush(batch, tok_fh, tgt_fh)
    np.save(folder / f"shard-{index:05d}.lengths.npy", np.asarray(lengths, dtype=np.int64))
    _replace(tok_tmp, folder / shard_name(index))
    if with_targets:
        _replace(tgt_tmp, folder / targets_name(index))
    else:
        tgt_tmp.unlink()
    stats = {"unit": unit, "documents": len(lengths), "tokens": int(sum(lengths)),
             "targets": bool(with_targets), "bytes": _unit_bytes(unit),
             "seconds": time.perf_counter() - t0}
    marker = folder / f"shard-{index:05d}.done.json"
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(stats))
    _replace(tmp, marker)
    return {"index": index, **stats}


def _unit_bytes(unit: dict) -> int:
    if unit["kind"] == "jsonl":
        return unit["stop"] - unit["start"]
    if unit["kind"] == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(unit["files"][0][0]).metadata
        return sum(meta.row_group(g).total_byte_size for g in range(unit["start"], unit["stop"]))
    return sum(f[1] for f in unit["files"])


# --------------------------------------------------------------------------- #
# The whole run
# --------------------------------------------------------------------------- #


def _input_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for inp in inputs:
        p = Path(inp)
        if not p.exists():
            raise DataError(f"--input {inp!r} does not exist; give files ({', '.join(DATA_SUFFIXES)}) "
                            f"or directories of them")
        found = data_files(p)
        if p.is_file() and data_suffix(p) is None:
            raise DataError(f"--input {inp!r} is not a data file; valid suffixes: {', '.join(DATA_SUFFIXES)}")
        if not found:
            raise DataError(f"--input {inp!r} holds no data file ({', '.join(DATA_SUFFIXES)})")
        files.extend(found)
    return files


def _settings(renderer, identity: dict, dtype: np.dtype) -> dict:
    return {"format": STORE_FORMAT, "version": STORE_VERSION, "tokenizer": identity,
            "token_dtype": dtype.name, **renderer.settings()}


def prepare_store(
    inputs: list[str],
    tokenizer: str,
    output: str | os.PathLike,
    *,
    workers: int = 1,
    text_key: str = "text",
    shard_mb: float = 64.0,
    renderer=None,
    log: Callable[[str], None] | None = print,
    on_shard: Callable[[dict], None] | None = None,
) -> dict:
    """Prepare (or finish preparing) the store ``output``; return its manifest.

    ``on_shard(stats)`` is called in the main process after each shard is
    written (an exception there interrupts the run like a kill would).
    """
    log = log or (lambda _msg: None)
    output = Path(output)
    renderer = renderer or TextRenderer(tokenizer, text_key)
    files = _input_files(list(inputs))
    identity = tokenizer_identity(renderer.tokenizer)
    dtype = token_dtype(identity["vocab_size"])
    settings = _settings(renderer, identity, dtype)
    units = plan_units(files, max(1, int(shard_mb * (1 << 20))))

    if output.exists():
        if is_store(output):
            m = json.loads((output / MANIFEST).read_text())
            same = all(m.get(k) == v for k, v in settings.items()) and \
                [s["inputs"] for s in m["shards"]] == units
            if same:
                log(f"{output} is already prepared from these inputs: nothing to do")
                return m
            raise DataError(f"--output {str(output)!r} is a store prepared from other inputs or settings (tokenizer, format, text key, shard size); "
                            f"remove it or choose another --output")
        raise DataError(f"--output {str(output)!r} exists and is not a token store; choose another path")

    partial = output.parent / (output.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    sfile = partial / _SETTINGS
    if sfile.is_file() and json.loads(sfile.read_text()) != settings:
        raise DataError(
            f"{partial} holds an interrupted run with another tokenizer or text key "
            f"({json.loads(sfile.read_text()).get('tokenizer', {}).get('name')!r}); remove it, or "
            f"run with the same --tokenizer and --text-key to finish it"
        )
    sfile.write_text(json.dumps(settings))

    todo, reused = [], 0
    for i, unit in enumerate(units):
        marker = partial / f"shard-{i:05d}.done.json"
        if marker.is_file() and json.loads(marker.read_text())["unit"] == unit:
            reused += 1
        else:
            marker.unlink(missing_ok=True)
            todo.append((i, unit, str(partial), dtype.name))
    total_bytes = sum(_unit_bytes(u) for u in units)
    log(f"prepare_data: {len(files)} files, {total_bytes / 2**20:,.1f} MiB in {len(units)} shards -> "
        f"{output} (tokenizer {identity['name']}, {dtype.name}, {workers} worker(s))"
        + (f"; resuming: {reused} shards already done" if reused else ""))

    t0 = time.perf_counter()
    done = {"documents": 0, "tokens": 0, "bytes": 0, "shards": reused}
    last = [0.0]

    def finished(stats: dict) -> None:
        done["documents"] += stats["documents"]
        done["tokens"] += stats["tokens"]
        done["bytes"] += stats["bytes"]
        done["shards"] += 1
        now = time.perf_counter() - t0
        if now - last[0] >= 2.0 or done["shards"] == len(units):
            last[0] = now
            log(f"  [{done['shards']}/{len(units)} shards] {done['documents']:,} documents, "
                f"{done['tokens']:,} tokens, {done['bytes'] / 2**20 / max(now, 1e-9):,.1f} MiB/s, "
                f"{done['tokens'] / max(now, 1e-9):,.0f} tokens/s")
        if on_shard is not None:
            on_shard(stats)

    if workers <= 1 or len(todo) <= 1:
        _init_worker(renderer)
        for task in todo:
            finished(_write_shard(task))
    else:
        method = "fork" if sys.platform.startswith("linux") else "spawn"
        ctx = multiprocessing.get_context(method)
        with ctx.Pool(min(workers, len(todo)), initializer=_init_worker, initargs=(renderer, True)) as pool:
            for stats in pool.imap_unordered(_write_shard, todo):
                finished(stats)
    manifest = _finalize(partial, output, units, settings)
    log(format_summary(manifest, time.perf_counter() - t0))
    return manifest


def _finalize(partial: Path, output: Path, units: list[dict], settings: dict) -> dict:
    """Index + manifest into ``partial``, then rename it to ``output``."""
    lengths, shards = [], []
    first_doc = first_tok = 0
    with_targets = None
    for i, unit in enumerate(units):
        stats = json.loads((partial / f"shard-{i:05d}.done.json").read_text())
        lens = np.load(partial / f"shard-{i:05d}.lengths.npy")
        if stats["documents"] and with_targets is None:
            with_targets = stats["targets"]
        if stats["documents"] and stats["targets"] != with_targets:
            raise DataError(f"shard {i} ({unit['files'][0][0]}) has target masks, others not")
        lengths.append(lens)
        shards.append({"file": shard_name(i), "documents": int(len(lens)), "tokens": int(lens.sum()),
                       "first_document": first_doc, "first_token": first_tok, "inputs": unit})
        first_doc += len(lens)
        first_tok += int(lens.sum())
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if not len(all_lengths):
        raise DataError(f"the inputs hold no documents ({len(units)} units read); nothing to prepare")
    if with_targets:  # empty shards get an empty mask file
        for i, s in enumerate(shards):
            (partial / targets_name(i)).touch()
    offsets = np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64)
    tmp = partial / "documents.tmp.npy"
    np.save(tmp, offsets)
    _replace(tmp, partial / INDEX_FILE)
    inputs: dict[str, int] = {}
    for u in units:
        for f in u["files"]:
            inputs[f[0]] = f[1]
    manifest = {
        **settings,
        "documents": int(len(all_lengths)),
        "tokens": int(offsets[-1]),
        "targets": bool(with_targets),
        "shards": shards,
        "inputs": [{"path": p, "bytes": b} for p, b in inputs.items()],
        "length_histogram": length_histogram(all_lengths),
        "created_by": "ulysses_dtensor.prepare_data",
    }
    for i in range(len(units)):
        (partial / f"shard-{i:05d}.done.json").unlink()
        (partial / f"shard-{i:05d}.lengths.npy").unlink()
    keep = {MANIFEST, INDEX_FILE, *(s["file"] for s in shards),
            *(targets_name(i) for i in range(len(shards)) if with_targets)}
    for stray in partial.iterdir():  # shards of an older plan, temporaries, settings
        if stray.name not in keep:
            stray.unlink() if stray.is_file() else shutil.rmtree(stray)
    tmp = partial / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    _replace(tmp, partial / MANIFEST)
    os.replace(partial, output)
    return manifest


def format_summary(m: dict, seconds: float | None = None) -> str:
    h = m["length_histogram"]
    rows = [f"    {lo:>9,}-{2 * lo - 1:<9,} {d:>12,} docs {t:>15,} tokens"
            for lo, d, t in zip(h["bins"], h["documents"], h["tokens"]) if d]
    took = f" in {seconds:,.1f} s ({m['tokens'] / max(seconds, 1e-9):,.0f} tokens/s)" if seconds else ""
    return (f"prepared {m['documents']:,} documents, {m['tokens']:,} tokens in {len(m['shards'])} shards"
            f"{took}\n  document lengths (tokens):\n" + "\n".join(rows))
