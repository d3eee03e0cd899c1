"""The recipes README lists, each run tiny: the shipped TOML file itself, shrunk to CPU size.

A recipe is a GPU config (train_configs/*.toml). Its tiny run keeps everything the file says
(stages, ropes per stage, memory switches, packing, loss masking, implementation) and changes
only sizes: every length and the tokens per step divided by a scale (a YaRN rope's original
length too, so each stage stretches the rope by the same factor), one step per stage, a tiny
model made offline in place of the checkpoint, sp 2 on two CPU ranks, tiny data in place of
the user's, and eager blocks (``training.compile`` has its own test, tests/test_parallelize.py:
inductor's compile would cost this file a minute), the whole local batch in one pass. All recipes run in one launch of two ranks.

What each run must show: every stage ran at its (shrunk) length with exactly the tokens per
step the recipe asks for, the losses are finite, and the last stage trained with its own rope
(the checkpoint's record of it).
"""

import json
import math
import sys
from pathlib import Path

import pytest

from distributed import run_ranks

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_hf_model import make_tiny_hf_model  # noqa: E402
from make_tiny_sft_data import make_tiny_sft_data  # noqa: E402

pytest.importorskip("transformers")

def shrink(recipe: str, scale: int, **overrides) -> dict:
    """The recipe's TOML with its sizes divided by ``scale``, one step per stage, sp 2, eager, and a
    checkpoint at the last step; ``overrides``: {"section.key": value} for what the tiny run replaces
    (model, data)."""
    toml = tomllib.loads((REPO / "train_configs" / f"{recipe}.toml").read_text())
    tr = toml["training"]
    stages = toml.setdefault("context", {}).setdefault("schedule", [])
    if not stages:  # one length for the whole run: a schedule of one stage, as the trainer reads it
        stages.append({"start_step": 1, "seq_len": tr.pop("seq_len")})
    for i, st in enumerate(stages):
        st["start_step"] = i + 1
        st["seq_len"] //= scale
        scaling = st.get("rope_scaling") or {}
        if "original_max_position_embeddings" in scaling:
            scaling["original_max_position_embeddings"] //= scale
    tr["steps"] = max(len(stages), 2)
    tr["compile"] = False
    # A 1M-token step is 128 sequences at the 8K stage: in one pass here, not 64 micro-batches a rank
    # (gradient accumulation has its own parity tests, tests/test_train.py).
    tr.pop("micro_batch_size", None)
    toml.setdefault("lr_scheduler", {})["warmup_steps"] = 1  # warm-up then decay within the few steps
    if "tokens_per_step" in tr:
        tr["tokens_per_step"] //= scale
    toml["parallelism"]["sp"] = 2
    toml["checkpoint"] = {"enable": True, "interval": tr["steps"], "keep_latest_k": 1}
    toml["metrics"] = {"log_freq": 1}
    toml.pop("eval", None)  # evaluation has tests of its own (tests/test_eval_trainer.py)
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        toml.setdefault(section, {})[key] = value
    return toml


def _train_all(rank: int, world: int, tomls: list[dict]) -> None:
    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.loop import train

    for toml in tomls:
        train(parse_config(toml))


def _documents(path: Path, count: int = 24) -> Path:
    """Long-ish text documents as a user's .jsonl: the standard library's own sources."""
    import json as _json
    import os

    files = sorted(Path(os.__file__).parent.glob("*.py"))[:count]
    path.write_text("".join(_json.dumps({"text": f.read_text(errors="replace")}) + "\n" for f in files))
    return path


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    make_tiny_hf_model(root / "qwen3", "qwen3")
    make_tiny_sft_data(root / "sft", "llama3", n=48, model=True)
    docs = _documents(root / "long_documents.jsonl")
    runs = {
        # 1M -> 1,024 tokens; the user's long documents as .jsonl
        "qwen3_8b_hf_1m": shrink("qwen3_8b_hf_1m", 1024, **{"model.hf_path": str(root / "qwen3"),
                                                            "data.path": str(docs)}),
        # from scratch: the debug flavor's shape in place of Llama-3-8B's, the byte tokenizer as shipped
        "llama3_8b_progressive": shrink("llama3_8b_progressive", 1024, **{"model.flavor": "debug"}),
        # 64K -> 256-token rows: the tiny conversations (up to ~150 tokens) fit whole, as overlong="error" needs;
        # the user's chat .jsonl read raw (rendered at load) in place of the prepared store
        "llama3_8b_sft_64k": shrink("llama3_8b_sft_64k", 256, **{"model.hf_path": str(root / "sft" / "model"),
                                                                 "data.path": str(root / "sft" / "chat.jsonl")}),
    }
    for name, toml in runs.items():
        toml["job"]["dump_folder"] = str(root / name)
    run_ranks(2, _train_all, list(runs.values()))
    return root, runs


def _rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["qwen3_8b_hf_1m", "llama3_8b_progressive", "llama3_8b_sft_64k"])
def test_recipe_runs_tiny(recipes, name):
    root, runs = recipes
    toml = runs[name]
    stages = toml["context"]["schedule"]
    lengths = [st["seq_len"] for st in stages] + [stages[-1]["seq_len"]] * (toml["training"]["steps"] - len(stages))
    rows = _rows(root / name)
    assert [r["seq_len"] for r in rows] == lengths
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
    tokens = toml["training"].get("tokens_per_step")
    if tokens:  # constant tokens per step: 1,024 tokens every step, whatever the stage's length
        assert [b["tokens_seen"] - a["tokens_seen"] for a, b in zip([{"tokens_seen": 0}] + rows, rows)] == \
            [tokens] * len(rows)
    state = json.loads((root / name / "checkpoint" / f"step-{len(lengths)}" / "train_state.json").read_text())
    last = toml["context"]["schedule"][-1].get("rope_scaling")
    if last:  # the last stage's rope is the one it trained with (and the one the export writes)
        rope = state["context"]["rope"]
        assert rope["rope_type"] == last["rope_type"] and rope["factor"] == last["factor"], rope


def test_qwen3_1m_recipe_runs_tiny(recipes):
    """The recipe README leads with: the 1M Qwen3-8B config, its four YaRN stages and memory switches."""
    root, runs = recipes
    toml = runs["qwen3_8b_hf_1m"]
    factors = [(st.get("rope_scaling") or {}).get("factor") for st in toml["context"]["schedule"]]
    assert factors == [None, 4.0, 8.0, 32.0]
    assert toml["memory"]["offload_activations"] and toml["activation_checkpoint"]["save_attention"]
    config = json.loads((root / "qwen3_8b_hf_1m" / "config.json").read_text())
    assert config["model"]["implementation"] == "auto" and config["parallelism"]["sp"] == 2
