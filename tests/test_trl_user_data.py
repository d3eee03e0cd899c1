"""The example scripts train on the user's data and reward (``--dataset``, ``--reward``).

``ulysses_dtensor.integrations.trl.user_data`` reads every format (JSON Lines, JSON,
Parquet, a ``save_to_disk`` folder; text and chat messages) into the rows written, and
refuses what cannot be used with one message (checked word for word); reward functions
load from ``FILE.py:FUNCTION``. Then one real run per RL example on sp 2 (2 gloo ranks):
GRPO on a user's prompts with a user's reward file, whose calls are recorded and whose
values are the logged rewards; DPO on a user's pairs, every row of them and nothing else.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("transformers", "trl", "datasets", "pyarrow")):
    pytest.skip("needs the trl extra", allow_module_level=True)

from distributed import run_ranks  # noqa: E402
from script_module import load_script  # noqa: E402

from ulysses_dtensor.integrations.trl.user_data import (  # noqa: E402
    UserDataError,
    load_reward,
    load_rewards,
    read_dataset,
)

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ".jsonl, .json, .parquet or a folder saved with Dataset.save_to_disk"
CHAT = [{"role": "user", "content": "Name a colour."}]
PAIRS = [  # text; CHAT_PAIRS: chat messages in every column (TRL does not mix the two in a row)
    {"prompt": "Two and two:", "chosen": " four", "rejected": " five or so"},
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " a lid"},
]
CHAT_PAIRS = [{"prompt": CHAT, "chosen": [{"role": "assistant", "content": c}],
               "rejected": [{"role": "assistant", "content": r}]} for c, r in (("Red.", "No."), ("Teal.", "42"))]


def write(path: Path, rows: list[dict], how: str) -> Path:
    from datasets import Dataset, DatasetDict

    if how == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif how == "json":
        path.write_text(json.dumps(rows))
    elif how == "json columns":
        path.write_text(json.dumps({k: [r[k] for r in rows] for k in rows[0]}))
    elif how == "parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    elif how == "save_to_disk":
        Dataset.from_list(rows).save_to_disk(str(path))
    elif how == "save_to_disk splits":
        DatasetDict(train=Dataset.from_list(rows), test=Dataset.from_list(rows[:1])).save_to_disk(str(path))
    return path


def refusal(path, trainer: str = "DPO", **kw) -> str:
    with pytest.raises(UserDataError) as e:
        read_dataset(str(path), trainer, **kw)
    return str(e.value)


# -- reading --------------------------------------------------------------------------------------


def test_every_format_reads_the_rows_written_text_and_messages(tmp_path):
    cases = [("a.jsonl", "jsonl", PAIRS), ("b.jsonl", "jsonl", CHAT_PAIRS), ("c.json", "json", CHAT_PAIRS),
             ("d.json", "json columns", PAIRS), ("e.json", "jsonl", PAIRS),  # HF's .json files are often JSON Lines
             ("f.parquet", "parquet", CHAT_PAIRS), ("g", "save_to_disk", PAIRS),
             ("h", "save_to_disk splits", CHAT_PAIRS)]  # the 'train' split
    for name, how, rows in cases:
        got = read_dataset(str(write(tmp_path / name, rows, how)), "DPO")
        assert got.to_list() == rows, (name, got.to_list())
    prompts = read_dataset(str(write(tmp_path / "p.jsonl", [{"prompt": CHAT, "answer": 3}], "jsonl")), "GRPO")
    assert prompts.to_list() == [{"prompt": CHAT, "answer": 3}]  # other columns stay (GRPO's reward kwargs)
    # SFT takes any of TRL's layouts, and the text column SFTConfig names.
    for rows in ([{"messages": CHAT}], [{"prompt": "a", "completion": "b"}], [{"text": "abc"}]):
        assert read_dataset(str(write(tmp_path / "s.jsonl", rows, "jsonl")), "SFT").to_list() == rows
    assert len(read_dataset(str(write(tmp_path / "t.jsonl", [{"body": "x"}], "jsonl")), "SFT",
                            text_column="body")) == 1


def test_what_cannot_be_used_is_refused_in_one_message(tmp_path):
    d = tmp_path
    pairs = write(d / "pairs.jsonl", [{"prompt": "a", "chosen": "b"}], "jsonl")
    assert refusal(pairs) == (f"--dataset {pairs} has no column 'rejected'; found: prompt, chosen; "
                              f"DPO needs prompt, chosen, rejected")
    only = write(d / "only.parquet", [{"prompt": "a", "score": 1}], "parquet")
    assert refusal(only) == (f"--dataset {only} has no columns 'chosen', 'rejected'; found: prompt, score; "
                             f"DPO needs prompt, chosen, rejected")
    body = write(d / "body", [{"body": "x", "title": "y"}], "save_to_disk")
    assert refusal(body, "SFT") == (f"--dataset {body} has none of the columns SFT reads; found: body, title; "
                                    f"SFT needs messages, or prompt and completion, or text")
    half = write(d / "half.json", [{"prompt": "a", "id": 1}], "json")
    assert refusal(half, "SFT") == (f"--dataset {half} has no column 'completion'; found: prompt, id; "
                                    f"SFT needs messages, or prompt and completion, or text")
    assert refusal(write(d / "q.jsonl", [{"query": "a"}], "jsonl"), "GRPO") == (
        f"--dataset {d / 'q.jsonl'} has no column 'prompt'; found: query; GRPO needs prompt")
    # Formats, paths, empty files.
    (d / "pairs.csv").write_text("prompt,chosen,rejected\na,b,c\n")
    assert refusal(d / "pairs.csv") == f"--dataset {d / 'pairs.csv'}: unknown format '.csv'; give {FORMATS}"
    assert refusal(d / "nowhere.jsonl") == f"--dataset {d / 'nowhere.jsonl'}: no such file or folder; give {FORMATS}"
    (d / "plain").mkdir()
    (d / "plain" / "x.jsonl").write_text("{}\n")
    assert refusal(d / "plain") == (f"--dataset {d / 'plain'} is a folder not saved with Dataset.save_to_disk; "
                                    f"give {FORMATS}")
    for name, text in (("empty.jsonl", ""), ("blank.json", "\n \n"), ("none.json", "[]")):
        (d / name).write_text(text)
        assert refusal(d / name) == f"--dataset {d / name} has no rows"
    # Values: the right kind in every row.
    ints = write(d / "ints.jsonl", [{"prompt": 1}], "jsonl")
    assert refusal(ints, "GRPO") == (f"--dataset {ints} column 'prompt' holds int64; GRPO reads text or chat "
                                     f"messages there (chat messages: a list of {{role, content}})")
    chat_text = write(d / "chat.jsonl", [{"text": CHAT}], "jsonl")
    assert refusal(chat_text, "Trainer").startswith(f"--dataset {chat_text} column 'text' holds list<item: struct<")
    holes = write(d / "holes.jsonl", [PAIRS[0], {"prompt": "x", "chosen": "y"}, PAIRS[1]], "jsonl")
    assert refusal(holes) == f"--dataset {holes} has no 'rejected' in 1 of 3 rows (the first: row 1)"
    (d / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    assert refusal(d / "bad.jsonl").startswith(f"--dataset {d / 'bad.jsonl'} is not JSON Lines (one object per "
                                               f"line): JSON parse error")
    splits = d / "splits"
    from datasets import Dataset, DatasetDict

    DatasetDict(a=Dataset.from_list(PAIRS), b=Dataset.from_list(PAIRS)).save_to_disk(str(splits))
    assert refusal(splits) == f"--dataset {splits} holds the splits a, b and none is 'train'; save the one to train on"


def test_an_uncaught_refusal_ends_the_script_with_its_message_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)  # outside torchrun every rank reports
    error = UserDataError("--dataset /x has no rows")  # creating one installs the hook
    sys.excepthook(UserDataError, error, None)
    assert capsys.readouterr().err == "--dataset /x has no rows\n"


# -- reward functions -------------------------------------------------------------------------------

REWARDS = '''
RUNS = globals().get("RUNS", 0) + 1


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def first_letter(completions, *, trainer_state=None, **kwargs):
    return [float(c[:1] == "a") for c in completions]


def positional(prompts, completions):
    return [0.0 for _ in completions]


NOT_A_FUNCTION = 3
'''


def test_reward_functions_load_from_a_file_and_bad_names_are_refused(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    length, first = load_rewards([[f"{path}:length_reward"], [f"{path}:first_letter"]])  # --reward given twice
    assert length(prompts=["p", "q"], completions=["ab", "c"]) == [2.0, 1.0]
    assert first(prompts=["p"], completions=["abc"], completion_ids=[[1]]) == [1.0]
    assert sys.modules[length.__module__].RUNS == 1  # the file ran once for both
    assert load_reward(f"{path}:length_reward") is length

    def refused(spec: str) -> str:
        with pytest.raises(UserDataError) as e:
            load_reward(spec)
        return str(e.value)

    assert refused("my_rewards.py") == ("--reward my_rewards.py: expected FILE.py:FUNCTION, e.g. "
                                        "my_rewards.py:length_reward")
    assert refused(f"{tmp_path}/gone.py:f") == f"--reward {tmp_path}/gone.py:f: no file {tmp_path / 'gone.py'}"
    assert refused(f"{path}:missing") == (f"--reward {path}:missing: {path} has no function 'missing' (it defines: "
                                          f"first_letter, length_reward, positional)")
    assert refused(f"{path}:NOT_A_FUNCTION") == f"--reward {path}:NOT_A_FUNCTION: NOT_A_FUNCTION in {path} is a int, " \
                                                f"not a function"
    assert refused(f"{path}:positional") == (f"--reward {path}:positional: positional(prompts, completions) must "
                                             f"take completions and **kwargs: TRL calls f(prompts=, completions=, "
                                             f"completion_ids=, **columns) -> list[float]")
    (tmp_path / "rewards.txt").write_text(REWARDS)
    assert refused(f"{tmp_path}/rewards.txt:length_reward") == (f"--reward {tmp_path}/rewards.txt:length_reward: "
                                                                f"{tmp_path / 'rewards.txt'} is not a .py file")


# -- one real run of each RL example on the user's data ----------------------------------------------

USER_REWARD = '''
import json
import os


def length_reward(prompts, completions, target, **kwargs):
    """The user's reward (the completion's length in characters); each call recorded."""
    values = [float(len(c)) for c in completions]
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "prompts": prompts, "target": target, "values": values}) + "\\n")
    return values
'''
USER_PROMPTS = [{"prompt": f"Count to {n}:", "target": n} for n in (3, 5, 7, 9)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from test_hf_trainer import write_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "llama"
    write_tiny_model(out, "llama")
    return out


def _script_runs(rank: int, world: int, script: str, bad_argv: list[str], argv: list[str]) -> dict:
    """The script refusing ``bad_argv`` (before any model loads), then training on ``argv``;
    the trainer the run made is kept for the test to read."""
    from test_hf_trainer import script_run

    module = load_script(script)
    name = next(n for n in ("UlyssesGRPOTrainer", "UlyssesDPOTrainer") if hasattr(module, n))
    made = []

    class Recording(getattr(module, name)):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    setattr(module, name, Recording)
    with script_run():
        try:
            module.main(bad_argv)
            refused = None
        except UserDataError as e:
            refused = str(e)
        result = module.main(argv)
    trainer = made[0]
    result["rows"] = [trainer.processing_class.decode(ids) for ids in trainer.train_dataset["prompt_ids"]] \
        if "prompt_ids" in trainer.train_dataset.column_names else len(trainer.train_dataset)
    return {"refused": refused, "made": len(made), **result}


def _argv(model: Path, out: Path, *flags: str) -> list[str]:
    """The command line docs/rl-and-preference.md shows, with a test's quiet settings."""
    return ["--model_dir", str(model), "--output_dir", str(out), "--use_cpu", "--bf16", "false", "--sp_size", "2",
            "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true",
            "--save_strategy", "no", "--seed", "7", *flags]


