"""The prepared token store: every input format, the same stream as the raw files,
resumable and atomic preparation, target masks, and each bad input's one message."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_helpers import build_bpe_tokenizer

from ulysses_dtensor.data import (
    ByteTokenizer,
    DataError,
    FileCorpus,
    HFTokenizer,
    PackedLoader,
    TokenStore,
    TokenStream,
    build_source,
)
from ulysses_dtensor.data.prepare import TextRenderer, prepare_store
from ulysses_dtensor.data.tokenizer import token_dtype

REPO = Path(__file__).resolve().parents[1]


def _texts(n: int, salt: str = "") -> list[str]:
    return [f"{salt}doc {i}: " + "lorem ipsum dolor " * (1 + (i * 7) % 23) for i in range(n)]


def _lines(texts) -> str:
    return "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))


def write_corpus(root: Path) -> list[str]:
    """Files of every format under ``root``; returns their texts in document order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    a, b, c, d, e = _texts(40, "a"), _texts(30, "b"), _texts(20, "c"), _texts(25, "d"), _texts(15, "e")
    (root / "a.jsonl").write_text(_lines(a[:20]) + "\n  \n" + _lines(a[20:]))  # a blank line: no record
    with gzip.open(root / "b.jsonl.gz", "wt") as fh:
        fh.write(_lines(b))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines(c).encode()))
    pq.write_table(pa.table({"id": list(range(len(d))), "text": d}), root / "d.parquet", row_group_size=4)
    table = pa.table({"text": e})
    with pa.ipc.new_stream(str(root / "e.arrow"), table.schema) as w:  # as datasets' save_to_disk
        w.write_table(table, max_chunksize=6)
    (root / "f.txt").write_text("one whole text file\nwith two lines")
    return a + b + c + d + e + ["one whole text file\nwith two lines"]


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_every_format_prepared_equals_the_raw_stream(tmp_path):
    texts = write_corpus(tmp_path / "raw")
    tok = ByteTokenizer()
    lines = []
    m = prepare_store([str(tmp_path / "raw")], "byte", tmp_path / "store", shard_mb=0.002, log=lines.append)
    store = TokenStore(tmp_path / "store")
    store.check(tok)
    assert m["documents"] == len(store) == len(texts) == 131
    assert m["tokens"] == sum(len(tok.encode(t)) for t in texts)
    assert m["token_dtype"] == "uint16" and token_dtype(70000) == np.uint32
    assert len(m["shards"]) > 6  # jsonl cut by bytes, parquet by row groups
    assert sum(m["length_histogram"]["documents"]) == 131 and sum(m["length_histogram"]["tokens"]) == m["tokens"]
    assert "prepared 131 documents" in lines[-1] and "document lengths" in lines[-1]
    for i in (0, 39, 40, 89, 115, 130):  # a document of each file
        np.testing.assert_array_equal(store.tokens(i, 0, 10**9), tok.encode(texts[i]))
    # The same documents in the same order: the same token stream as the raw files.
    raw = FileCorpus(tmp_path / "raw")
    assert [raw[i] for i in range(len(raw))] == texts
    for start in (0, 5000, 33333):
        a = TokenStream(store, seed=4, block=16).read(start, 20000)
        b = TokenStream(raw, tok, seed=4, block=16).read(start, 20000)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    assert isinstance(build_source(str(tmp_path / "store")), TokenStore)


def test_interrupted_prepare_resumes_to_the_identical_store(tmp_path):
    write_corpus(tmp_path / "raw")
    whole = prepare_store([str(tmp_path / "raw")], "byte", tmp_path / "whole", workers=2, shard_mb=0.002, log=None)
    n = len(whole["shards"])

    def stop_after_3(stats, seen=[]):
        seen.append(stats)
        if len(seen) == 3:
            raise KeyboardInterrupt

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        prepare_store([str(tmp_path / "raw")], "byte", out, shard_mb=0.002, log=None, on_shard=stop_after_3)
    assert not out.exists() and (tmp_path / "resumed.partial").is_dir()  # never half-written
    redone = []
    lines = []
    prepare_store([str(tmp_path / "raw")], "byte", out, workers=2, shard_mb=0.002, log=lines.append,
                  on_shard=redone.append)
    assert len(redone) == n - 3 and "resuming: 3 shards already done" in lines[0]
    assert not (tmp_path / "resumed.partial").exists()
    assert _files(out) == _files(tmp_path / "whole")  # byte for byte
    prepare_store([str(tmp_path / "raw")], "byte", out, shard_mb=0.002, log=lines.append)
    assert "already prepared" in lines[-1]


