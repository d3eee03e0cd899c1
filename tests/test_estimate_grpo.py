"""The planner's GRPO mode (``ulysses_dtensor.estimate.grpo``, ``--grpo``) on a tiny
transformers Llama from its config.json alone, 4 fake ranks (dp_shard 2 x sp 2), CPU:

* a GRPO step holds exactly the reference model's parameter shards (fp32, dim 0 padded
  per rank as FSDP2 pads it) and buffers more than a training step, from the start;
  with LoRA there is no reference model and nothing more;
* the reference's forward (and with ``--grpo-iterations 2`` the old policy's) is a phase
  of its own; the command line prints the plan with what GRPO adds.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from ulysses_dtensor.estimate import plan_memory  # noqa: E402
from ulysses_dtensor.estimate.grpo import grpo_plan  # noqa: E402
from ulysses_dtensor.trainer.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORLD, SEQ = 4, 64


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("config_only")
    LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=4096).save_pretrained(d)
    return d


def argv(config_dir: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "train_configs" / "debug_hf.toml"), "--model.hf_path", str(config_dir),
            "--model.implementation", "transformers", "--parallelism.dp_shard", "2", "--parallelism.sp", "2",
            "--memory.tiled_loss", "true", "--memory.loss_chunks", "2", *extra]


def reference_bytes(config_dir: Path) -> int:
    """fp32 parameter shards of one of 4 ranks (dim 0 padded to a multiple of 4) and the buffers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    params = sum(math.ceil(p.shape[0] / WORLD) * (p.numel() // p.shape[0]) * 4 for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


def test_a_grpo_step_holds_the_reference_shards_and_runs_its_forward(config_dir):
    def plans(*extra):
        cfg = load_config(argv(config_dir, *extra))
        return [grpo_plan(cfg, WORLD, SEQ, rows=1, device="cpu", layers="full", reference=ref) for ref in (True, False)]

    with_ref, beta0 = plans()
    assert with_ref.phase_peaks["setup"] - beta0.phase_peaks["setup"] == reference_bytes(config_dir)
    assert {"reference", "forward", "backward"} <= set(with_ref.phase_peaks) and "reference" not in beta0.phase_peaks
    assert with_ref.notes[0].startswith("GRPO step (UlyssesGRPOTrainer): the reference model sharded like the policy")
    # The training step of the same model: GRPO's policy step is of its size (the head computes
    # per-token values instead of a cross entropy), the reference on top.
    train = plan_memory(load_config(argv(config_dir)), WORLD, SEQ, rows=1, device="cpu", layers="full")
    assert abs(beta0.phase_peaks["setup"] - train.phase_peaks["setup"]) <= 16  # a scalar or two of the step's own
    # LoRA: the reference is the policy with its adapter off, nothing more to hold.
    with_ref, beta0 = plans("--lora.rank", "4")
    assert with_ref.phase_peaks["setup"] == beta0.phase_peaks["setup"] and "reference" in with_ref.phase_peaks


def test_the_command_line_plans_a_grpo_step(config_dir, capsys):
    from ulysses_dtensor.estimate import main

    assert main([*argv(config_dir), "--grpo", "--grpo-iterations", "2", "--world-size", str(WORLD), "--seq-len",
                 str(SEQ), "--device", "cpu", "--layers", "full"]) == 0
    out = capsys.readouterr().out
    phases = out[out.index("peak by phase"):]
    assert "reference" in phases and "old_policy" in phases
    assert "the old policy's forward at rollout time (num_iterations > 1)" in out