def test_grpo_trains_on_user_prompts_with_user_reward(tiny_llama, tmp_path):
    prompts = write(tmp_path / "prompts.jsonl", USER_PROMPTS, "jsonl")
    (tmp_path / "my_rewards.py").write_text(USER_REWARD)
    grpo = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8"]
    argv = _argv(tiny_llama, tmp_path / "out", "--dataset", str(prompts), "--reward",
                 f"{tmp_path / 'my_rewards.py'}:length_reward", *grpo)
    bad = _argv(tiny_llama, tmp_path / "bad", "--dataset", str(prompts), *grpo)  # the toy reward is not for it
    results = run_ranks(2, _script_runs, str(ROOT / "scripts" / "example_trl_grpo.py"), bad, argv)
    ours = results[0]
    assert ours["refused"] == (f"--dataset {prompts} needs --reward FILE.py:FUNCTION (the toy reward is for the "
                               f"toy data)")
    assert ours["made"] == 1  # the refusal came before any trainer
    # Each sp rank scored its share of each step's 4 completions, in step order: the logged reward
    # is the mean of the user's function's values, and the dataset's other column reached it.
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    by_rank = [[c for c in calls if c["pid"] == pid] for pid in sorted({c["pid"] for c in calls})]
    assert len(by_rank) == 2 and all(len(mine) == 2 for mine in by_rank), calls
    targets = {row["prompt"]: row["target"] for row in USER_PROMPTS}
    for c in calls:
        assert [targets[p] for p in c["prompts"]] == c["target"]
    assert sorted({p for c in calls for p in c["prompts"]}) == sorted(targets)  # one epoch: every prompt
    for step in (1, 2):
        values = [v for mine in by_rank for v in mine[step - 1]["values"]]
        log = ours["logs"][step]
        assert len(values) == 4
        assert log["reward"] == pytest.approx(sum(values) / 4, rel=1e-6)
        assert log["rewards/length_reward/mean"] == pytest.approx(sum(values) / 4, rel=1e-6)
        assert math.isfinite(log["loss"])
    assert [results[1]["logs"][s]["reward"] for s in (1, 2)] == [ours["logs"][s]["reward"] for s in (1, 2)]


