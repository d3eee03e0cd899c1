"""The trainer on a prepared store mixed with raw files: the same losses on four
meshes, exact resume on another mesh through the read-ahead thread, the realised
mixture shares and the data wait in metrics.jsonl.

The job: the debug model, 6 steps, 64 -> 128 tokens at step 4, two sources with
per-stage weights (3:1, then 1:3): a token store ("short") and raw ``.jsonl``
files with their long documents up-sampled x2 ("long").
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from distributed import run_ranks
from ulysses_dtensor.data import RowMixture
from ulysses_dtensor.data.prepare import prepare_store

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
STEPS, BATCH = 6, 4


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixdata")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "the", "of", "and"]

    def doc(n):
        return " ".join(rng.choice(words, n))

    (root / "short").mkdir()
    (root / "short" / "a.jsonl").write_text("".join(json.dumps({"text": doc(5 + i % 20)}) + "\n" for i in range(120)))
    prepare_store([str(root / "short")], "byte", root / "store", log=None)
    (root / "long").mkdir()
    (root / "long" / "b.jsonl").write_text(
        "".join(json.dumps({"text": doc(8 if i % 3 else 60)}) + "\n" for i in range(90)))
    return root


def _config(src: Path, dump: Path, mesh, *extra):
    toml = tomllib.loads((REPO / "train_configs" / "debug_model.toml").read_text())
    toml["data"] = {"path": "", "sources": [
        {"path": str(src / "store"), "weight": [3, 1], "name": "short"},
        {"path": str(src / "long"), "weight": [1, 3], "name": "long",
         "upsample_min_tokens": 200, "upsample_factor": 2.0},
    ]}
    rep, shard, sp = mesh
    overrides = [
        ("job.dump_folder", str(dump)), ("training.steps", str(STEPS)),
        ("training.global_batch_size", str(BATCH)), ("context.schedule", "1:64,4:128"),
        ("lr_scheduler.warmup_steps", "2"), ("metrics.log_freq", "1"),
        ("parallelism.dp_replicate", str(rep)), ("parallelism.dp_shard", str(shard)),
        ("parallelism.sp", str(sp)), *extra,
    ]
    return toml, overrides


def _train(toml, overrides):
    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.loop import train

    train(parse_config(toml, overrides))


def _jobs(rank, world, jobs):
    import torch.distributed as dist

    for (toml, overrides), ckpt in jobs:
        if ckpt is not None:
            if rank == 0:
                shutil.copytree(*ckpt)
            dist.barrier()
        _train(toml, overrides)


def _rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


NO_CKPT = (("checkpoint.enable", "false"),)


def test_store_mixture_same_losses_on_four_meshes_and_exact_resume(sources, tmp_path):
    ref_dump = tmp_path / "1x1x1"
    _train(*_config(sources, ref_dump, (1, 1, 1), *NO_CKPT))
    ref = _rows(ref_dump)
    four = tmp_path / "1x2x2"
    run_ranks(4, _jobs, [(_config(sources, four, (1, 2, 2), ("checkpoint.interval", "3")), None)])
    resumed = tmp_path / "resumed-1x1x2"
    run_ranks(2, _jobs, [
        (_config(sources, tmp_path / "1x2x1", (1, 2, 1), *NO_CKPT), None),
        (_config(sources, tmp_path / "1x1x2", (1, 1, 2), *NO_CKPT, ("data.prefetch", "0")), None),
        # resume the 4-rank run's step-3 checkpoint (the next step changes stage) on 2 ranks
        (_config(sources, resumed, (1, 1, 2), ("data.prefetch", "2")),
         (str(four / "checkpoint" / "step-3"), str(resumed / "checkpoint" / "step-3"))),
    ])
    for name in ("1x2x1", "1x1x2", "1x2x2"):
        rows = _rows(tmp_path / name)
        assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in ref], name
        print(f"{name}: max |loss - 1x1x1| / loss = "
              f"{max(abs(a['loss'] - b['loss']) / b['loss'] for a, b in zip(rows, ref)):.2e}")
        for a, b in zip(rows, ref):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (name, a["step"], a["loss"], b["loss"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (name, a["step"])
    rows = _rows(resumed)
    assert [r["step"] for r in rows] == [4, 5, 6]
    print("resumed on 1x1x2 from the 1x2x2 step-3 checkpoint: max |loss - 1x1x1| / loss = "
          f"{max(abs(r['loss'] - ref[r['step'] - 1]['loss']) / ref[r['step'] - 1]['loss'] for r in rows):.2e}")
    for r in rows:
        b = ref[r["step"] - 1]
        assert r["tokens_seen"] == b["tokens_seen"] and r["seq_len"] == b["seq_len"]
        assert r["loss"] == pytest.approx(b["loss"], rel=1e-5), (r["step"], r["loss"], b["loss"])
        assert r["data_share_long"] == pytest.approx(b["data_share_long"], abs=0)

    # metrics.jsonl: the wait for each batch, and each source's realised token share, by exact count
    mix, taken, rows_done = RowMixture(2, seed=0), np.zeros(2, np.int64), 0
    for r in ref:
        w, seq = ([3, 1], 64) if r["step"] < 4 else ([1, 3], 128)
        t = mix.taken([rows_done, rows_done + BATCH], w)
        taken += (t[1] - t[0]) * seq
        rows_done += BATCH
        assert r["data_share_short"] == pytest.approx(taken[0] / taken.sum(), abs=1e-12)
        assert r["data_share_long"] == pytest.approx(taken[1] / taken.sum(), abs=1e-12)
        assert r["data_wait_ms"] >= 0
    assert ref[2]["data_share_short"] == 0.75 and ref[-1]["data_share_short"] < 0.5  # stage weights took effect
