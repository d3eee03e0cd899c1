"""torchrun restarts resume by themselves, a lost node fails fast, nothing is lost or doubled.

Real launches through the documented launchers, on CPU (gloo): the debug model,
8 steps, checkpoints at steps 3, 6 and 8, a stage change (64 -> 128 tokens) at
step 5, 4 ranks as sp 4 = ring 2 x ulysses 2 (the mesh of the issue's two-agent
job):

* two agents on this machine, ``scripts/multinode_torchrun.sh`` twice (NNODES=2,
  c10d rendezvous on 127.0.0.1, 2 ranks each, MAX_RESTARTS=1): rank 2 SIGKILLs
  itself after step 5; both nodes restart, resume from step 3 and train through
  the stage change again;
* a restart loop that cannot succeed: ``scripts/run_train.sh`` (one node, 2
  ranks, MAX_RESTARTS=1) on a checkpoint that cannot be loaded: the one-node
  launcher restarts too, and the cause is shown once.

The two run side by side (their own ports and folders), after the uninterrupted
reference trained on the test's pool of 4 gloo ranks (the same job; bit-identical
to a torchrun launch of it). The restarted run must log every step once, each row
equal to the reference's in every field but the wall clock (loss, gradient norm,
lr, sequence length, rope, tokens seen: exactly), and mark the row where it resumed.
(A one-node restart that resumed ran here too until 2026-11-26: the same trainer
code behind another launcher, for 5 worker starts of CPU; the broken-checkpoint
job keeps that launcher's restart path.)

Then, alone because it measures time, a node lost with restarts off: two agents
of one rank each; rank 1 freezes (SIGSTOP: alive, connections open, silent, as
a node off the network) after step 3, and rank 0 must exit non-zero within
``comm.train_timeout_seconds`` plus a margin, with one line naming step 4, the
collective and the lost peer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from distributed import run_ranks

from ulysses_dtensor.trainer.fault_injection import FAULT_ENV

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
JOB_TIMEOUT_S = 300


def _args(dump: Path, *extra: str, checkpoints: bool = True) -> list[str]:
    ckpt = ["--checkpoint.interval", "3"] if checkpoints else ["--checkpoint.enable", "false"]
    return [
        "--config", str(REPO / "train_configs" / "debug_model.toml"),
        "--job.dump_folder", str(dump),
        "--training.steps", str(STEPS),
        "--training.global_batch_size", "4",
        "--context.schedule", "1:64,5:128",
        "--lr_scheduler.warmup_steps", "2",
        *ckpt,
        "--parallelism.dp_shard", "1", "--parallelism.sp", "4", "--parallelism.ring", "2",
        "--data.max_corpus_mb", "0.5",
        "--metrics.log_freq", "1",
        *extra,
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


@dataclass
class Job:
    """Launched torchrun agents (one per node) and their output files."""

    dump: Path
    procs: list = field(default_factory=list)
    logs: list = field(default_factory=list)

    def launch(self, cmd: list[str], env: dict) -> subprocess.Popen:
        i = len(self.procs)
        out, err = (open(self.dump.parent / f"{self.dump.name}-{i}.{k}", "w") for k in ("out", "err"))
        self.logs.append((out.name, err.name))
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        out.close(), err.close()
        self.procs.append(proc)
        return proc

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]

    def stop(self) -> None:
        """Agents still running (a failed test): SIGTERM makes an agent stop its workers."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()

    def text(self, kind: str) -> str:
        return "".join(Path(log[0 if kind == "out" else 1]).read_text() for log in self.logs)

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in open(self.dump / "metrics.jsonl")]

    def fired(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.dump.glob("test_fault-*"))]


def _two_agents(root: Path, name: str, fault: str, *, nproc: int, restarts: int, extra=(),
                checkpoints: bool = True) -> Job:
    job = Job(root / name)
    job.dump.mkdir()
    env = _env(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RDZV_ID=name,
               NPROC_PER_NODE=str(nproc), MAX_RESTARTS=str(restarts), **{FAULT_ENV: fault})
    for _ in range(2):
        job.launch(["bash", str(REPO / "scripts" / "multinode_torchrun.sh"),
                    *_args(job.dump, *extra, checkpoints=checkpoints)], env)
    return job


