"""End to end: the README's main command, stage change, mesh independence, resume.

The reference is the README's own main command, ``bash scripts/run_train.sh``
(torchrun, 2 CPU ranks: sp 2, the debug TOML), with a stage change
(64 -> 128 tokens at step 4) and checkpoints at steps 3 and 6. The same job on
other meshes, and resumed from its step-3 checkpoint, must give the same
per-step losses. Those runs call the trainer in-process: on the live gloo ranks
of tests/distributed.py, or in this process for a world of one (what
``python -m ulysses_dtensor.train`` does). The same job with NaN / inf injected
on one rank skips the step on every rank, stops after too many in a row, and
resumes from its last good checkpoint to the reference's losses.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import run_ranks
from ulysses_dtensor.trainer.config import load_config

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
SCHEDULE = {1: 64, 2: 64, 3: 64, 4: 128, 5: 128, 6: 128}
BATCH = 4


def _args(dump: Path, *extra: str, checkpoints: bool = True) -> list[str]:
    ckpt = ["--checkpoint.interval", "3"] if checkpoints else ["--checkpoint.enable", "false"]
    return [
        "--config", str(REPO / "train_configs" / "debug_model.toml"),
        "--job.dump_folder", str(dump),
        "--training.steps", str(STEPS),
        "--training.global_batch_size", str(BATCH),
        "--context.schedule", "1:64,4:128",
        "--lr_scheduler.warmup_steps", "2",
        *ckpt,
        "--metrics.log_freq", "1",
        *extra,
    ]


def _mesh_args(rep: int, shard: int, sp: int) -> list[str]:
    return ["--parallelism.dp_replicate", str(rep), "--parallelism.dp_shard", str(shard),
            "--parallelism.sp", str(sp)]


def _train(argv: list[str]) -> None:
    from ulysses_dtensor.trainer.loop import train

    train(load_config(argv))


def _jobs_worker(rank: int, world: int, jobs: list) -> None:
    """Run several trainer jobs one after the other on this pool's ranks.

    A job is (argv, checkpoint to copy into its dump folder first, or None).
    """
    import torch.distributed as dist

    for argv, seed_ckpt in jobs:
        if seed_ckpt is not None:
            if rank == 0:
                src, dst = seed_ckpt
                shutil.copytree(src, dst)
            dist.barrier()
        _train(argv)


def _rows(dump: Path) -> list[dict]:
    with open(dump / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The README main command (scripts/run_train.sh) on 2 CPU ranks: the debug config's
    mesh fitted to them (sp "auto" -> 2); the global batch from the command line."""
    dump = tmp_path_factory.mktemp("ref")
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "2", "OMP_NUM_THREADS": "1"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "ULYSSES_DTENSOR_ALLOC_DEFAULT"):
        env.pop(name, None)  # unset: run_train.sh applies the allocator default
    cmd = ["bash", str(REPO / "scripts" / "run_train.sh"), *_args(dump)]
    return dump, _run_main_job(cmd, env)


def _run_main_job(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"
    return proc


def test_end_to_end_2_ranks(reference):
    dump, proc = reference
    assert "run_train.sh: 2 ranks (CPU, gloo)" in proc.stderr
    assert "  world 2 on cpu: dp_replicate=1 dp_shard=1 sp=2\n" in proc.stdout
    assert ("  fitted to the world: parallelism.sp=auto -> 2: the largest divisor of the 2 ranks for sp x dp that "
            "suits 8 heads / 4 kv heads and every stage's seq_len\n") in proc.stdout
    assert "global_batch_size ->" not in proc.stdout  # the command line's global batch, not the TOML's local one
    # The banner's memory switches, and the allocator default run_train.sh applied.
    assert ("  memory: tiled_mlp off, tiled_loss off, offload_activations off, offload_params off, save_attention off; "
            "allocator: expandable_segments:True (this package's default; set PYTORCH_CUDA_ALLOC_CONF to choose "
            "another), for CUDA only: not in effect on cpu\n") in proc.stdout
    rows = _rows(dump)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["seq_len"] for r in rows] == [SCHEDULE[s] for s in range(1, STEPS + 1)]
    # tokens_seen counts each token of the global batch once (not x sp, not / dp).
    seen, total = [], 0
    for s in range(1, STEPS + 1):
        total += BATCH * SCHEDULE[s]
        seen.append(total)
    assert [r["tokens_seen"] for r in rows] == seen
    for key in ("loss", "grad_norm", "lr", "tps", "mfu", "peak_memory_gib_per_device"):
        assert all(key in r for r in rows)
    assert rows[0]["mfu"] is None  # CPU without metrics.peak_flops
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    assert "step 6/6" in proc.stdout and "seq 128" in proc.stdout
    ckpt = dump / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-3", "step-6"]
    state = json.loads((ckpt / "step-6" / "train_state.json").read_text())
    assert state["step"] == 6 and state["context"]["seq_len"] == 128
    assert state["data"]["tokens_seen"] == seen[-1]


