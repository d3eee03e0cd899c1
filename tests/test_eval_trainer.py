"""Evaluation in the trainer and on its checkpoint: one evaluation, two entry points.

One CPU job (the debug eval config, shortened: dp_shard 2 x sp 2 on 4 gloo ranks,
an HF tokenizer.json trained here, 5% of the corpus held out) trains 3 steps and
evaluates at steps 2 and 3; a twin job without periodic evaluation must train
identically (evaluation changes nothing). ``python -m ulysses_dtensor.eval`` on the
step-3 checkpoint, in one process (another mesh), must give the trainer's step-3
numbers. Also: the metrics carry the all-to-all share, TensorBoard and the PNGs
are written, and config mistakes stop early with one message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distributed import run_ranks
from eval_helpers import build_bpe_tokenizer
from ulysses_dtensor.data import DataError
from ulysses_dtensor.trainer.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]
LENGTH = 340


def _args(dump: Path, tokenizer: str, *extra: str) -> list[str]:
    return [
        "--config", str(REPO / "train_configs" / "debug_eval.toml"),
        "--job.dump_folder", str(dump),
        "--training.steps", "3", "--training.seq_len", "128", "--training.global_batch_size", "4",
        "--lr_scheduler.warmup_steps", "1",
        "--data.tokenizer", tokenizer,
        "--eval.lengths", str(LENGTH), "--eval.depths", "2", "--eval.loss_rows", "2",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "true",
        *extra,
    ]


def _train_jobs(rank, world, jobs):
    from ulysses_dtensor.trainer.loop import train

    for argv in jobs:
        train(load_config(argv))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaltrain")
    tok = str(build_bpe_tokenizer(d))
    with_eval = _args(d / "with_eval", tok, "--eval.interval", "2")
    without = _args(d / "without", tok, "--eval.interval", "0", "--checkpoint.enable", "false")
    run_ranks(4, _train_jobs, [with_eval, without])
    return d, tok


def test_trainer_evaluates_and_the_checkpoint_gives_the_same(runs, capsys):
    d, tok = runs
    dump = d / "with_eval"
    metrics, plain = _rows(dump / "metrics.jsonl"), _rows(d / "without" / "metrics.jsonl")
    # evaluating in between changes nothing in training
    assert [m["loss"] for m in metrics] == [m["loss"] for m in plain]
    assert [m["grad_norm"] for m in metrics] == [m["grad_norm"] for m in plain]
    # the all-to-all time and its share of the step, every step (sp 2, eager)
    for m in metrics:
        assert m["exchange_ms"] > 0 and 0.0 < m["exchange_share"] < 1.0
        assert m["exchange_ms"] == pytest.approx(m["exchange_fwd_ms"] + m["exchange_bwd_ms"])
    # training read the split's training side (recorded with the checkpoint)
    state = json.loads((dump / "checkpoint" / "step-3" / "train_state.json").read_text())
    assert state["data"]["source"].startswith("heldout-split(fraction=0.05)/train:")

    rows = _rows(dump / "eval" / "eval.jsonl")
    assert sorted({r["step"] for r in rows}) == [2, 3]
    for step in (2, 3):
        for name in (f"heatmap_step{step}.png", f"loss_by_position_step{step}.png"):
            assert (dump / "eval" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = [r for r in rows if r["step"] == 3 and r["kind"] == "retrieval"]
    assert {(r["task"], r["depth"]) for r in cells} == {
        (t, x) for t in ("passkey", "multikey", "vartrack") for x in (0.0, 1.0)}
    (summary,) = [r for r in rows if r["step"] == 3 and r["kind"] == "eval"]
    assert summary["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "sp": 2, "ring": 1}
    assert summary["train_steps_equivalent"] > 0
    events = b"".join(p.read_bytes() for p in (dump / "tb").iterdir())
    for tag in (f"eval/passkey/len{LENGTH}/accuracy", f"eval/loss/len{LENGTH}", "train/exchange_share"):
        assert tag.encode() in events, tag

    # The eval entry point on the step-3 checkpoint, one process (sp 1, no FSDP sharding).
    from ulysses_dtensor.eval import evaluate

    out = d / "cli"
    cli = evaluate(_args(dump, tok, "--parallelism.sp", "1", "--checkpoint", str(dump / "checkpoint"),
                         "--output", str(out)))
    assert "evaluating" in capsys.readouterr().out
    trainer = [r for r in rows if r["step"] == 3]
    assert [r["kind"] for r in cli] == [r["kind"] for r in trainer]
    worst = 0.0
    for a, b in zip(cli, trainer):
        if a["kind"] == "eval":
            assert a["mesh"]["sp"] == 1 and a["step"] == 3
            continue
        for key in ("tokens", "correct", "needle_index", "accuracy"):
            assert a.get(key) == b.get(key), (a, b)
        for key in ("loss", "mean_logprob"):
            if b.get(key) is not None:
                worst = max(worst, abs(a[key] - b[key]))
    print(f"max abs diff trainer (dp2 x sp2) vs checkpoint eval (1 process): {worst:.3g}")
    assert worst < 1e-5
    assert _rows(out / "eval.jsonl") == json.loads(json.dumps(cli))

    # Held-out documents must be the ones the checkpoint never trained on.
    with pytest.raises(DataError, match=r"trained on data source 'heldout-split\(fraction=0.05\)/train"):
        evaluate(_args(dump, tok, "--parallelism.sp", "1", "--eval.holdout_fraction", "0.2",
                       "--output", str(d / "cli_bad")))


def test_eval_config_errors(tmp_path):
    def err(toml: dict, match: str, *, validate_world: int | None = None):
        with pytest.raises(ConfigError, match=match):
            cfg = parse_config(toml)
            if validate_world:
                from ulysses_dtensor.trainer.config_checks import validate_config

                validate_config(cfg, validate_world)

    err({"eval": {"interval": 5}}, r"'loss', which needs held-out documents: set eval.data_path",
        validate_world=1)
    err({"eval": {"data_path": "x.jsonl", "holdout_fraction": 0.1}}, "both name held-out documents")
    err({"eval": {"tasks": ["loss"], "depths": 4}}, r"eval.depths=4 \(from the TOML file\) has no effect")
    err({"eval": {"tasks": ["passkey"], "holdout_fraction": 0.1}}, "eval.holdout_fraction=0.1 .* has no effect")
    err({"eval": {"tasks": ["pasky"]}}, r"did you mean 'passkey'")
    err({"metrics": {"exchange_timing": False}}, r"metrics.exchange_timing=false .* has no effect: it "
        r"times the eager Ulysses all-to-alls .* parallelism.sp=1")
    err({"eval": {"interval": 1, "data_path": str(tmp_path / "none.jsonl")}}, "eval.data_path=.* is not a",
        validate_world=1)
    from ulysses_dtensor.data import ByteTokenizer
    from ulysses_dtensor.trainer.eval_setup import check_eval_setup

    cfg = parse_config({"eval": {"interval": 1, "tasks": ["passkey", "multikey"], "lengths": [300]}})
    with pytest.raises(ConfigError, match=r"eval.lengths \[300\] are too short for eval task 'multikey'"):
        check_eval_setup(cfg, ByteTokenizer())


def test_eval_of_an_hf_model_directory(runs, tmp_path):
    """``model.hf_path`` without ``--checkpoint``: the HF model itself is evaluated
    (the base model before a context extension); its answer log-probabilities are
    those transformers computes."""
    import shutil
    import sys

    import numpy as np
    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_hf_model import hf_config, hf_model

    from ulysses_dtensor.data import HFTokenizer
    from ulysses_dtensor.eval import evaluate
    from ulysses_dtensor.evaluation.scoring import teacher_forced_score
    from ulysses_dtensor.evaluation.tasks import SampleGenerator

    d, tok = runs
    hf_dir = tmp_path / "hf_llama"
    model = hf_model(hf_config("llama", vocab_size=448), seed=0, perturb=0.1)
    model.save_pretrained(hf_dir)
    shutil.copy(tok, hf_dir / "tokenizer.json")
    length = 130
    rows = evaluate(["--config", str(REPO / "train_configs" / "debug_eval.toml"),
                     "--model.hf_path", str(hf_dir), "--data.tokenizer", str(hf_dir / "tokenizer.json"),
                     "--parallelism.sp", "1",
                     "--job.dump_folder", str(tmp_path / "dump"), "--eval.tasks", "passkey",
                     "--eval.depths", "2", "--eval.lengths", str(length)])
    cells = [r for r in rows if r["kind"] == "retrieval"]
    assert [r["depth"] for r in cells] == [0.0, 1.0] and rows[-1]["step"] == 0
    gen = SampleGenerator(HFTokenizer(hf_dir / "tokenizer.json"), seed=1234)  # eval.seed's default
    for r in cells:
        s = gen.sample("passkey", length, r["depth"])
        with torch.no_grad():
            logits = model(torch.from_numpy(s.tokens)[None]).logits[0]
        ok, logprob = teacher_forced_score(logits[s.answer_start - 1:-1], torch.from_numpy(s.tokens[s.answer_start:]))
        assert r["correct"] == [ok] and r["needle_index"] == [s.needle_index]
        assert np.isclose(r["mean_logprob"], logprob, atol=1e-4), (r["mean_logprob"], logprob)
    assert (tmp_path / "dump" / "eval_checkpoint" / "eval.jsonl").is_file()
