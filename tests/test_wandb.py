"""Weights & Biases ([metrics] enable_wandb) as torchtitan has it: rank 0 logs every
metrics.jsonl row to one run named after the job, with the config attached.

One offline run (``WANDB_MODE=offline``, every wandb folder in tmp): the trainer on 2
gloo ranks (sp 2), 3 steps, step 2 skipped for a NaN gradient (a row with strings and
nulls). The run's transaction log is read back with wandb's own reader (``wandb leet
inspect --json``): its history holds, step by step, exactly the fields and values of
metrics.jsonl (nulls are not logged); the run record names the job and holds the config.
Only rank 0 created a run. The missing-package message is in tests/test_nonfinite.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import run_ranks

if importlib.util.find_spec("wandb") is None:  # found, not imported: the other worker never pays its import
    pytest.skip("wandb is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]


def _wandb_job(rank: int, world: int, argv: list[str], env: dict) -> None:
    """The trainer with wandb on, the environment put back after."""
    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import train

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        train(load_config(argv))
    finally:
        if "wandb" in sys.modules:
            sys.modules["wandb"].teardown()  # its service process goes with the run, not with the pooled rank
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wandb_cli() -> list[str]:
    exe = shutil.which("wandb", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "wandb"]


def test_wandb_offline_run_holds_the_metrics_rows_from_rank_0(tmp_path):
    dump, home = tmp_path / "wandb-job", tmp_path / "wandb-home"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(home), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_DATA_DIR": str(home / "data"), "WANDB_CONSOLE": "off",
           "WANDB_SILENT": "true", "ULYSSES_DTENSOR_TEST_NONFINITE": "grad:1:2"}
    argv = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(dump),
            "--job.description", "wandb offline check", "--training.steps", "3", "--training.global_batch_size", "2",
            "--context.schedule", "1:64", "--parallelism.dp_shard", "1", "--parallelism.sp", "2",
            "--checkpoint.enable", "false", "--training.max_nonfinite_steps", "1", "--metrics.enable_wandb", "true"]
    run_ranks(2, _wandb_job, argv, env)
    files = list(dump.rglob("*.wandb"))
    assert len(files) == 1, files  # one run: rank 0's (every rank's would be under the dump folder)
    assert not list(home.rglob("*.wandb"))
    cli_env = {**os.environ, **{k: v for k, v in env.items() if k.startswith("WANDB_")}}
    proc = subprocess.run([*_wandb_cli(), "leet", "inspect", "--json", str(files[0])], capture_output=True, text=True,
                          env=cli_env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] == sorted(history)
    assert rows[1]["skipped"] is True and rows[1]["grad_norm"] is None
    for row in rows:
        logged = {k: v for k, v in history[row["step"]].items() if not k.startswith("_")}
        assert logged == {k: v for k, v in row.items() if k != "step" and v is not None}, row["step"]
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["display_name"] == "wandb-job" and run["notes"] == "wandb offline check"
    assert run["project"] == "ulysses_dtensor"
    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config == json.loads((dump / "config.json").read_text())
    assert next(r["exit"]["exit_code"] for r in records if r["type"] == "exit") == 0
