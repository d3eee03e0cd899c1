"""Non-finite steps, the allocator default and the banner's memory switches, in one process.

The guard's decision and message (:mod:`ulysses_dtensor.runtime.nonfinite`), a skipped
step leaving weights and AdamW state bit for bit as they were (``train_step``), the
gradient norm leaving non-finite gradients unscaled, checkpoints refused from non-finite
state, the entry point's one message and exit status; ``PYTORCH_CUDA_ALLOC_CONF`` set
when unset and kept when set; the banner line of memory switches. The runs on gloo ranks
(a NaN loss, a NaN gradient on one rank, stop and resume) are in tests/test_train.py and
tests/test_hf_trainer.py.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch import nn

from ulysses_dtensor.runtime import allocator
from ulysses_dtensor.runtime.nonfinite import (
    NONFINITE_FAULT_ENV,
    NonFiniteError,
    NonFiniteGuard,
    NonFiniteStep,
)
from ulysses_dtensor.trainer.config import ConfigError, parse_config


class TinyLM(nn.Module):
    """The call interface train_step uses, on a 2-layer bag of embeddings."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids, position_ids=None, document_ids=None, labels=None, num_valid_tokens=None):
        logits = self.head(self.embed(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / num_valid_tokens


def _batch():
    ids = torch.arange(12).reshape(2, 6) % 16
    return {"input_ids": ids, "position_ids": torch.arange(6).expand(2, 6), "labels": (ids + 1) % 16,
            "document_ids": None}


def _state(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            {k: v.clone() for st in opt.state.values() for k, v in st.items()})


def test_a_skipped_step_changes_no_weight_and_no_optimizer_state(monkeypatch):
    from ulysses_dtensor.trainer.step import train_step

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = NonFiniteGuard(5, "training.max_nonfinite_steps")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(NONFINITE_FAULT_ENV, "loss:0:2,grad:0:3")
    train_step(model, opt, _batch(), 12, step=1, guard=guard, max_norm=1.0)
    assert guard.streak == []
    before = _state(model, opt)
    for step, kind in ((2, "loss"), (3, "grad")):
        _, norm = train_step(model, opt, _batch(), 12, step=step, guard=guard, max_norm=1.0)
        assert not math.isfinite(float(norm))
        after = _state(model, opt)
        for a, b in zip(before[0], after[0]):
            assert torch.equal(a, b), kind
        assert before[1].keys() == after[1].keys() and all(torch.equal(before[1][k], after[1][k]) for k in before[1])
        assert all(p.grad is None for p in model.parameters())
    assert [s.step for s in guard.streak] == [2, 3]
    assert guard.streak[0].loss_ranks == [0] and guard.streak[1].loss_ranks == []
    assert guard.streak[1].grads == {0: ["embed.weight"]}  # the hook's NaN: one parameter, gradients unscaled
    train_step(model, opt, _batch(), 12, step=4, guard=guard, max_norm=1.0)  # finite again: applied
    assert guard.streak == [] and guard.skipped_total == 2
    assert not torch.equal(before[0][0], model.embed.weight) and int(opt.state[model.embed.weight]["step"]) == 2


def test_a_nonfinite_norm_leaves_the_gradients_unscaled():
    from ulysses_dtensor.models.llama_parallelize import clip_grad_norm_

    a, b = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0, float("nan"), 1.0]), torch.tensor([4.0, 0.0])
    assert math.isnan(float(clip_grad_norm_([a, b], 1.0)))
    assert b.grad.tolist() == [4.0, 0.0] and a.grad[0] == 3.0  # not multiplied by NaN
    b.grad = torch.tensor([30.0, 40.0])
    a.grad = torch.zeros(3)
    assert float(clip_grad_norm_([a, b], 1.0)) == 50.0 and b.grad.tolist() == pytest.approx([0.6, 0.8])


def _verdict(step, **kw):
    return NonFiniteStep(step=step, world=kw.pop("world", 4), grad_norm=kw.pop("norm", float("nan")), **kw)


