"""The library blocks for policy-gradient and preference losses in a loop of your own
(:mod:`ulysses_dtensor.memory.token_logprobs`, ``.sequence_values``, ``.policy_loss``),
the packing of padded rows TRL's trainers hand over, and the GRPO planner's refusal.

* per-token values are those of ``log_softmax`` (log-probability, entropy, ``log sum
  p^2``, mean logit, argmax), 0 where no target; in chunks, values and gradients equal
  the unchunked ones;
* on 2 ranks (sp 2, and a ring of 2): the slices gathered are the whole sequence, and
  per-sequence sums over the sp ranks are those of the whole sequence; a loss of the
  gathered values has, summed over the ranks, the gradient of the loss of the whole;
* the docs' custom-loop GRPO step (``docs/rl-and-preference.md``, run as written) gives
  on sp 2 the loss and gradients it gives in one process.

(The GRPO loss of every type against TRL's own: tests/test_trl_grpo.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

from ulysses_dtensor.integrations.trl.sp_logprobs import PackedRows
from ulysses_dtensor.parallel.policy_loss import grpo_loss
from ulysses_dtensor.parallel.sequence_values import sp_gather_tokens, sp_sequence_means, sp_sequence_sums
from ulysses_dtensor.memory.token_logprobs import TOKEN_FIELDS, chunked_token_stats, token_stats

ROOT = Path(__file__).resolve().parents[1]


def test_token_stats_are_those_of_log_softmax_and_zero_without_a_target():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[0, 1] = targets[1, 4] = -100
    got = token_stats(logits, targets, TOKEN_FIELDS, temperature=0.7)
    z = logits / 0.7
    logp = F.log_softmax(z, dim=-1)
    valid = targets != -100
    safe = targets.clamp(min=0)
    want = {
        "log_probs": logp.gather(-1, safe[..., None])[..., 0],
        "entropy": -(logp.exp() * logp).sum(-1),
        "log_sum_sq_probs": torch.log((logp.exp() ** 2).sum(-1)),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == safe,
    }
    for name, value in want.items():
        expected = value.masked_fill(~valid, False if name == "is_top1" else 0.0)
        if name == "is_top1":
            assert torch.equal(got[name], expected)
        else:
            torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="token fields \\['logp'\\]: each must be one of log_probs"):
        token_stats(logits, targets, ("logp",))


def test_chunked_token_stats_equal_the_whole_values_and_gradients():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 13)
    targets = torch.randint(0, 13, (2, 9), generator=g)
    targets[:, 0] = -100
    results = []
    for chunks in (1, 4):
        hidden.grad, head.weight.grad = None, None
        out = chunked_token_stats(hidden, head, targets, ("log_probs", "entropy"), chunks=chunks)
        (out["log_probs"].sum() + 0.3 * out["entropy"].sum()).backward()
        results.append((out["log_probs"].detach(), hidden.grad.clone(), head.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_packed_rows_keep_each_rows_real_tokens_and_put_values_back():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0]])
    rows = PackedRows(mask)
    ids = torch.arange(18).reshape(3, 6)
    assert rows.pack(ids).tolist() == [[2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 16]]
    assert rows.position_ids("cpu").tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]]
    # Position t of a row predicts token t + 1: a value there when t + 1 is real.
    packed = torch.arange(11.0)[None, :, None]
    out = rows.unpack(packed, rows.shifted_places("cpu"))[..., 0]
    assert out.tolist() == [[0, 0, 0, 1, 2], [4, 5, 0, 0, 0], [0, 7, 8, 9, 0]]
    with pytest.raises(ValueError, match="attention_mask row 1 has holes"):
        PackedRows(torch.tensor([[1, 1, 1], [1, 0, 1]]))


def test_grpo_loss_refuses_what_it_cannot_compute():
    logps = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="loss_type='ppo'; valid: grpo, bnpo, dr_grpo, dapo"):
        grpo_loss(logps, torch.zeros(2), torch.ones(2, 3), loss_type="ppo")
    with pytest.raises(ValueError, match="beta=0.1 needs ref_logps"):
        grpo_loss(logps, torch.zeros(2), torch.ones(2, 3), beta=0.1)
    with pytest.raises(ValueError, match="dr_grpo' divides by batch \\* max_completion_length"):
        grpo_loss(logps, torch.zeros(2), torch.ones(2, 3), loss_type="dr_grpo")


def test_grpo_planning_is_for_the_transformers_trainer():
    from ulysses_dtensor.estimate.grpo import prepare_grpo
    from ulysses_dtensor.trainer.config import ConfigError, load_config

    cfg = load_config(["--config", str(ROOT / "train_configs" / "debug_model.toml")])
    with pytest.raises(ConfigError, match="the GRPO step is planned for transformers' models"):
        prepare_grpo(cfg, 2, 64, rows=1, device="cpu", foreach=None, edges=True)


# -- on 2 ranks -----------------------------------------------------------------------------------


def _sequence_values(rank: int, world: int) -> list:
    """Per ring degree: what the blocks give this rank for its slice of one packed row of
    three sequences, and the gradient (on its slice) of a loss of the whole."""
    from ulysses_dtensor.parallel.mesh import ParallelDims
    from ulysses_dtensor.parallel.ring_layout import layout_indices

    out = []
    g = torch.Generator().manual_seed(2)
    values = torch.randn(1, 12, generator=g)
    seq_ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])  # three packed sequences
    for ring in (1, 2):
        pmesh = ParallelDims(dp_shard=1, sp=2, ring=ring, world_size=2).build_mesh("cpu")
        mine_idx = layout_indices(12, ring)[pmesh.sp_rank * 6:(pmesh.sp_rank + 1) * 6]  # as shard_batch slices
        mine = values[:, mine_idx].clone().requires_grad_(True)
        ids = seq_ids[:, mine_idx]
        whole = sp_gather_tokens(mine, pmesh.sp, 12)
        sums, counts = sp_sequence_sums(mine, pmesh.sp, sequence_ids=ids, num_sequences=3)
        means = sp_sequence_means(mine, pmesh.sp, sequence_ids=ids, num_sequences=3)
        loss = (whole ** 2).sum() + (sums ** 3).sum()  # a non-linear function of the whole
        loss.backward()
        grad = torch.zeros(1, 12).index_copy(1, mine_idx, mine.grad)  # this rank's share, in place
        out.append((whole.detach(), sums.detach(), counts, means.detach(), grad))
    return out


def test_sequence_values_over_sp_ranks_are_those_of_the_whole_sequence():
    got = run_ranks(2, _sequence_values)
    g = torch.Generator().manual_seed(2)
    values = torch.randn(1, 12, generator=g, requires_grad=True)
    seq_ids = torch.tensor([0] * 5 + [1] * 4 + [2] * 3)
    sums = torch.zeros(3).index_add(0, seq_ids, values[0])
    ((values ** 2).sum() + (sums ** 3).sum()).backward()
    for ring_result in zip(*got):
        for rank, (whole, s, counts, means, grad) in enumerate(ring_result):
            torch.testing.assert_close(whole, values.detach())
            torch.testing.assert_close(s, sums.detach())
            assert counts.tolist() == [5.0, 4.0, 3.0]
            torch.testing.assert_close(means, sums.detach() / counts)
            # The rank's gradient covers its own tokens only; summed over the ranks, the whole one.
        total = sum(r[4] for r in ring_result)
        torch.testing.assert_close(total, values.grad, rtol=1e-5, atol=1e-5)


def docs_example() -> str:
    """The custom-loop GRPO step of docs/rl-and-preference.md, as written there."""
    page = (ROOT / "docs" / "rl-and-preference.md").read_text()
    return re.search(r"<!-- the custom-loop example -->\n```python\n(.*?)```", page, re.S).group(1)


def _docs_example_step(rank: int, world: int, sp: int) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ulysses_dtensor.integrations.hf import parallelize_hf_model
    from ulysses_dtensor.parallel.mesh import ParallelDims

    namespace: dict = {}
    exec(compile(docs_example(), "docs/rl-and-preference.md", "exec"), namespace)  # noqa: S102
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config)
    pmesh = ParallelDims(dp_shard=1, sp=sp, world_size=world).build_mesh("cpu")
    parallelize_hf_model(model, pmesh)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (5, 3, 7, 4)]
    completions = [torch.randint(0, 96, (n,), generator=g) for n in (6, 2, 9, 4)]
    advantages = torch.tensor([1.0, -0.5, 0.3, -0.8])
    loss = namespace["grpo_step"](model, pmesh, prompts, completions, advantages)
    norm = torch.sqrt(sum((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).pow(2).sum()
                          for p in model.parameters() if p.grad is not None))
    return {"loss": float(loss), "grad_norm": float(norm)}


def test_docs_custom_loop_grpo_step_is_mesh_independent():
    one = run_ranks(1, _docs_example_step, 1)[0]
    two = run_ranks(2, _docs_example_step, 2)
    for r in two:
        assert r["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert one["grad_norm"] > 0
