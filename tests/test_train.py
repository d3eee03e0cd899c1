"""End to end: torchrun + TOML config, stage change, mesh independence, resume.

One 4-rank run (dp_shard 2 x sp 2) with a stage change (64 -> 128 tokens at
step 4) and checkpoints at steps 3 and 6 serves as the reference; the same job
on meshes (1,1,1) and (1,1,2), and resumed from its step-3 checkpoint, must give
the same per-step losses.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
SCHEDULE = {1: 64, 2: 64, 3: 64, 4: 128, 5: 128, 6: 128}
BATCH = 4


def _run(dump: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    args = [
        "--config", str(REPO / "train_configs" / "debug_model.toml"),
        "--job.dump_folder", str(dump),
        "--training.steps", str(STEPS),
        "--training.global_batch_size", str(BATCH),
        "--context.schedule", "1:64,4:128",
        "--lr_scheduler.warmup_steps", "2",
        "--checkpoint.interval", "3",
        "--checkpoint.keep_latest_k", "0",
        "--metrics.log_freq", "1",
        *extra,
    ]
    if nproc == 1:  # no torchrun: a world of one
        cmd = [sys.executable, "-m", "ulysses_dtensor.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "ulysses_dtensor.train", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"
    return proc


def _rows(dump: Path) -> list[dict]:
    with open(dump / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ref")
    proc = _run(dump, 4, "--parallelism.dp_shard", "2", "--parallelism.sp", "2")
    return dump, proc


def test_end_to_end_4_ranks(reference):
    dump, proc = reference
    rows = _rows(dump)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["seq_len"] for r in rows] == [SCHEDULE[s] for s in range(1, STEPS + 1)]
    # tokens_seen counts each token of the global batch once (not x sp, not / dp).
    seen, total = [], 0
    for s in range(1, STEPS + 1):
        total += BATCH * SCHEDULE[s]
        seen.append(total)
    assert [r["tokens_seen"] for r in rows] == seen
    for key in ("loss", "grad_norm", "lr", "tps", "mfu", "peak_memory_gib"):
        assert all(key in r for r in rows)
    assert rows[0]["mfu"] is None  # CPU without metrics.peak_flops
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    assert "step 6/6" in proc.stdout and "seq 128" in proc.stdout
    ckpt = dump / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-3", "step-6"]
    state = json.loads((ckpt / "step-6" / "train_state.json").read_text())
    assert state["step"] == 6 and state["context"]["seq_len"] == 128
    assert state["data"]["tokens_seen"] == seen[-1]


@pytest.mark.parametrize("mesh, extra", [
    ((1, 1, 1), ()),
    ((1, 1, 1), ("--training.micro_batch_size", "1")),  # 4 accumulated micro-batches
    ((1, 1, 2), ()),
    ((2, 1, 2), ()),  # HSDP: replicate x (shard x sp)
    ((1, 1, 2), ("--memory.offload_params", "true")),  # AdamW on host-offloaded shards
], ids=["1x1x1", "1x1x1-micro1", "1x1x2", "2x1x2", "1x1x2-offload_params"])
def test_mesh_independence(reference, tmp_path, mesh, extra):
    """Same seed and global batch: the same losses on every mesh (dp_replicate, dp_shard, sp)."""
    ref = _rows(reference[0])
    rep, shard, sp = mesh
    _run(tmp_path, rep * shard * sp, "--parallelism.dp_replicate", str(rep),
         "--parallelism.dp_shard", str(shard), "--parallelism.sp", str(sp),
         "--checkpoint.enable", "false", *extra)
    rows = _rows(tmp_path)
    assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in ref]
    for a, b in zip(rows, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert not (tmp_path / "checkpoint").exists()


def test_resume_across_stage_change(reference, tmp_path):
    """Resume at step 3 (the next step starts the 128-token stage): same losses."""
    ref_dump, _ = reference
    shutil.copytree(ref_dump / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    # A save that a kill interrupted must be ignored.
    (tmp_path / "checkpoint" / "step-5.tmp").mkdir()
    proc = _run(tmp_path, 4, "--parallelism.dp_shard", "2", "--parallelism.sp", "2")
    assert "resumed from" in proc.stdout and "step 3" in proc.stdout
    rows = _rows(tmp_path)
    ref = {r["step"]: r for r in _rows(ref_dump)}
    assert [r["step"] for r in rows] == [4, 5, 6]
    for r in rows:
        assert r["seq_len"] == ref[r["step"]]["seq_len"]
        assert r["tokens_seen"] == ref[r["step"]]["tokens_seen"]
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-6, abs=0)
        assert r["lr"] == pytest.approx(ref[r["step"]]["lr"])


def test_resume_into_host_offloaded_parameters(reference, tmp_path):
    """A checkpoint saved with parameters on the device resumes into
    memory.offload_params (shards and AdamW state in host memory): same losses."""
    ref_dump, _ = reference
    shutil.copytree(ref_dump / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    _run(tmp_path, 4, "--parallelism.dp_shard", "2", "--parallelism.sp", "2",
         "--memory.offload_params", "true")
    ref = {r["step"]: r for r in _rows(ref_dump)}
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [4, 5, 6]
    for r in rows:
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-6, abs=0)
        assert r["grad_norm"] == pytest.approx(ref[r["step"]]["grad_norm"], rel=1e-5)