def test_the_guard_stops_after_max_steps_in_a_row_with_one_message():
    guard = NonFiniteGuard(2, "training.max_nonfinite_steps")
    guard.streak = [_verdict(7, loss_ranks=[1], grads={0: ["a"], 1: ["a", "b", "c", "d", "e"]})]
    assert not guard.should_stop()
    guard.streak += [_verdict(8, grads={2: ["w"]}), _verdict(9, grads={2: ["w"]})]
    assert guard.should_stop()
    message = str(guard.error("Last good checkpoint: /x/step-6 (step 6)."))
    assert message.startswith("training stopped at step 9: 3 steps in a row with a non-finite loss or gradient norm "
                              "(steps 7-9; training.max_nonfinite_steps=2 skips 2 in a row and stops at the next); "
                              "no update of those steps was applied. It started at step 7: loss not finite on rank 1. "
                              "Step 9: gradient norm nan, non-finite gradients on rank 2 (w). "), message
    assert _verdict(7, grads={0: ["a"], 1: ["a", "b", "c", "d", "e"]}).cause() == (
        "gradient norm nan, non-finite gradients on ranks 0, 1 (rank 0: a; rank 1: a, b, c and 2 more)")
    assert message.endswith("Last good checkpoint: /x/step-6 (step 6).")
    assert "\n" not in message
    stop_at_once = NonFiniteGuard(0, "UlyssesArguments.max_nonfinite_steps")
    stop_at_once.streak = [_verdict(3, world=2, norm=float("inf"), weights={0: ["w"], 1: ["w"]})]
    assert stop_at_once.should_stop()
    assert ("(step 3; UlyssesArguments.max_nonfinite_steps=0 stops at the first); no update of that step was applied. "
            "Step 3: gradient norm inf; weights not finite on every rank (rank 0: w; rank 1: w): an earlier update "
            "made them so.") in str(stop_at_once.error(""))
    assert _verdict(1, loss_ranks=[0, 1, 2, 3]).row() == {"skipped": True,
                                                          "skip_reason": "loss not finite on every rank"}
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"training.max_nonfinite_steps=.* must be an integer >= 0"):
            NonFiniteGuard(bad, "training.max_nonfinite_steps")


def test_no_checkpoint_from_nonfinite_state_and_the_entry_points_one_message(tmp_path, capsys, monkeypatch):
    from ulysses_dtensor.trainer.checkpoint import CheckpointManager
    from ulysses_dtensor.trainer.known_errors import exit_on_known_error

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    model(_batch()["input_ids"], labels=_batch()["labels"], num_valid_tokens=12).backward()
    opt.step()
    opt.state[model.head.bias]["exp_avg_sq"][3] = float("inf")
    ckpt = CheckpointManager(tmp_path / "ckpt", interval=1)
    with pytest.raises(NonFiniteError, match=r"checkpoint .*step-1 not written: the weights or optimizer state are "
                                             r"not finite \(rank 0: optimizer exp_avg_sq of head.bias\)"):
        ckpt.save(1, model, opt, {"step": 1})
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    # Under torchrun the first rank of a node to get here prints (runtime.node_report, its own
    # tests); outside it (no torchrun attempt folder) every rank prints its one line.
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info, exit_on_known_error():
            raise NonFiniteError("training stopped at step 5: the reason")
        assert exit_info.value.code == 3
        err = capsys.readouterr().err
        assert err == "training stopped at step 5: the reason\n", err


def test_config_keys_are_checked(monkeypatch):
    assert parse_config({}).training.max_nonfinite_steps == 3
    with pytest.raises(ConfigError, match=r"training.max_nonfinite_steps=-1 must be >= 0"):
        parse_config({"training": {"max_nonfinite_steps": -1}})
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ConfigError, match=r"^metrics.enable_wandb=true needs the 'wandb' package, which is not "
                                          r"installed: pip install 'ulysses-dtensor\[wandb\]'"):
        parse_config({"metrics": {"enable_wandb": True}})
    from ulysses_dtensor.integrations.hf.ulysses_trainer.arguments import UlyssesArguments

    with pytest.raises(ValueError, match=r"UlyssesArguments.max_nonfinite_steps=-2 must be an integer >= 0"):
        UlyssesArguments(max_nonfinite_steps=-2)