def test_main_job_fits_3_ranks_and_1(tmp_path):
    """The main job with its default config on 3 ranks (as on a 3-GPU machine): no sp divides
    both 3 and the 8 heads, so sp 1 x dp 3, and 8 sequences per data-parallel rank make a global
    batch of 24; the banner says both and why. On one process: sp 1, batch 8."""
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "3", "OMP_NUM_THREADS": "1"}
    dump = tmp_path / "three"
    short = ["--training.steps", "2", "--checkpoint.enable", "false", "--metrics.log_freq", "1"]
    proc = _run_main_job(["bash", str(REPO / "scripts" / "run_train.sh"), "--job.dump_folder", str(dump),
                          *short], env)
    assert "  world 3 on cpu: dp_replicate=1 dp_shard=3 sp=1\n" in proc.stdout
    assert ("  fitted to the world: parallelism.sp=auto -> 1: the largest divisor of the 3 ranks for sp x dp that "
            "suits 8 heads / 4 kv heads and every stage's seq_len (not 3: 8 heads do not split over 3 ranks); "
            "dp is the rest, 3\n") in proc.stdout
    assert ("  fitted to the world: training.global_batch_size -> 24: training.local_batch_size=8 sequences x 3 "
            "data-parallel ranks\n") in proc.stdout
    assert [r["tokens_seen"] for r in _rows(dump)] == [24 * 128, 2 * 24 * 128]

    one = tmp_path / "one"
    _train(["--config", str(REPO / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(one), *short])
    assert [r["tokens_seen"] for r in _rows(one)] == [8 * 128, 2 * 8 * 128]
    saved = json.loads((one / "config.json").read_text())
    assert saved["parallelism"]["sp"] == 1 and saved["training"]["global_batch_size"] == 8


def _assert_same_trajectory(rows: list[dict], ref: list[dict], label: str) -> None:
    assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in ref], label
    for a, b in zip(rows, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (label, a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (label, a["step"])


# (dp_replicate, dp_shard, sp), extra args
MESHES = {
    "1x1x1": ((1, 1, 1), ()),
    "1x1x1-micro1": ((1, 1, 1), ("--training.micro_batch_size", "1")),  # 4 accumulated micro-batches
    "1x2x2": ((1, 2, 2), ()),  # FSDP over dp_shard x sp
    "1x1x2-offload_params": ((1, 1, 2), ("--memory.offload_params", "true")),  # AdamW on host shards
    "2x1x2": ((2, 1, 2), ()),  # HSDP: replicate x (shard x sp)
    "1x1x2-tp2": ((1, 1, 2), ("--parallelism.tp", "2")),  # tensor parallel inside each sp rank
}


def _world(mesh: tuple, extra: tuple) -> int:
    tp = int(extra[extra.index("--parallelism.tp") + 1]) if "--parallelism.tp" in extra else 1
    return mesh[0] * mesh[1] * mesh[2] * tp


def test_mesh_independence(reference, tmp_path):
    """Same seed and global batch: the same losses on every mesh (dp_replicate, dp_shard, sp)."""
    ref = _rows(reference[0])
    by_world: dict[int, list] = {}
    for name, (mesh, extra) in MESHES.items():
        argv = _args(tmp_path / name, *_mesh_args(*mesh), *extra, checkpoints=False)
        by_world.setdefault(_world(mesh, extra), []).append((argv, None))
    for world, jobs in sorted(by_world.items()):
        if world == 1:  # a world of one, as `python -m ulysses_dtensor.train` runs
            for argv, _ in jobs:
                _train(argv)
        else:
            run_ranks(world, _jobs_worker, jobs)
    for name in MESHES:
        _assert_same_trajectory(_rows(tmp_path / name), ref, name)
        assert not (tmp_path / name / "checkpoint").exists()


def test_resume_across_stage_change_and_into_offloaded_parameters(reference, tmp_path):
    """Resume at step 3 (the next step starts the 128-token stage): the same losses;
    also when the device-parameter checkpoint resumes into memory.offload_params
    (shards and AdamW state in host memory) and onto tp 2 (each weight split over
    two more ranks). A save a kill cut short is ignored."""
    ref_dump, _ = reference
    step3 = ref_dump / "checkpoint" / "step-3"
    plain, offload = tmp_path / "resume", tmp_path / "resume_offload"
    (plain / "checkpoint" / "step-5.tmp").mkdir(parents=True)  # an interrupted save
    mesh = _mesh_args(1, 1, 2)  # the reference's: resumed exactly
    jobs = [
        (_args(plain, *mesh), (str(step3), str(plain / "checkpoint" / "step-3"))),
        (_args(offload, *mesh, "--memory.offload_params", "true"),
         (str(step3), str(offload / "checkpoint" / "step-3"))),
    ]
    run_ranks(2, _jobs_worker, jobs)
    # Across tensor-parallel degrees: the sp 2 checkpoint resumed with each weight split over tp 2.
    tp = tmp_path / "resume_tp2"
    run_ranks(4, _jobs_worker, [(_args(tp, *mesh, "--parallelism.tp", "2"),
                                 (str(step3), str(tp / "checkpoint" / "step-3")))])
    ref = {r["step"]: r for r in _rows(ref_dump)}
    for dump in (plain, offload, tp):
        rows = _rows(dump)
        assert [r["step"] for r in rows] == [4, 5, 6], dump.name
        for r in rows:
            assert r["seq_len"] == ref[r["step"]]["seq_len"]
            assert r["tokens_seen"] == ref[r["step"]]["tokens_seen"]
            assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-6, abs=0), dump.name
            assert r["lr"] == pytest.approx(ref[r["step"]]["lr"])
            assert r["grad_norm"] == pytest.approx(ref[r["step"]]["grad_norm"], rel=1e-5)
    assert sorted(p.name for p in (plain / "checkpoint").iterdir()) == ["step-3", "step-6"]  # the interrupted save is gone


def _guarded_jobs_worker(rank: int, world: int, jobs: list) -> list[tuple]:
    """Trainer jobs with non-finite values injected (runtime/nonfinite.py's hook): per job,
    (the NonFiniteError's message or None, then rank 0's metrics rows and checkpoint folders)."""
    import torch.distributed as dist

    from ulysses_dtensor.runtime.nonfinite import NONFINITE_FAULT_ENV, NonFiniteError

    out = []
    for argv, seed_ckpt, faults in jobs:
        if seed_ckpt is not None and rank == 0:
            shutil.copytree(*seed_ckpt)
        dist.barrier()
        os.environ[NONFINITE_FAULT_ENV] = faults
        message = None
        try:
            _train(argv)
        except NonFiniteError as e:
            message = str(e)
        finally:
            del os.environ[NONFINITE_FAULT_ENV]
        dump = Path(argv[argv.index("--job.dump_folder") + 1])
        seen = (_rows(dump), sorted(p.name for p in (dump / "checkpoint").iterdir())) if rank == 0 else None
        out.append((message, seen))
        dist.barrier()
    return out


def test_nonfinite_steps_are_skipped_everywhere_stop_the_run_and_resume(reference, tmp_path):
    """One skip allowed (training.max_nonfinite_steps=1). A NaN loss on rank 1 at step 5, then a
    NaN in rank 0's gradient shard only at step 6: both steps are skipped on every rank, and
    the second in a row stops the run with one message (the same on both ranks) naming both
    steps, the ranks, the loss / the parameter, and the step-3 checkpoint; steps 1-4 are the
    reference's, steps 5 and 6 have rows saying skipped and why, and no checkpoint follows
    step 3. The same job then resumes from step 3 and gives the uninterrupted run's losses.
    Resumed from step 3 with a NaN gradient on rank 0 only at step 5, a run skips step 5 and
    goes on: its step 6 is the stopped run's (the weights after step 4 on the same batch, so
    no rank applied step 5) and not the reference's."""
    ref_dump, _ = reference
    mesh = _mesh_args(1, 1, 2)
    stop, grad = tmp_path / "stop", tmp_path / "grad"
    skip_one = ("--training.max_nonfinite_steps", "1")
    jobs = [
        (_args(stop, *mesh, *skip_one), None, "loss:1:5,grad:0:6"),
        (_args(stop, *mesh), None, ""),  # resumed from its step-3 checkpoint, nothing injected
        (_args(grad, *mesh, *skip_one), (ref_dump / "checkpoint" / "step-3", grad / "checkpoint" / "step-3"),
         "grad:0:5"),
    ]
    results = run_ranks(2, _guarded_jobs_worker, jobs)
    assert [m for m, _ in results[1]] == [m for m, _ in results[0]]  # every rank stopped with the same message
    (stopped, (stop_rows, stop_ckpts)), (resumed, (rows, _)), (went_on, (grad_rows, _)) = results[0]
    ref = {r["step"]: r for r in _rows(ref_dump)}
    grad_cause = "gradient norm nan, non-finite gradients on rank 0 (tok_embeddings.weight)"
    assert stopped == (
        "training stopped at step 6: 2 steps in a row with a non-finite loss or gradient norm (steps 5-6; "
        "training.max_nonfinite_steps=1 skips 1 in a row and stops at the next); no update of those steps was "
        f"applied. It started at step 5: loss not finite on rank 1. Step 6: {grad_cause}. Last good checkpoint: "
        f"{stop / 'checkpoint' / 'step-3'} (step 3); a run in the same job.dump_folder resumes from it: change what "
        "diverged first (e.g. a lower optimizer.lr), or it will diverge again."), stopped
    assert [r["step"] for r in stop_rows] == list(range(1, STEPS + 1)) and stop_ckpts == ["step-3"]
    for r in stop_rows[:4]:
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-6) and "skipped" not in r
    assert stop_rows[4]["skipped"] is True and stop_rows[4]["loss"] is None
    assert stop_rows[4]["skip_reason"] == "loss not finite on rank 1"
    assert stop_rows[5]["skipped"] is True and stop_rows[5]["skip_reason"] == grad_cause
    assert resumed is None and [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[3]["resumed_from_step"] == 3 and rows[3]["rows_replaced"] == 3
    for r in rows[3:]:
        assert "skipped" not in r
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-6, abs=0)
        assert r["grad_norm"] == pytest.approx(ref[r["step"]]["grad_norm"], rel=1e-5)
    assert went_on is None and [r["step"] for r in grad_rows] == [4, 5, 6]
    assert grad_rows[1]["skip_reason"] == grad_cause and "skipped" not in grad_rows[2]
    assert grad_rows[0]["loss"] == pytest.approx(ref[4]["loss"], rel=1e-6)
    assert grad_rows[2]["loss"] == pytest.approx(stop_rows[5]["loss"], rel=1e-6, abs=0)
    assert abs(grad_rows[2]["loss"] - ref[6]["loss"]) > 1e-4 * ref[6]["loss"]  # step 5's update is missing