def test_dpo_trains_on_exactly_the_user_pairs(tiny_llama, tmp_path):
    rows = PAIRS + [{"prompt": "Water is", "chosen": " wet.", "rejected": " dry, mostly"},
                    {"prompt": "One more:", "chosen": " two", "rejected": " zero"}]
    pairs = write(tmp_path / "pairs.jsonl", rows, "jsonl")
    half = write(tmp_path / "half.jsonl", [{"prompt": "a", "chosen": "b"}], "jsonl")
    dpo = ["--per_device_train_batch_size", "2"]
    argv = _argv(tiny_llama, tmp_path / "out", "--dataset", str(pairs), *dpo)
    results = run_ranks(2, _script_runs, str(ROOT / "scripts" / "example_trl_dpo.py"),
                        _argv(tiny_llama, tmp_path / "bad", "--dataset", str(half), *dpo), argv)
    ours = results[0]
    assert ours["refused"] == (f"--dataset {half} has no column 'rejected'; found: prompt, chosen; "
                               f"DPO needs prompt, chosen, rejected")
    # The trainer's dataset is the user's rows, in order, and 2 steps of 2 pairs were one epoch of it.
    assert ours["rows"] == [r["prompt"] for r in rows]
    assert ours["logs"][2]["epoch"] == 1.0
    assert all(math.isfinite(e["loss"]) for e in ours["logs"].values())
    assert [e["loss"] for e in results[1]["logs"].values()] == [e["loss"] for e in ours["logs"].values()]
