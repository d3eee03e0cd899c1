"""SFT records to tokens and target flags: which tokens are targets under a ChatML
and a Llama-3 style chat template, prompt/completion records, the prepared store
and the raw-file path giving the same tokens and flags, and each bad input's one
message (file and line, or the config key) before training.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_sft_data import conversations, make_tiny_sft_data, write_jsonl  # noqa: E402

pytest.importorskip("tokenizers")

CONV = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi in French."},
    {"role": "assistant", "content": "Salut, ça va ?"},
    {"role": "user", "content": "And 2 plus 2?"},
    {"role": "assistant", "content": "4."},
]}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sftdata")
    return {t: make_tiny_sft_data(root / t, t, n=40) for t in ("chatml", "llama3")}


def _pieces(tok, ids, flags):
    """The decoded text of each run of consecutive targets."""
    runs, cur = [], []
    for i, f in zip(ids, flags):
        if f:
            cur.append(tok._tok.id_to_token(int(i)))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_chat_targets_are_the_assistant_turns(dirs, template):
    from ulysses_dtensor.data.sft import build_renderer

    r = build_renderer("chat", str(dirs[template]))
    ids, flags = r.render("conv line 1", CONV)
    tok = r.tokenizer
    runs = _pieces(tok, ids, flags)
    # one run per assistant turn, each its content then the end-of-turn token
    assert len(runs) == 2
    for run, content in zip(runs, ["Salut, ça va ?", "4."]):
        assert run[-1] == END_OF_TURN[template]
        assert tok._tok.decode([tok._tok.token_to_id(t) for t in run[:-1]]) == content
    # everything else (system, user, role headers, BOS) is context only
    assert int(flags.sum()) == sum(len(run) for run in runs) < len(ids) / 2
    full = r.template.render(CONV["messages"])
    assert np.array_equal(ids, tok.encode_offsets(full)[0])  # the template's text, tokenized whole
    assert r.template.roles == (("system", "user", "assistant", "tool") if template == "chatml"
                                else ("system", "user", "assistant"))


def test_prompt_completion_targets(dirs):
    from ulysses_dtensor.data.sft import build_renderer

    r = build_renderer("prompt_completion", str(dirs["chatml"]))
    tok = r.tokenizer
    ids, flags = r.render("x line 1", {"prompt": "Add 1 and 2.", "completion": " The sum is 3."})
    head, tail = tok.encode("Add 1 and 2.", eos=False), tok.encode(" The sum is 3.", bos=False)
    assert np.array_equal(ids, np.concatenate([head, tail]))
    assert flags.tolist() == [0] * len(head) + [1] * len(tail)  # completion and EOS
    # conversational: only the completion's assistant turn
    ids, flags = r.render("x line 2", {"prompt": CONV["messages"][:4], "completion": CONV["messages"][4:]})
    runs = _pieces(tok, ids, flags)
    assert len(runs) == 1 and runs[0][-1] == "<|im_end|>"


def test_store_and_raw_records_give_the_same_tokens_and_targets(dirs, tmp_path):
    """``prepare_data --format chat`` writes flags and records the format; the raw
    .jsonl rendered at load gives every document the same tokens and flags."""
    from ulysses_dtensor.data import TokenStore
    from ulysses_dtensor.data.sft import RenderedDocs, build_renderer
    from ulysses_dtensor.prepare_data import main as prepare

    folder = dirs["chatml"].parent.parent
    tok = str(dirs["chatml"])
    assert prepare(["--format", "chat", "--input", str(folder / "chat.jsonl"), "--tokenizer", tok,
                    "--output", str(tmp_path / "store"), "--workers", "1"]) == 0
    store = TokenStore(tmp_path / "store")
    assert store.has_targets and store.manifest["renderer"] == "chat"
    raw = RenderedDocs(str(folder / "chat.jsonl"), build_renderer("chat", tok))
    assert len(raw) == len(store) == 40
    for i in range(len(store)):
        n = int(store.lengths_at(np.array([i]))[0])
        assert np.array_equal(store.tokens(i, 0, n), raw.tokens(i, 0, n))
        assert np.array_equal(store.targets(i, 0, n), raw.targets(i, 0, n))
    assert raw.total_tokens() == store.total_tokens()


def _bad(tmp_path, records, name="bad.jsonl"):
    return write_jsonl(tmp_path / name, records)


@pytest.mark.parametrize("fmt, record, match", [
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
     r"bad.jsonl line 2: messages\[1\].role='bot' is not a role the chat template .* valid: system, user, "
     r"assistant, tool"),
    ("chat", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
     r"bad.jsonl line 2: 'messages' has no assistant turn \(roles: system, user\)"),
    ("chat", {"text": "plain"}, r"bad.jsonl line 2 has no 'messages' key .* its keys: 'text'"),
    ("prompt_completion", {"prompt": "Add 1 and 2."},
     r"bad.jsonl line 2 has a 'prompt' but no 'completion'"),
    ("prompt_completion", {"prompt": "Add 1 and 2.", "completion": ""},
     r"bad.jsonl line 2 has a 'prompt' but no 'completion'"),
])
def test_bad_records_stop_prepare_with_file_and_line(dirs, tmp_path, capsys, fmt, record, match):
    from ulysses_dtensor.prepare_data import main as prepare

    good = conversations(1)[0] if fmt == "chat" else {"prompt": "a", "completion": "b"}
    path = _bad(tmp_path, [good, record])
    code = prepare(["--format", fmt, "--input", str(path), "--tokenizer", str(dirs["chatml"]),
                    "--output", str(tmp_path / "store"), "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("data error:") == 1 and re.search(match, err), err


def test_tool_role_refused_where_the_template_has_none(dirs, tmp_path):
    from ulysses_dtensor.data import DataError
    from ulysses_dtensor.data.sft import build_renderer

    r = build_renderer("chat", str(dirs["llama3"]))
    msgs = [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match=r"x line 3: messages\[1\].role='tool' .* valid: system, user, assistant$"):
        r.render("x line 3", {"messages": msgs})


def _train_main(argv, capsys):
    from ulysses_dtensor.train import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


def test_trainer_refuses_before_writing_anything(dirs, tmp_path, capsys):
    """No chat template for a ``messages`` file; a store of another format than
    data.format; a bad record in raw data; chat with the built-in text corpus."""
    folder = dirs["chatml"].parent.parent
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(Path(dirs["chatml"]).read_bytes())
    text_store = tmp_path / "text_store"
    from ulysses_dtensor.data.prepare import prepare_store

    write_jsonl(tmp_path / "t.jsonl", [{"text": "hello there " * 20}] * 8)
    prepare_store([str(tmp_path / "t.jsonl")], str(dirs["chatml"]), text_store, log=None)
    bad = _bad(tmp_path, conversations(3) + [{"messages": [{"role": "user", "content": "hi"}]}])
    dump = tmp_path / "dump"
    base = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--parallelism.sp", "1",
            "--job.dump_folder", str(dump), "--training.steps", "1", "--training.global_batch_size", "2",
            "--context.schedule", "1:64"]
    cases = [
        (["--data.format", "chat", "--data.path", str(folder / "chat.jsonl"),
          "--data.tokenizer", str(bare / "tokenizer.json")],
         r"data error: data.tokenizer='.*bare/tokenizer.json': no chat template in .*bare .* 'messages' records need one"),
        (["--data.format", "chat", "--data.path", str(text_store), "--data.tokenizer", str(dirs["chatml"])],
         r"data error: data.path='.*text_store' is a token store prepared as 'text' .* data.format='chat'"),
        (["--data.format", "chat", "--data.path", str(bad), "--data.tokenizer", str(dirs["chatml"])],
         r"bad.jsonl line 4: 'messages' has no assistant turn"),
        (["--data.format", "chat"], r"config error: data.format='chat' \(from the command line\) reads records"),
        # best-fit rows (the default for chat) refuse samples longer than a row, counted, before anything starts
        (["--data.format", "chat", "--data.path", str(folder / "chat.jsonl"), "--data.tokenizer", str(dirs["chatml"]),
          "--context.schedule", "1:16"],
         r"data error: data.path='.*chat.jsonl': \d+ samples are longer than a row of context.schedule\[0\].seq_len=16 "
         r"tokens \(stage from step 1\), the longest \d+ tokens, and data.overlong='error'"),
        (["--data.packing", "stream", "--data.overlong", "drop"],
         r"config error: data.overlong='drop' \(from the command line\) has no effect: it shapes best-fit packing"),
    ]
    for extra, match in cases:
        code, err = _train_main(base + extra, capsys)
        assert code == 2 and len(re.findall(r"(data|config) error:", err)) == 1 and re.search(match, err), err
        assert "Traceback" not in err and not dump.exists()