# -- the allocator --------------------------------------------------------------------------------------------


def test_the_allocator_default_is_applied_when_unset_and_the_users_kept(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", allocator.DEFAULTED_ENV):
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    assert allocator.apply_allocator_default() is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert calls == ["expandable_segments:True"]  # torch was imported: set in the running allocator too
    assert allocator.allocator_banner("cuda") == ("allocator: expandable_segments:True (this package's default; set "
                                                  "PYTORCH_CUDA_ALLOC_CONF to choose another)")
    assert allocator.allocator_banner("cpu").endswith(", for CUDA only: not in effect on cpu")
    assert allocator.apply_allocator_default() is False and calls == ["expandable_segments:True"]  # set once
    for name, value in (("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512"), ("PYTORCH_ALLOC_CONF", ""),
                        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")):
        env = {name: value}
        assert allocator.apply_allocator_default(env) is False and env == {name: value}  # the user's, kept
        assert allocator.allocator_banner("cuda", env) == f"allocator: {name}={value!r} (yours, kept)"
    assert allocator.allocator_banner("cuda", {}).startswith("allocator: torch's default allocator settings")


# -- the banner's memory switches ---------------------------------------------------------------------------


def test_the_banner_lists_every_memory_switch():
    from ulysses_dtensor.models.llama import llama_args
    from ulysses_dtensor.parallel.mesh import ParallelDims
    from ulysses_dtensor.trainer.memory_banner import memory_banner

    shape = llama_args("debug", vocab_size=320)
    dims = ParallelDims(dp_shard=2, sp=2, world_size=4)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", allocator.DEFAULTED_ENV: "1"}

    def banner(toml: dict, transformers: bool = False) -> str:
        cfg = parse_config({"context": {"schedule": [{"start_step": 1, "seq_len": 512},
                                                     {"start_step": 5, "seq_len": 4096}]}, **toml})
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            return memory_banner(cfg, shape, cfg.context_schedule(), dims, "cuda", transformers=transformers)

    alloc = ("; allocator: expandable_segments:True (this package's default; set PYTORCH_CUDA_ALLOC_CONF to "
             "choose another)")
    assert banner({}) == ("memory: tiled_mlp off, tiled_loss off, offload_activations off, offload_params off, "
                          "save_attention off" + alloc)
    on = banner({"memory": {"tiled_mlp": True, "mlp_tiles": 4, "tiled_loss": True, "loss_chunks": 3,
                            "offload_activations": True, "offload_params": True},
                 "activation_checkpoint": {"mode": "full", "save_attention": True}})
    assert on == ("memory: tiled_mlp on (4 tiles), tiled_loss on (3 chunks), offload_activations on (layer inputs in "
                  "pinned host memory), offload_params on (parameters, gradients and AdamW state in host memory), "
                  "save_attention on" + alloc)
    # Counts from the shapes, per stage: the debug Llama (dim 64, ffn 192), 256 and 2048 tokens a rank (sp 2),
    # 4 rows a rank (batch 8 over dp 2): MLP tiles ceil(tokens * 192 / 64^2), this Llama's per row (12, 96),
    # transformers' over the 4 rows' tokens together (48, 384); the loss's float32 logits (4 x 2048 x 320) fit
    # one 1 GiB chunk.
    auto = banner({"memory": {"tiled_mlp": True, "tiled_loss": True}})
    assert auto.startswith("memory: tiled_mlp on (tiles from the shapes: 12 at seq_len 512, 96 at seq_len 4096), "
                           "tiled_loss on (chunks from the shapes: 1), "), auto
    assert banner({"memory": {"tiled_mlp": True}}, transformers=True).startswith(
        "memory: tiled_mlp on (tiles from the shapes: 48 at seq_len 512, 384 at seq_len 4096)")
