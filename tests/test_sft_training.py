"""SFT on chat data through the trainer: the loss is the token-weighted mean over the
global batch's assistant tokens, the same on one process, on dp 2 x sp 2 and with
gradient-accumulation micro-batches, and equal (loss and gradient norm) to a masked
cross entropy computed by hand on transformers' own unsharded model, one forward per
packed sample. The held-out loss of ``python -m ulysses_dtensor.eval`` covers the same
target tokens (prompts ignored), again equal to the hand computation.

The job is ``train_configs/debug_sft.toml`` with its data made offline
(``scripts/make_tiny_sft_data.py``: a tiny random HF Llama, a ChatML template, 64
conversations) and prepared with ``prepare_data --format chat``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_ranks

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_sft_data import make_tiny_sft_data  # noqa: E402

pytest.importorskip("transformers")
STEPS, BATCH, SEQ = 2, 4, 128


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    from ulysses_dtensor.prepare_data import main as prepare

    root = tmp_path_factory.mktemp("sft")
    make_tiny_sft_data(root, "chatml", n=64, model=True)
    assert prepare(["--format", "chat", "--input", str(root / "chat.jsonl"), "--tokenizer",
                    str(root / "model" / "tokenizer.json"), "--output", str(root / "store"), "--workers", "1"]) == 0
    return root


def _config(root: Path, dump: Path, mesh, *extra):
    toml = tomllib.loads((REPO / "train_configs" / "debug_sft.toml").read_text())
    rep, shard, sp = mesh
    overrides = [
        ("model.hf_path", str(root / "model")), ("data.path", str(root / "store")),
        ("job.dump_folder", str(dump)), ("training.steps", str(STEPS)),
        ("training.global_batch_size", str(BATCH)), ("context.schedule", f"1:{SEQ}"),
        ("eval.interval", "0"), ("metrics.log_freq", "1"),
        ("parallelism.dp_replicate", str(rep)), ("parallelism.dp_shard", str(shard)),
        ("parallelism.sp", str(sp)), *extra,
    ]
    return toml, overrides


def _train(toml, overrides):
    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.loop import train

    train(parse_config(toml, overrides))


def _ranks(rank, world, job):
    _train(*job)


def _rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _masked_loss(model, ids: np.ndarray, pos: np.ndarray, targets: np.ndarray):
    """(summed cross entropy over target tokens, their count): each packed sample of each
    row its own forward from position 0; token t predicts t + 1 inside its sample when
    t + 1 is a target."""
    total, count = torch.zeros(()), 0
    for r in range(ids.shape[0]):
        starts = list(np.flatnonzero(pos[r] == 0)) + [ids.shape[1]]
        for a, b in zip(starts[:-1], starts[1:]):
            seg = torch.from_numpy(ids[r, a:b])[None]
            logits = model(seg).logits[0, :-1].float()
            mask = torch.from_numpy(targets[r, a + 1:b] != 0)
            if mask.any():
                total = total + torch.nn.functional.cross_entropy(
                    logits[mask], seg[0, 1:][mask], reduction="sum")
                count += int(mask.sum())
    return total, count


def _hf_model(root: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()


def test_sft_loss_same_on_three_meshes_and_equal_to_hand_masked_loss(sft, tmp_path):
    from ulysses_dtensor.data import build_tokenizer
    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.data_setup import build_training_data
    from ulysses_dtensor.trainer.hf_start import tokenizer_spec

    _train(*_config(sft, tmp_path / "1x1x1", (1, 1, 1)))
    _train(*_config(sft, tmp_path / "micro", (1, 1, 1), ("training.micro_batch_size", "1")))
    run_ranks(4, _ranks, _config(sft, tmp_path / "1x2x2", (1, 2, 2)))
    ref = _rows(tmp_path / "1x1x1")
    # LoRA on the same SFT rows: step 1 is the base model's (B starts at zero), then adapters train
    _train(*_config(sft, tmp_path / "lora", (1, 1, 1), ("lora.rank", "4")))
    lora = _rows(tmp_path / "lora")
    assert lora[0]["loss"] == ref[0]["loss"] and lora[1]["loss"] != ref[1]["loss"]
    for name in ("micro", "1x2x2"):
        rows = _rows(tmp_path / name)
        print(f"{name}: max rel diff loss "
              f"{max(abs(a['loss'] - b['loss']) / b['loss'] for a, b in zip(rows, ref)):.1e}, grad norm "
              f"{max(abs(a['grad_norm'] - b['grad_norm']) / b['grad_norm'] for a, b in zip(rows, ref)):.1e}")
        for a, b in zip(rows, ref):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (name, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (name, a["step"])

    # By hand: step 1's global batch as the trainer's data reads it (4 rows of 128, samples
    # best-fit packed whole, the row ends padded), the unsharded transformers model, one
    # forward per sample, loss over targets.
    cfg = parse_config(*_config(sft, tmp_path / "x", (1, 1, 1)))
    data = build_training_data(cfg)
    loader = data.loader(build_tokenizer(tokenizer_spec(cfg)), 0, 1, cfg.context_schedule(), 0)
    batch = loader.batch_for(1)
    pad_share = loader.batch_stats()["pad_share"]
    loader.close()
    ids, pos = batch["input_ids"].numpy(), batch["position_ids"].numpy()
    tgt = (batch["labels"].numpy() != -100).astype(np.uint8)
    assert data.preview["steps"] == STEPS and 0 < pad_share < 0.5  # the banner previews the padding of the steps
    assert ref[0]["pad_share"] == pad_share and ref[0]["samples_truncated"] > 0  # metrics.jsonl logs it
    model = _hf_model(sft)
    total, count = _masked_loss(model, ids, pos, tgt)
    loss = total / count
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    n_pred = sum(int((pos[r] != 0).sum()) - 1 for r in range(BATCH))  # rough count of next-token predictions
    assert 0 < count < n_pred / 2, (count, n_pred)  # prompts and templates are not targets
    print(f"hand: loss {loss.item():.6f} over {count} target tokens (trainer {ref[0]['loss']:.6f}), "
          f"grad norm {grad_norm.item():.6f} (trainer {ref[0]['grad_norm']:.6f})")
    assert ref[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert ref[0]["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)


def test_eval_loss_is_over_the_held_out_targets_only(sft, tmp_path):
    """``python -m ulysses_dtensor.eval`` on the HF model: the held-out loss counts
    exactly the target tokens of the held-out rows and equals the hand masked loss."""
    from ulysses_dtensor.data import TokenStream
    from ulysses_dtensor.eval import evaluate
    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.data_setup import build_training_data

    toml, overrides = _config(sft, tmp_path / "eval", (1, 1, 1))
    overrides += [("eval.lengths", str(SEQ))]
    argv = ["--config", str(REPO / "train_configs" / "debug_sft.toml")]
    for k, v in overrides:
        argv += [f"--{k}", v]
    out = evaluate(argv)
    (row,) = [r for r in out if r["kind"] == "loss"]

    cfg = parse_config(toml, overrides)
    held = build_training_data(cfg).held_out
    stream = TokenStream(held, shuffle=False)
    rows = [stream.read(i * SEQ, SEQ) for i in range(cfg.eval.loss_rows)]
    ids, pos, tgt = (np.stack([r[k] for r in rows]) for k in range(3))
    with torch.no_grad():
        total, count = _masked_loss(_hf_model(sft), ids, pos, tgt)
    assert row["tokens"] == count and 0 < count < ids.size / 2
    assert row["loss"] == pytest.approx(total.item() / count, rel=1e-5)