def test_target_masks_become_ignored_labels(tmp_path):
    """A renderer's per-token target flags are stored beside the tokens; the loader
    turns flag 0 into an ignored label (what chat / completion data will use)."""

    class CompletionOnly(TextRenderer):  # trains on the second half of each document
        def settings(self):
            return {"renderer": "test-completion", "text_key": self.text_key}

        def render_batch(self, items):
            out = []
            for ids, _ in super().render_batch(items):
                flags = np.zeros(len(ids), np.uint8)
                flags[len(ids) // 2:] = 1
                out.append((ids, flags))
            return out

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.jsonl").write_text(_lines(_texts(12)))
    prepare_store([str(tmp_path / "raw")], "byte", tmp_path / "store", renderer=CompletionOnly("byte"), log=None)
    store = TokenStore(tmp_path / "store")
    store.check(ByteTokenizer())
    assert store.has_targets and (tmp_path / "store" / "shard-00000.targets").is_file()
    batch = PackedLoader(TokenStream(store, shuffle=False)).next_batch(4, 64)
    ids, labels = batch["input_ids"], batch["labels"]
    first = ByteTokenizer().encode(_texts(12)[0])
    assert torch.equal(labels[0, len(first) // 2:len(first)], ids[0, len(first) // 2:len(first)])
    assert (labels[0, :len(first) // 2] == -100).all()
    assert 0.3 < float((labels == -100).float().mean()) < 0.7
    # without masks there are no labels: every token is a target
    assert "labels" not in PackedLoader(TokenStream(FileCorpus(tmp_path / "raw"), ByteTokenizer())).next_batch(2, 8)


@pytest.mark.parametrize("make, match", [
    (lambda p: p.mkdir() or p, r"--input '.*nothing' holds no data file"),
    (lambda p: p.with_suffix(".csv").write_text("x") and p.with_suffix(".csv"), r"is not a data file; valid suffixes"),
    (lambda p: gzip.open(p.with_suffix(".jsonl.gz"), "wt").write('{"text": "a"}\n{"text": 1}\n') and
     p.with_suffix(".jsonl.gz"), r"nothing.jsonl.gz line 2: 'text' is a JSON int, not a string"),
    (lambda p: p.with_suffix(".jsonl").write_text("\n\n") and p.with_suffix(".jsonl"), r"the inputs hold no documents"),
])
def test_prepare_bad_input_one_message(tmp_path, capsys, make, match):
    from ulysses_dtensor.prepare_data import main

    path = make(tmp_path / "nothing")
    code = main(["--input", str(path), "--output", str(tmp_path / "store"), "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("data error:") == 1 and re.search(match, err), err
    assert not (tmp_path / "store").exists()


# --------------------------------------------------------------------------- #
# A store the trainer cannot use: one message before training, nothing written
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def byte_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytestore")
    (root / "raw").mkdir()
    (root / "raw" / "docs.jsonl").write_text(_lines(_texts(60)))
    prepare_store([str(root / "raw")], "byte", root / "store", shard_mb=0.004, log=None)
    return root / "store"


def _copy(store: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(store, dst)
    return dst


def _main(argv):
    from ulysses_dtensor.train import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


def _break_manifest(store: Path, **changes) -> None:
    m = json.loads((store / "manifest.json").read_text())
    m.update(changes)
    (store / "manifest.json").write_text(json.dumps(m))


BAD_STORES = {
    "missing shard": (lambda s, t: (s / "shard-00001.tokens").unlink(),
                      r"shard .*shard-00001.tokens is missing \(the manifest lists it with [\d,]+ tokens\)"),
    "truncated shard": (lambda s, t: (s / "shard-00000.tokens").write_bytes((s / "shard-00000.tokens").read_bytes()[:-6]),
                        r"shard .*shard-00000.tokens has [\d,]+ bytes, expected [\d,]+ \([\d,]+ tokens\); it is truncated"),
    "format version": (lambda s, t: _break_manifest(s, version=2),
                       r"manifest.json is format version 2; this ulysses_dtensor reads version 1"),
    "other tokenizer": (lambda s, t: None,
                        r"the store was tokenized with 'byte' \(vocab 258.*this run uses 'tokenizer.json' \(vocab \d+"),
}


@pytest.mark.parametrize("case", list(BAD_STORES))
def test_trainer_refuses_a_bad_store(byte_store, tmp_path, capsys, case):
    breaks, match = BAD_STORES[case]
    store = _copy(byte_store, tmp_path / "store")
    breaks(store, tmp_path)
    extra = []
    if case == "other tokenizer":
        extra = ["--data.tokenizer", str(build_bpe_tokenizer(tmp_path))]
    dump = tmp_path / "dump"
    code = _main(["--config", str(REPO / "train_configs" / "debug_model.toml"), "--parallelism.sp", "1",
                  "--data.path", str(store), "--job.dump_folder", str(dump), "--training.seq_len", "64",
                  "--training.global_batch_size", "2", *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("data error:") == 1 and re.search(match, err), err
    assert str(store) in err and "Traceback" not in err and not dump.exists()


@pytest.mark.parametrize("sources, match", [
    (lambda s, raw: [f"{s}:0.5", f"{raw}:0"],
     r"config error: data.sources\[1\].weight=0.0 \(.*\): every weight must be > 0"),
    (lambda s, raw: [f"{s}:1", f"{raw}:1"], r"data error: data.sources\[1\].path='.*empty.jsonl' holds no documents"),
])
def test_trainer_refuses_bad_mixtures(byte_store, tmp_path, capsys, sources, match):
    raw = tmp_path / "empty.jsonl"
    raw.write_text("\n")
    dump = tmp_path / "dump"
    code = _main(["--config", str(REPO / "train_configs" / "debug_model.toml"), "--parallelism.sp", "1",
                  "--data.path", "", "--data.sources", ",".join(sources(byte_store, raw)),
                  "--job.dump_folder", str(dump), "--training.seq_len", "64"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(match, err), err
    assert not dump.exists()


def test_per_stage_weights_and_upsampling_checked(byte_store):
    from ulysses_dtensor.trainer.config import ConfigError, parse_config

    base = {"context": {"schedule": [{"start_step": 1, "seq_len": 64}, {"start_step": 3, "seq_len": 128}]}}
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight=\[1.0, 2.0, 3.0\] has 3 weights; "
                                          r"context.schedule has 2 stage\(s\)"):
        parse_config({**base, "data": {"sources": [{"path": str(byte_store), "weight": [1, 2, 3]}]}})
    with pytest.raises(ConfigError, match=r"data.sources\[0\].upsample_factor=0.5 must be >= 1"):
        parse_config({**base, "data": {"sources": [{"path": str(byte_store), "upsample_factor": 0.5}]}})
    with pytest.raises(ConfigError, match=r"unknown key 'wieght' in data.sources\[0\] \(did you mean 'weight'"):
        parse_config({**base, "data": {"sources": [{"path": str(byte_store), "wieght": 1}]}})
    cfg = parse_config({**base, "data": {"sources": [{"path": str(byte_store), "weight": [1, 3]}]}})
    assert cfg.data.sources[0].weight_at(1) == 3.0


def test_held_out_split_of_a_store(byte_store):
    """eval.holdout_fraction on a store: a split by document, training never reads a
    held-out document, and the held-out side gives the evaluation's rows."""
    from ulysses_dtensor.data.checks import check_corpus
    from ulysses_dtensor.evaluation.heldout import split_held_out

    store = TokenStore(byte_store)
    train, held = split_held_out(store, 0.25, what="store")
    assert len(train) + len(held) == len(store) and 0 < len(held) < len(store)
    assert set(train.indices.tolist()).isdisjoint(held.indices.tolist())
    assert train.fingerprint() != store.fingerprint() and "heldout-split(fraction=0.25)/train" in train.fingerprint()
    bos = ByteTokenizer().bos_id
    held_starts = {tuple(store.tokens(int(i), 0, 12)) for i in held.indices}
    stream = TokenStream(train, seed=0)
    toks = stream.read(0, 2 * stream.epoch_tokens)[0]  # two epochs of the training side
    starts = np.flatnonzero(toks == bos)
    assert len(starts) == 2 * len(train)
    assert not {tuple(toks[s:s + 12]) for s in starts} & held_starts
    assert check_corpus(held, ByteTokenizer(), 100, described="held") == held.total_tokens()
    rows = TokenStream(held, shuffle=False).take(64)[0]  # the evaluation's loss rows
    first = store.tokens(int(held.indices[0]), 0, 64)
    np.testing.assert_array_equal(rows[:len(first)], first)
