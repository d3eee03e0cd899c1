"""Unusable data stops a run before it starts, with one message naming file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from distributed import run_ranks

from ulysses_dtensor.data import ByteTokenizer, FileCorpus, StdlibCorpus
from ulysses_dtensor.data.checks import DataError, check_corpus

REPO = Path(__file__).resolve().parents[1]


def _check(path, need=10, text_key="text"):
    return check_corpus(FileCorpus(path, text_key=text_key), ByteTokenizer(), need, described="test")


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("lines, match", [
    (['{"text": "fine"}', "", '{"txt": "a", "id": 3}'], r"bad.jsonl line 3 has no 'text' key .*'txt', 'id'"),
    (['{"text": "fine"}', '["text", "x"]'], r"bad.jsonl line 2 is a JSON list, not an object"),
    (['{"text": "fine"}', '{"text": 5}'], r"bad.jsonl line 2: 'text' is a JSON int, not a string"),
    (['{"text": "fine"', '{"text": "x"}'], r"bad.jsonl line 1 is not valid JSON"),
    (['{"text": ""}', '{"text": "  "}'], r"bad.jsonl has no usable text: its 2 records have empty 'text'"),
])
def test_jsonl_problems_name_file_and_line(tmp_path, lines, match):
    with pytest.raises(DataError, match=match) as info:
        _check(_jsonl(tmp_path / "bad.jsonl", lines))
    assert "\n" not in str(info.value)


def test_txt_and_corpus_problems(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    with pytest.raises(DataError, match=r"empty.txt has no usable text"):
        _check(empty)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt is not UTF-8 text \(undecodable bytes at offset 3"):
        _check(latin)
    bad_line = tmp_path / "mixed.jsonl"
    bad_line.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"mixed.jsonl line 2 is not UTF-8"):
        _check(bad_line)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(DataError, match=r"holds no documents"):
        FileCorpus(blank)
    # Smaller than one step: says how many tokens it has and needs.
    small = _jsonl(tmp_path / "small.jsonl", ['{"text": "abc"}', '{"text": "defg"}'])
    with pytest.raises(DataError, match=r"only 11 tokens in 2 documents \(tokenizer byte\), less than the 12 tokens"):
        _check(small, need=12)
    assert _check(small, need=11) == 11
    # A directory: every file is checked, the bad one named.
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("good text")
    (tmp_path / "dir" / "b.txt").write_text("")
    with pytest.raises(DataError, match=r"b.txt has no usable text"):
        _check(tmp_path / "dir")
    # The built-in corpus passes, counting only up to what a step needs.
    assert 5000 <= check_corpus(StdlibCorpus(max_bytes=1 << 20), ByteTokenizer(), 5000, described="x") < 10**6


def _main(argv):
    from ulysses_dtensor.train import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


@pytest.mark.parametrize("content, match", [
    ("", "empty.txt has no usable text"),
    ('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n', "data.jsonl line 3 has no 'text' key"),
    ('{"text": "just a few words"}\n', r"only 18 tokens in 1 documents .* less than the 256 tokens"),
])
def test_trainer_stops_before_writing_anything(tmp_path, capsys, content, match):
    name = "empty.txt" if not content else "data.jsonl"
    data = tmp_path / name
    data.write_text(content)
    dump = tmp_path / "dump"
    code = _main(["--config", str(REPO / "train_configs" / "debug_model.toml"),
                  "--parallelism.sp", "1", "--data.path", str(data), "--job.dump_folder", str(dump),
                  "--training.seq_len", "128", "--training.global_batch_size", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("data error:") == 1 and re.search(match, err), err
    assert "Traceback" not in err and not dump.exists()


def _ranks_worker(rank, world, argv):
    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import train

    try:
        train(load_config(argv))
    except DataError as e:
        return str(e)
    return None


def test_every_rank_gets_rank_zeros_verdict(tmp_path):
    data = _jsonl(tmp_path / "data.jsonl", ['{"text": "a"}', "[1, 2]"])
    dump = tmp_path / "dump"
    argv = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--data.path", str(data),
            "--job.dump_folder", str(dump), "--training.seq_len", "64", "--training.global_batch_size", "2"]
    verdicts = run_ranks(2, _ranks_worker, argv)
    assert verdicts[0] == verdicts[1] and "data.jsonl line 2 is a JSON list" in verdicts[0]
    assert not dump.exists()
