"""A known error reaches the user once per node, whichever rank exits first (issue 47).

Under torchrun the agent stops the other workers as soon as one exits: before, the
message of a config error was printed by local rank 0 only, and lost whenever another
rank exited first (3 launches of 4). Now the first rank of a node to reach the error
claims the report (runtime/node_report.py) and prints it with SIGTERM held.

The launches force the exit order with the test hook ``ULYSSES_DTENSOR_TEST_REPORT_ORDER``
(``late:R``: rank R gets there last and torchrun stops it; ``silent:R``: rank R exits
first, silently, and the agent's SIGTERM reaches the reporter before it writes), under a
real ``torchrun --standalone --nproc_per_node=2``. Per entry point, rank 0 exits first
in one attempt and rank 1 in another:

===============  =======  =========  ========  ===========  ===================================
launch           attempt  order      reporter  exits first  error
===============  =======  =========  ========  ===========  ===================================
train            0        late:0     1         1            the issue's mistyped key
(max_restarts 1) 1        late:1     0         0            the same: the note of a repeat
eval             0        silent:0   1         0 (silent)   no checkpoint at --checkpoint
eval             0        silent:1   0         1 (silent)   a data.path that does not exist
trainer script   0        late:0     1         1            weights that differ between ranks
trainer script   0        silent:0   1         0 (silent)   UlyssesArguments refused
===============  =======  =========  ========  ===========  ===================================

The five launch together (each rank imports torch, the weights script's transformers
too); the claim itself, the SIGTERM hold, other nodes, one process and the trainer's
excepthook are unit tests in the quick tier.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ulysses_dtensor.runtime.node_report import CLAIM_FILE, ORDER_ENV, report_once_per_node

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
TRAIN = ["-m", "ulysses_dtensor.train", "--config", str(REPO / "train_configs" / "debug_model.toml")]
EVAL = ["-m", "ulysses_dtensor.eval", "--config", str(REPO / "train_configs" / "debug_eval.toml")]
SCRIPT = [str(REPO / "tests" / "trainer_error_script.py")]

STEPZ = r"config error: unknown config key training\.stepz \(did you mean 'training\.steps'\?\)"
REPEAT = r"\(torchrun restart 1 of 1 ended with the same config error as an earlier attempt, shown above\)"

# name: (torchrun's command, the worker's exit status, per attempt: (order, the rank that reports, its line))
LAUNCHES = {
    "train": (TRAIN + ["--training.stepz", "3"], 2, [("late:0", 1, STEPZ), ("late:1", 0, REPEAT)]),
    "eval_rank0_first": (EVAL + ["--checkpoint", "/no/such/checkpoint"], 2, [
        ("silent:0", 1, r"config error: no complete checkpoint at '/no/such/checkpoint'")]),
    "eval_rank1_first": (EVAL + ["--data.path", "/no/such/corpus.txt"], 2, [
        ("silent:1", 0, r"config error: data\.path='/no/such/corpus\.txt' .*does not exist")]),
    "trainer_rank1_first": (SCRIPT + ["weights"], 1, [
        ("late:0", 1, r"UlyssesHFTrainer error: the model's weights differ between ranks \(first: "
                      r"model\.embed_tokens\.weight\)")]),
    "trainer_rank0_first": (SCRIPT + ["arguments"], 1, [
        ("silent:0", 1, r"UlyssesHFTrainer error: UlyssesArguments\.ring_size=3 must divide sp_size=2")]),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every launch at once: {name: (torchrun's status, stderr, {attempt: its claim file's text})}."""
    root = tmp_path_factory.mktemp("known_errors")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = {}
    try:
        for name, (command, _, attempts) in LAUNCHES.items():
            folder = root / name
            folder.mkdir()
            script_out = [str(folder / "out")] if command[0] == SCRIPT[0] else []  # the Trainer's output_dir
            with open(folder / "stderr", "w") as err:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                     f"--max_restarts={len(attempts) - 1}", "--log-dir", str(folder / "logs"), *command, *script_out],
                    cwd=folder, env={**env, ORDER_ENV: ",".join(a[0] for a in attempts)},
                    stdout=subprocess.DEVNULL, stderr=err)
        codes = {name: proc.wait(timeout=TIMEOUT_S) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return {name: (codes[name], (root / name / "stderr").read_text(),
                   {int(p.parent.name.split("_")[1]): p.read_text()
                    for p in (root / name / "logs").glob(f"*/attempt_*/{CLAIM_FILE}")})
            for name in LAUNCHES}


def _summary(err: str) -> dict[int, int]:
    """torchrun's failure summary: {rank: exit code}, the root cause (first to fail) first."""
    failures = err[err.index("Failures:"):err.index("Root Cause")]
    root = err[err.index("Root Cause"):]
    pairs = []
    for block in (root, failures):
        pairs += [(int(r), int(c)) for r, c in re.findall(r"rank\s*: (\d+) .*?exitcode\s*: (-?\d+)", block, re.S)]
    return dict(pairs)


def _check(launches, name: str) -> None:
    command, status, attempts = LAUNCHES[name]
    code, err, claims = launches[name]
    assert code == 1, err[-3000:]  # torchrun's own status when a worker failed
    for attempt, (order, reporter, line) in enumerate(attempts):
        assert len(re.findall(line, err)) == 1, (attempt, err[-3000:])
        assert claims[attempt].startswith(f"rank {reporter} "), (attempt, claims)
    # No worker traceback: the one there is torchrun's ChildFailedError summary.
    assert err.count("Traceback (most recent call last)") == 1, err[-3000:]
    # torchrun's summary: the last attempt's exit codes, the first to fail first.
    order, reporter, line = attempts[-1]
    mode, chosen = order.split(":")
    exits = _summary(err)
    first = next(iter(exits))
    if mode == "late":  # the reporter exits first; torchrun stops the late rank
        assert (first, exits) == (reporter, {reporter: status, int(chosen): -signal.SIGTERM}), err[-3000:]
    else:  # the silent rank exits first; the reporter, SIGTERM'd while it reports, still writes and exits
        assert (first, exits) == (int(chosen), {int(chosen): status, reporter: status}), err[-3000:]
        assert err.index("closing signal SIGTERM") < re.search(line, err).start(), err[-3000:]


def test_train_entry_reports_once_whichever_rank_exits_first(launches):
    _check(launches, "train")


def test_eval_entry_reports_once_whichever_rank_exits_first(launches):
    _check(launches, "eval_rank0_first")
    _check(launches, "eval_rank1_first")


def test_ulysses_trainer_script_reports_once_whichever_rank_exits_first(launches):
    _check(launches, "trainer_rank1_first")
    _check(launches, "trainer_rank0_first")


# -- the mechanism, in one process (quick tier) --------------------------------------------------


def _torchrun_env(monkeypatch, run: Path, attempt: int, local_rank: int) -> None:
    """The variables torchrun gives a worker (its agent's log folder: <run>/attempt_<k>/<local rank>/)."""
    (run / f"attempt_{attempt}" / str(local_rank)).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(run / f"attempt_{attempt}" / str(local_rank) / "error.json"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("RANK", str(local_rank))


def test_one_rank_per_node_and_attempt_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(ORDER_ENV, raising=False)
    # Eight ranks of one node reach the error at once (threads: the claim is one O_EXCL open).
    _torchrun_env(monkeypatch, tmp_path / "node0", 0, 0)
    shown = []
    threads = [threading.Thread(target=lambda: shown.append(report_once_per_node("config error", "bad key")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(shown) == [False] * 7 + [True]
    assert capsys.readouterr().err == "config error: bad key\n"
    assert not report_once_per_node("config error", "bad key")  # a rank that comes later: silent
    # Another node (its own agent, its own run folder): its own message.
    _torchrun_env(monkeypatch, tmp_path / "node1", 0, 1)
    assert report_once_per_node("config error", "bad key")
    # A restart of the first node: its first rank reports, a note, not the message again.
    _torchrun_env(monkeypatch, tmp_path / "node0", 1, 1)
    assert report_once_per_node("config error", "bad key")
    assert not report_once_per_node("config error", "bad key")
    assert capsys.readouterr().err.splitlines() == [
        "config error: bad key",
        "(torchrun restart 1 of 1 ended with the same config error as an earlier attempt, shown above)",
    ]
    # Without torchrun's folder (one process, another launcher, --log-dir /dev/null): every call prints.
    for error_file in ("", None):
        if error_file is None:
            monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
        else:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", error_file)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        assert report_once_per_node("data error", "x") and report_once_per_node("data error", "x")
        assert capsys.readouterr().err == "data error: x\n" * 2


def test_sigterm_while_reporting_waits_for_the_message(tmp_path, monkeypatch, capsys):
    """torchrun's SIGTERM reaches the reporter between its claim and its message (the hook
    holds it there until it does): the message is written, then the handler is back."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        _torchrun_env(monkeypatch, tmp_path / "run", 0, 0)
        monkeypatch.setenv(ORDER_ENV, "silent:1")  # rank 0 reports once SIGTERM has come
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert report_once_per_node("checkpoint error", "step-3 cannot be loaded")
        assert capsys.readouterr().err == "checkpoint error: step-3 cannot be loaded\n"
        assert received == []  # held by the report, not passed on
        os.kill(os.getpid(), signal.SIGTERM)  # and afterwards the handler before it is back
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("kind", ["config", "data", "checkpoint", "peer"])
def test_known_errors_exit_with_one_message_and_their_status(kind, monkeypatch, capsys):
    from ulysses_dtensor.data import DataError
    from ulysses_dtensor.runtime.lost_peer import PeerLostError
    from ulysses_dtensor.trainer.checkpoint import CheckpointError
    from ulysses_dtensor.trainer.config_schema import ConfigError
    from ulysses_dtensor.trainer.known_errors import exit_on_known_error

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    error, line, status = {
        "config": (ConfigError("training.steps=0 must be >= 1"), "config error: training.steps=0 must be >= 1", 2),
        "data": (DataError("x.jsonl line 2: not JSON"), "data error: x.jsonl line 2: not JSON", 2),
        "checkpoint": (CheckpointError("step-3 cannot be loaded"), "checkpoint error: step-3 cannot be loaded", 2),
        "peer": (PeerLostError("step 4: all_reduce timed out"), "step 4: all_reduce timed out", 1),
    }[kind]
    with pytest.raises(SystemExit) as info:
        with exit_on_known_error():
            raise error
    assert info.value.code == status
    assert capsys.readouterr().err == line + "\n"


def test_an_uncaught_ulysses_trainer_error_is_one_line_and_others_keep_their_traceback(monkeypatch, capsys):
    from ulysses_dtensor.integrations.hf.ulysses_trainer import refusals
    from ulysses_dtensor.integrations.hf.ulysses_trainer.refusals import UlyssesTrainerError

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc[1]))
    monkeypatch.setattr(refusals, "_previous_hook", None)
    refusal = UlyssesTrainerError("TrainingArguments.fp16=True is not supported by UlyssesHFTrainer: use bf16")
    assert isinstance(refusal, ValueError) and sys.excepthook is refusals._report_hook  # installed by the first one
    sys.excepthook(UlyssesTrainerError, refusal, None)
    other = RuntimeError("a bug")
    sys.excepthook(RuntimeError, other, None)
    assert seen == [other]  # the hook before it, as before
    assert capsys.readouterr().err == ("UlyssesHFTrainer error: TrainingArguments.fp16=True is not supported by "
                                       "UlyssesHFTrainer: use bf16\n")


def test_a_checkpoint_the_trainer_cannot_resume_from_is_one_line():
    from torch.distributed.checkpoint.api import CheckpointException

    from ulysses_dtensor.integrations.hf.ulysses_trainer.checkpoints import _resuming
    from ulysses_dtensor.integrations.hf.ulysses_trainer.refusals import UlyssesTrainerError
    from ulysses_dtensor.models.llama_checkpoint import HFCheckpointError

    with pytest.raises(UlyssesTrainerError, match=r"^ck cannot be resumed: HFCheckpointError: ck lacks lm_head$"):
        with _resuming("ck"):
            raise HFCheckpointError("ck lacks lm_head")
    # DCP's exception holds each failing rank's exception and traceback: the first rank's first line.
    failures = {1: (FileNotFoundError("no .metadata\nmore"), "traceback"), 0: (OSError("disk"), "traceback")}
    with pytest.raises(UlyssesTrainerError, match=r"^ck cannot be resumed: OSError: disk$"):
        with _resuming("ck"):
            raise CheckpointException("load failed", failures)
