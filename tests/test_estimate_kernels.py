"""The memory planner plans the attention kernel the target GPU runs (issue 41 item 4).

gpt-oss (a sliding window on every other layer, sinks on every layer) planned for an
H100 runs FlexAttention there (auto's row for sinks), which keeps O(S): its planned
peak grows linearly with the length. Planned for the CPU it runs sdpa's explicit
(B, H, S, S) scores, quadratic. The plan names the kernel; a named backend that cannot
run on the planned GPU is a config error naming the key and the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ulysses_dtensor.attention import Capabilities  # noqa: E402
from ulysses_dtensor.estimate import cli, plan_memory  # noqa: E402
from ulysses_dtensor.trainer.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H100 = Capabilities.target("H100", "2.11")


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    from transformers import GptOssConfig

    path = tmp_path_factory.mktemp("gpt_oss")
    GptOssConfig(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                 max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).save_pretrained(path)
    return path


def _cfg(path):
    return load_config([
        "--config", str(REPO / "train_configs" / "debug_hf.toml"), "--model.hf_path", str(path),
        "--model.implementation", "transformers", "--training.mixed_precision_param", "bfloat16",
        "--parallelism.sp", "2", "--parallelism.dp_shard", "1", "--training.global_batch_size", "1",
    ])


def _plan(path, seq_len, **target):
    return plan_memory(_cfg(path), 2, seq_len, rows=1, layers="full", **target)


def test_a_windowed_family_with_sinks_is_planned_with_the_gpus_kernel(gpt_oss_dir):
    gpu = [_plan(gpt_oss_dir, s, device="cuda", target=H100) for s in (1024, 2048, 4096)]
    cpu = _plan(gpt_oss_dir, 4096, device="cpu")
    assert {(a["kernel"], a["memory"]) for a in gpu[-1].attention} == {("flex", "lse")}, gpu[-1].attention
    assert gpu[-1].target == H100.describe() and "flex for sliding window + sinks" in gpu[-1].format()
    assert {(a["kernel"], a["memory"]) for a in cpu.attention} == {("sdpa", "dense_scores")}
    # Doubling the length doubles the planned increment when the kernel keeps O(S) ...
    p = [plan.peak_bytes for plan in gpu]
    assert (p[2] - p[1]) / (p[1] - p[0]) == pytest.approx(2.0, abs=0.15), p
    # ... while the CPU's sdpa holds (B, H, S, S) float32 scores: 2 local heads x 4096^2 x 4 B = 128 MiB.
    assert cpu.peak_bytes - gpu[-1].peak_bytes > 2 * 4096 * 4096 * 4


def test_plain_causal_on_hopper_plans_cudnn_and_a_named_backend_is_checked_on_that_gpu(capsys):
    base = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--training.mixed_precision_param",
            "bfloat16", "--seq-len", "256", "--layers", "full", "--json"]
    assert cli.main(base + ["--model.attn_backend", "fa4", "--gpu", "A100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.attn_backend='fa4'" in err and "sm80" in err, err
    assert cli.main(base + ["--gpu", "H100"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target"].startswith("sm90") and plan["attention"][0]["kernel"] == "cudnn"
    assert plan["attention"][0]["case"] == "plain causal" and plan["attention"][0]["memory"] == "lse"
    assert cli.main(base + ["--device", "cpu", "--gpu", "H100"]) == 2
    assert "--device cuda" in capsys.readouterr().err
