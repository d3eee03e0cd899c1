"""UlyssesDPOTrainer: TRL's DPO script, changed in one place, trains on every mesh what TRL's
own DPOTrainer trains in one process.

The script is the shipped example (``scripts/example_trl_dpo.py``), run as
tests/test_trl_grpo.py runs GRPO's: TRL's ``DPOTrainer`` in a world of 1, ours in a
world of 4; 4 pairs a step (chosen and rejected of different lengths, right-padded by
TRL's collator, packed into documents here), fp32, 3 steps. Every step's loss, grad
norm, chosen / rejected log-probabilities, entropy, token accuracy, token count (and
MoE router loss) agree to relative 1e-5; the rewards (``beta x`` differences of
log-probabilities of ~-150 that differ by ~0.1) to 1e-5 of ``beta x`` the
log-probabilities they are differences of; every rank logs the same.

======================================  ===========  =====================  =====================================
case                                    family       mesh                   what it exercises
======================================  ===========  =====================  =====================================
sigmoid, reference on the fly           llama        dp_shard 2 x sp 2      the reference sharded like the policy
every loss type, MoE                    qwen3_moe    sp 4                   all 15 of TRL's loss types at once
                                                                            (ipo, aot's sort over the batch, sft,
                                                                            ...), the router loss
ipo, precomputed reference              llama        ring 2 x ulysses 2     precompute_ref_log_probs: the policy
                                                                            under SP before its first step
LoRA, WPO weights, LD-DPO               qwen3_next   dp_shard 2 x sp 2      the reference = the adapter off,
                                                                            log sum p^2, ld_alpha; a hybrid
======================================  ===========  =====================  =====================================
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("transformers", "trl", "peft", "datasets")):
    pytest.skip("needs the hf, lora and trl extras", allow_module_level=True)

from test_trl_grpo import ROOT, assert_close_logs, common, model_dirs, run_cases  # noqa: E402, F401

DPO_SCRIPT = ROOT / "scripts" / "example_trl_dpo.py"
BETA = 0.1  # DPOConfig's default
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
# case -> (family, mesh, the script's flags, flags for our run only)
CASES = {
    "sigmoid, reference on the fly": ("llama", "dp_shard 2 x sp 2", [], ["--tiled_mlp", "--loss_chunks", "2"]),
    "every loss type, MoE": ("qwen3_moe", "sp 4", ["--loss_type", *LOSS_TYPES, "--label_smoothing", "0.1"], []),
    "ipo, precomputed reference": ("llama", "ring 2 x ulysses 2", ["--loss_type", "ipo",
                                                                  "--precompute_ref_log_probs", "true"], []),
    "LoRA, WPO weights, LD-DPO": ("qwen3_next", "dp_shard 2 x sp 2", ["--lora_r", "4", "--learning_rate", "3e-2",
                                                                     "--use_weighting", "true", "--ld_alpha", "0.5"],
                                  []),
}
KEYS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "entropy", "mean_token_accuracy", "num_tokens",
        "aux_loss", "rewards/chosen", "rewards/rejected", "rewards/margins")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")


def dpo_argv(out: Path, model: Path, rows: int, *extra: str) -> list[str]:
    return common(out, model, rows // 2, "3e-3", *extra)  # rows: completions, two per pair


def reward_scale(step: dict, key: str) -> float:
    """The magnitude a value's rounding is relative to: a reward, ``beta`` times that of the
    log-probabilities it is a difference of."""
    if key in REWARDS:
        return BETA * max(abs(step["logps/chosen"]), abs(step["logps/rejected"]))
    return abs(step[key])


def test_dpo_script_equals_trl_in_one_process_on_every_mesh(model_dirs, tmp_path):
    results = run_cases(tmp_path, model_dirs, DPO_SCRIPT, "DPOTrainer", CASES, dpo_argv)
    lines = []
    for case, (got, want) in results.items():
        family, mesh = CASES[case][:2]
        worst = assert_close_logs(got["logs"], want["logs"], case, KEYS, reward_scale)
        lines.append(f"DPO {case} | {family} | {mesh}: worst rel. err. {worst:.1e}")
        assert any(abs(e["rewards/margins"]) > 0 for e in want["logs"].values()), case  # the policy moved
    assert "aux_loss" in results["every loss type, MoE"][1]["logs"][1]
    print("\n" + "\n".join(lines))