def _broken_checkpoint(root: Path) -> Job:
    """A complete-looking step-3 checkpoint whose DCP metadata is not readable."""
    job = Job(root / "broken")
    step = job.dump / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"not a pickle")
    (step / "train_state.json").write_text('{"step": 3}')
    (step / "COMPLETE").write_text("step 3\n")
    job.launch(["bash", str(REPO / "scripts" / "run_train.sh"),
                *_args(job.dump, "--parallelism.sp", "2", "--parallelism.ring", "1")],
               _env(NPROC="2", MAX_RESTARTS="1"))
    return job


def _reference_worker(rank: int, world: int, argv: list[str]) -> None:
    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import train

    train(load_config(argv))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("restarts")
    jobs = {}
    # First: the pools may have to start (they do once per session).
    run_ranks(4, _reference_worker, _args(root / "reference", checkpoints=False))
    try:
        jobs["two_agents"] = _two_agents(root, "two_agents", "KILL:2:5", nproc=2, restarts=1)
        jobs["broken"] = _broken_checkpoint(root)
        codes = {name: job.wait() for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.stop()
    ref = [json.loads(line) for line in open(root / "reference" / "metrics.jsonl")]
    return jobs, codes, ref


# Wall-clock figures, and the restart mark: not compared.
UNCOMPARED = {"tps", "tps_per_device", "mfu", "step_time", "time", "peak_memory_gib_per_device", "data_wait_ms",
              "exchange_ms", "exchange_fwd_ms", "exchange_bwd_ms", "exchange_share", "resumed_from_step",
              "rows_replaced"}


def _assert_reference_trajectory(rows: list[dict], ref: list[dict], label: str) -> None:
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), label  # every step once
    for r, e in zip(rows, ref):
        same = {k: v for k, v in r.items() if k not in UNCOMPARED}
        assert same == {k: v for k, v in e.items() if k not in UNCOMPARED}, (label, r["step"])  # exact on CPU
        assert {"loss", "grad_norm", "lr", "seq_len", "tokens_seen", "rope_theta"} <= same.keys()


def test_restart_resumes_the_uninterrupted_trajectory(runs):
    # Killed after step 5, resumed from step 3: rows 4 and 5 of the killed attempt
    # replaced, and the 64 -> 128 stage change at step 5 trained again.
    name, killed, resumed, replaced = "two_agents", "KILL-2-5", 3, 2
    jobs, codes, ref = runs
    job = jobs[name]
    assert codes[name] == [0] * len(job.procs), job.text("err")[-4000:]
    assert (job.dump / f"test_fault-{killed}").is_file()  # the kill happened, once
    assert f"resumed from {job.dump / 'checkpoint' / f'step-{resumed}'}" in job.text("out")
    assert "Traceback" not in job.text("err")
    rows = job.rows()
    _assert_reference_trajectory(rows, ref, name)
    marked = [(r["step"], r["resumed_from_step"], r["rows_replaced"]) for r in rows if "resumed_from_step" in r]
    assert marked == [(resumed + 1, resumed, replaced)]
    assert sorted(p.name for p in (job.dump / "checkpoint").iterdir()) == ["step-6", "step-8"]  # keep_latest_k 2


def test_unloadable_checkpoint_stops_after_max_restarts_with_one_message(runs):
    jobs, codes, _ = runs
    job = jobs["broken"]
    assert codes["broken"][0] != 0
    err = job.text("err")
    # Two attempts (MAX_RESTARTS=1), two ranks each: the cause once, then one short line for the restart.
    assert err.count("checkpoint error:") == 1, err[-4000:]
    assert re.search(r"checkpoint error: \S+/step-3 cannot be loaded: \w+Error: .*move it out of that folder", err)
    assert re.findall(r"torchrun restart (\d) of (\d) ended with the same checkpoint error", err) == [("1", "1")]
    # No worker traceback: the one there is torchrun's agent raising its ChildFailedError summary.
    assert err.count("Traceback") == 1 and "ChildFailedError" in err, err


def test_lost_node_without_restarts_fails_fast(tmp_path):
    """A frozen node: the other node's rank exits non-zero within the step timeout + a margin."""
    timeout_s, margin_s = 10, 10
    job = _two_agents(tmp_path, "lost_node", "STOP:1:3", nproc=1, restarts=0,
                      extra=("--parallelism.sp", "2", "--parallelism.ring", "1",
                             "--comm.train_timeout_seconds", str(timeout_s), "--comm.init_timeout_seconds", "60"),
                      checkpoints=False)
    frozen: list[dict] = []
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (frozen := job.fired()) and time.monotonic() < deadline:
            if all(p.poll() is not None for p in job.procs):
                break
            time.sleep(0.2)
        assert frozen, job.text("err")[-4000:]
        # The surviving node's agent is the first to end: its rank timed out and exited.
        while all(p.poll() is None for p in job.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = time.time()
        survivor = next(p for p in job.procs if p.poll() is not None)
    finally:
        # The frozen rank would wait for SIGCONT forever: read the latches again, for
        # a loop that ended (an error) before it saw them.
        for fault in frozen or job.fired():
            try:
                os.kill(fault["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in job.procs:  # their one worker each is gone: nothing is orphaned
            p.kill()
            p.wait()
    elapsed = ended - frozen[0]["time"]
    err = job.text("err")
    assert survivor.returncode != 0
    assert timeout_s - 1 <= elapsed <= timeout_s + margin_s, (elapsed, err[-4000:])
    line = re.search(r"lost a peer rank: rank 0 at step 4 \(training step\), in \w+: no answer from a peer rank "
                     r"within comm.train_timeout_seconds=10 \[.+\]\n", err)
    assert line, err[-4000:]
    print(f"lost peer -> agent exit: {elapsed:.1f} s (comm.train_timeout_seconds={timeout_s})")


# --------------------------------------------------------------------------- #
# The pieces, in one process
# --------------------------------------------------------------------------- #


def test_comm_section_defaults_and_bad_values():
    from ulysses_dtensor.trainer.config import ConfigError, load_config, parse_config

    cfg = parse_config({})  # a config without [comm]
    assert (cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds) == (600, 300)
    for argv, match in [
        (["--comm.train_timeout", "10"], r"unknown config key comm.train_timeout \(did you mean "
                                         r"'comm.train_timeout_seconds'\?\)"),
        (["--comm.train_timeout_seconds", "0"], r"comm.train_timeout_seconds=0 must be >= 1"),
        (["--comm.init_timeout_seconds", "ten"], r"--comm.init_timeout_seconds must be an integer"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(argv)
    with pytest.raises(ConfigError, match=r"config key comm.init_timeout_seconds must be an integer"):
        parse_config({"comm": {"init_timeout_seconds": "600"}})


def test_lost_peer_line_names_step_phase_and_collective():
    import torch.distributed as dist

    from ulysses_dtensor.runtime.lost_peer import PeerLostError, is_peer_failure
    from ulysses_dtensor.trainer.comm_phases import CommPhases
    from ulysses_dtensor.trainer.config import parse_config

    closed = RuntimeError("[/src/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4242. "
                          "This is typically caused by a remote worker crashing.")
    silent = RuntimeError("[/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 300000ms for recv "
                          "operation to complete")
    assert is_peer_failure(closed) and is_peer_failure(silent)
    assert is_peer_failure(dist.DistNetworkError("Failed to recv, got 0 bytes. Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("size mismatch for tok_embeddings.weight"))

    phases = CommPhases(parse_config({}).comm)
    phases.sets_timeouts = True  # as for a group the run made (none exists here: nothing to set)
    phases.enter("training step", 7)
    for exc, words in ((silent, "no answer from a peer rank within comm.train_timeout_seconds=300 "
                                "[Timed out waiting 300000ms for recv operation to complete]"),
                       (closed, "a peer rank's process is gone [Connection closed by peer [10.0.0.2]:4242]")):
        with pytest.raises(PeerLostError) as info:
            with phases.lost_peer_as_error():
                raise exc
        assert re.fullmatch(r"lost a peer rank: rank 0 at step 7 \(training step\), in \w+: " + re.escape(words),
                            str(info.value)), str(info.value)
    with pytest.raises(ValueError):  # anything else passes through unchanged
        with phases.lost_peer_as_error():
            raise ValueError("not a collective")


def test_restart_store_needs_the_variable_with_several_agents(monkeypatch):
    from ulysses_dtensor.runtime.restarts import restart_store_problem

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert restart_store_problem() is None  # one agent: the trainer's store prefix per attempt
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_store_problem()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what the launchers' variable gives
    assert restart_store_problem() is None


def test_config_error_shown_once_over_restarts(tmp_path, capsys, monkeypatch):
    """Each attempt fails the same way; the message appears in the first only."""
    from ulysses_dtensor.train import main

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    for attempt in range(3):  # the layout torchrun gives: <log_dir>/<run_id>/attempt_<k>/<rank>/error.json
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "run" / f"attempt_{attempt}" / "0" / "error.json"))
        (tmp_path / "run" / f"attempt_{attempt}" / "0").mkdir(parents=True)
        with pytest.raises(SystemExit) as info:
            main(["--training.steps", "0"])
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "config error: training.steps=0 must be >= 1",
        "(torchrun restart 1 of 2 ended with the same config error as an earlier attempt, shown above)",
        "(torchrun restart 2 of 2 ended with the same config error as an earlier attempt, shown above)",
    ]


def test_resumed_metrics_replace_the_rows_after_the_checkpoint(tmp_path):
    import torch

    from ulysses_dtensor.trainer.metrics import MetricsLogger, drop_rows_after

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)))
    logger = MetricsLogger(tmp_path, rank=0, world_size=1, total_steps=8, device=torch.device("cpu"),
                           show_progress=False, resume_step=4)
    for step in (5, 6):
        logger.log(step=step, seq_len=8, batch_size=1, loss=0.5, grad_norm=1.0, lr=1e-3, tokens_seen=8 * step,
                   step_tokens=8, step_time=0.1)
    rows = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [(r.get("resumed_from_step"), r.get("rows_replaced")) for r in rows[4:]] == [(4, 2), (None, None)]
    assert rows[4]["loss"] == 0.5 and rows[3]["loss"] == 0.25
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"step": 3, "kind": "loss"}\n{"step": 6, "kind": "loss"}\n')
    assert drop_rows_after(evals, 4) == 1 and evals.read_text() == '{"step": 3, "kind": "loss"}\n'


def test_fault_latch_is_whole_when_it_appears_and_fires_once(tmp_path, monkeypatch):
    # The lost-node test polls for the latch while the rank writes it: a half-written
    # one (seen once, as an empty file) must never be visible.
    import ulysses_dtensor.trainer.fault_injection as fi

    sent = []
    monkeypatch.setattr(fi.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setenv(FAULT_ENV, "STOP:1:3,KILL:0:4")
    monkeypatch.setenv("RANK", "1")
    for step in (2, 3, 3):  # the restarted attempt runs step 3 again: no second fault
        fi.inject_test_fault(step, tmp_path)
    assert sent == [(os.getpid(), signal.SIGSTOP)]
    assert [p.name for p in tmp_path.iterdir()] == ["test_fault-STOP-1-3"]  # no draft left behind
    record = json.loads((tmp_path / "test_fault-STOP-1-3").read_text())
    assert record["pid"] == os.getpid() and abs(record["time"] - time.time()) < 60
