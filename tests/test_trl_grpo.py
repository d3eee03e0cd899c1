"""UlyssesGRPOTrainer: TRL's GRPO script, changed in one place, trains on every mesh what
TRL's own GRPOTrainer trains in one process.

The script is the shipped example (``scripts/example_trl_grpo.py``), run unchanged in
pooled gloo ranks: TRL's ``GRPOTrainer`` in a world of 1 (the reference, computed once
per case), ``UlyssesGRPOTrainer`` in a world of 4. Rollouts come from the script's
deterministic ``rollout_func`` (completions of 3-12 tokens, some ended by EOS, some
truncated), so every mesh trains on the same completions; 8 completions a step (4
prompts x 2), fp32, 3 steps. Every step's loss, KL, reward, grad norm, entropy, clip
ratio, completion lengths (and MoE router loss) agree to relative 1e-5, and every rank
logs the same. The cases (:data:`CASES`) cover each mesh, each family and each case of
the issue once:

====================================  ===========  =====================  ==========================================
case                                  family       mesh                   what it exercises
====================================  ===========  =====================  ==========================================
dapo, entropy mask, memory switches   llama        dp_shard 2 x sp 2      TRL's default loss over the global batch,
                                                                          top-entropy masking, activation
                                                                          checkpointing, tiled MLP, head in chunks
grpo, beta 0.1, sequence-level IS     qwen3_moe    sp 4                   the reference sharded like the policy,
                                                                          KL, GSPO's per-sequence ratio, the router
                                                                          loss of the global batch
dr_grpo, 2 iterations, truncated     qwen3_next   dp_shard 2 x sp 2      old-policy log-probs, clipping, masked
masked                                                                    truncated completions, a hybrid family
bnpo, LoRA, beta 0.1                  llama        ring 2 x ulysses 2     the reference = the adapter off, ring
====================================  ===========  =====================  ==========================================

TRL's own generation (transformers ``generate`` on an unsharded copy of the policy) runs
on dp_shard 2 x sp 2 with LoRA: the completions every rank trains on are the same, and
the weights TRL's vLLM sync sends (colocate mode, to a stand-in engine: vLLM does not
install here) are the full, LoRA-merged weights the saved adapter gives. Refusals: one
message naming the argument.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

if any(importlib.util.find_spec(m) is None for m in ("transformers", "trl", "peft", "datasets")):
    pytest.skip("needs the hf, lora and trl extras", allow_module_level=True)

import torch  # noqa: E402
from distributed import run_ranks  # noqa: E402
from script_module import load_script  # noqa: E402
from test_hf_trainer import _stock, script_run, write_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GRPO_SCRIPT = ROOT / "scripts" / "example_trl_grpo.py"
FAMILIES = ("llama", "qwen3_moe", "qwen3_next")
RTOL, ATOL = 1e-5, 1e-8  # ATOL: values that are exactly 0 in the reference (KL at step 1, clip ratios)
STEPS, GLOBAL_ROWS = 3, 8
# Meshes of the 4-rank world, as UlyssesArguments flags, and their data-parallel size.
MESHES = {
    "dp_shard 2 x sp 2": (["--sp_size", "2"], 2),
    "sp 4": (["--sp_size", "4"], 1),
    "ring 2 x ulysses 2": (["--sp_size", "4", "--ring_size", "2"], 1),
}
# case -> (family, mesh, the script's flags, flags for our run only)
CASES = {
    "dapo, entropy mask, memory switches": (
        "llama", "dp_shard 2 x sp 2", ["--top_entropy_quantile", "0.5", "--gradient_checkpointing", "true"],
        ["--tiled_mlp", "--mlp_tiles", "2", "--loss_chunks", "3"]),
    "grpo, beta 0.1, sequence-level IS": (
        "qwen3_moe", "sp 4", ["--loss_type", "grpo", "--beta", "0.1", "--importance_sampling_level", "sequence"], []),
    "dr_grpo, 2 iterations, truncated masked": (
        "qwen3_next", "dp_shard 2 x sp 2", ["--loss_type", "dr_grpo", "--num_iterations", "2",
                                            "--mask_truncated_completions", "true", "--epsilon_high", "0.28",
                                            # the hybrid's own kernels agree with transformers' to ~1e-6: a
                                            # gentler step keeps 3 steps of that within 1e-5
                                            "--learning_rate", "3e-3"], []),
    "bnpo, LoRA, beta 0.1": (
        "llama", "ring 2 x ulysses 2", ["--loss_type", "bnpo", "--beta", "0.1", "--lora_r", "4"], []),
}
KEYS = ("loss", "kl", "reward", "reward_std", "grad_norm", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
        "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio", "aux_loss")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    for family in FAMILIES:
        write_tiny_model(root / family, family)
    return {family: root / family for family in FAMILIES}


def run_script(rank: int, world: int, script: str, stock_name: str, runs: list) -> list[dict]:
    """Each (argv, stock) through the script's ``main`` (``stock``: TRL's own trainer instead of ours)."""
    results = []
    for argv, stock in runs:
        module = load_script(script)
        if stock:
            import trl

            setattr(module, f"Ulysses{stock_name}", _stock(getattr(trl, stock_name)))
        with script_run():
            results.append(module.main(argv))
    return results


def common(out: Path, model: Path, rows: int, lr: str, *extra: str) -> list[str]:
    return ["--model_dir", str(model), "--output_dir", str(out), "--use_cpu", "--bf16", "false",
            "--max_steps", str(STEPS), "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true",
            "--learning_rate", lr, "--per_device_train_batch_size", str(rows), "--save_strategy", "no",
            "--seed", "7", "--gradient_checkpointing", "false", *extra]


def grpo_argv(out: Path, model: Path, rows: int, *extra: str) -> list[str]:
    return common(out, model, rows, "1e-2", "--num_generations", "2", "--max_completion_length", "16",
                  "--rollout", "fixed", *extra)


def assert_close_logs(got: dict, want: dict, what: str, keys=KEYS, scaled=None) -> float:
    """Every step's ``keys`` within RTOL (``scaled``: key -> the magnitude its error is relative
    to, for values that are differences of larger ones); returns the worst relative error."""
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (what, sorted(got), sorted(want))
    worst = 0.0
    for step in want:
        for key in keys:
            if key not in want[step]:
                continue
            a, b = want[step][key], got[step].get(key)
            assert b is not None, f"{what}: step {step} logged no {key}"
            scale = scaled(want[step], key) if scaled else abs(a)
            err = abs(a - b) / max(scale, 1e-30)
            assert abs(a - b) <= RTOL * scale + ATOL, f"{what}: step {step} {key} {b} vs {a} (rel. err. {err:.1e})"
            if abs(a - b) > ATOL and err > worst:
                worst, worst_at = err, (step, key)
    if worst:
        print(f"{what}: worst at step {worst_at[0]} {worst_at[1]}")
    return worst


def same_on_every_rank(results: list[list[dict]], keys=KEYS) -> list[dict]:
    """The logged metrics are the same on every rank: rank 0's, checked."""
    for r, mine in enumerate(results[1:], 1):
        for a, b in zip(results[0], mine):
            for step in a["logs"]:
                for key in keys:
                    assert a["logs"][step].get(key) == b["logs"][step].get(key), (r, step, key)
    return results[0]


def run_cases(tmp: Path, dirs: dict, script: Path, stock_name: str, cases: dict, argv) -> dict:
    """case -> (ours, stock) results: the stock references in one process, ours on 4 ranks."""
    refs, ours = [], []
    for case, (family, mesh, flags, only_ours) in cases.items():
        name = "".join(c for c in case if c.isalnum())
        refs.append((argv(tmp / f"{name}-stock", dirs[family], GLOBAL_ROWS, *flags), True))
        mesh_flags, dp = MESHES[mesh]
        ours.append((argv(tmp / f"{name}-sp", dirs[family], GLOBAL_ROWS // dp, *flags, *mesh_flags, *only_ours),
                     False))
    want = run_ranks(1, run_script, str(script), stock_name, refs)[0]
    got = same_on_every_rank(run_ranks(4, run_script, str(script), stock_name, ours))
    return {case: (g, w) for case, g, w in zip(cases, got, want)}


def test_grpo_script_equals_trl_in_one_process_on_every_mesh(model_dirs, tmp_path):
    results = run_cases(tmp_path, model_dirs, GRPO_SCRIPT, "GRPOTrainer", CASES, grpo_argv)
    lines = []
    for case, (got, want) in results.items():
        family, mesh = CASES[case][:2]
        worst = assert_close_logs(got["logs"], want["logs"], case)
        lines.append(f"GRPO {case} | {family} | {mesh}: worst rel. err. {worst:.1e}")
        if CASES[case][2].count("--beta"):  # the reference ran: KL moved off 0
            assert any(e["kl"] > 0 for e in want["logs"].values()), case
    # The cases exercise what they name: clipping (2 iterations), the router loss, uneven completions.
    clipped = results["dr_grpo, 2 iterations, truncated masked"][1]["logs"]
    assert any(e["clip_ratio/region_mean"] > 0 for e in clipped.values())
    assert "aux_loss" in results["grpo, beta 0.1, sequence-level IS"][1]["logs"][1]
    assert all(0 < e["completions/clipped_ratio"] < 1 for e in clipped.values() if "completions/clipped_ratio" in e)
    print("\n" + "\n".join(lines))


# -- TRL's own generation, and what vLLM is sent -------------------------------------------------


def _generation_run(rank: int, world: int, argv: list[str]) -> dict:
    """The script with TRL's generation (LoRA, dp_shard 2 x sp 2); then TRL's vLLM weight sync
    (colocate mode) into a stand-in engine that records what it is sent."""
    from trl.generation.vllm_generation import VLLMGeneration

    module = load_script(GRPO_SCRIPT)
    made = []

    class Recording(module.UlyssesGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    module.UlyssesGRPOTrainer = Recording
    with script_run():
        result = module.main(argv)
        trainer, sent = made[0], {}
        engine = SimpleNamespace(load_weights=lambda pairs: sent.update((n, p.detach().cpu().clone())
                                                                         for n, p in pairs))
        vllm = object.__new__(VLLMGeneration)  # TRL's class, its own sync_weights; no engine to start
        vllm.mode, vllm.enable_sleep_mode, vllm.model, vllm.accelerator = "colocate", False, trainer.model, None
        vllm.llm = SimpleNamespace(reset_prefix_cache=lambda: None, llm_engine=SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=engine)))))
        trainer.send_full_weights(vllm)
        vllm.sync_weights()
    result["sent"] = sent if rank == 0 else {}
    return result


def test_grpo_trl_generation_runs_and_vllm_is_sent_the_full_weights(model_dirs, tmp_path):
    out = tmp_path / "generate"
    argv = common(out, model_dirs["llama"], GLOBAL_ROWS // 2, "1e-2", "--num_generations", "2",
                  "--max_completion_length", "8", "--rollout", "generate", "--lora_r", "4", "--sp_size", "2",
                  "--reward_letters", "abcdefghijklmnopqrstuvwxyz ")
    results = run_ranks(4, _generation_run, argv)
    # Every rank trained on the same completions (the trainer also checks it at every step: check_batches).
    completions = [r["completions"] for r in results]
    assert all(c == completions[0] for c in completions) and len(completions[0]) == GLOBAL_ROWS
    assert all(math.isfinite(e["loss"]) for e in results[0]["logs"].values())
    # What vLLM is sent: the policy's full weights, the adapter merged, under the checkpoint's names.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, out).merge_and_unload()
    want = dict(merged.named_parameters())
    sent = results[0]["sent"]
    assert sorted(sent) == sorted(want), (sorted(sent)[:4], sorted(want)[:4])
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, want[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


# -- what cannot run is refused, by name ------------------------------------------------------------


def test_generation_batch_counts_data_parallel_ranks_and_refuses_uneven_shares():
    from ulysses_dtensor.integrations.hf.ulysses_trainer.arguments import UlyssesArguments
    from ulysses_dtensor.integrations.trl.rollouts import fit_generation_batch as fit

    def args(**kw):
        base = dict(world_size=8, per_device_train_batch_size=4, steps_per_generation=1, num_generations=4,
                    generation_batch_size=32, do_eval=False, eval_strategy="no", per_device_eval_batch_size=4,
                    num_generations_eval=None)
        return SimpleNamespace(**{**base, **kw})

    a = args()
    fit(a, UlyssesArguments(sp_size=4))  # 2 data-parallel ranks of 4 rows
    assert a.generation_batch_size == 8
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=2 x steps_per_generation=1 = 2 rows .*"
                                         r"sp_size=4"):
        fit(args(per_device_train_batch_size=2, num_generations=2), UlyssesArguments(sp_size=4))
    with pytest.raises(ValueError, match=r"num_generations=3 must divide the generation batch"):
        fit(args(num_generations=3), UlyssesArguments(sp_size=4))


def _construct(rank: int, world: int, model_dir: str, out: str) -> dict:
    """In one process: the refusals (each message), and a trainer whose unsharded policy
    copy and vLLM weights are the model's own."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, GRPOConfig

    from ulysses_dtensor.integrations.hf.ulysses_trainer.arguments import UlyssesArguments
    from ulysses_dtensor.integrations.trl import UlyssesDPOTrainer, UlyssesGRPOTrainer
    from ulysses_dtensor.integrations.trl.policy_copy import named_full_weights, unsharded_policy
    from ulysses_dtensor.integrations.trl.rl_mixin import UlyssesRLMixin

    module = load_script(GRPO_SCRIPT)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    prompts = Dataset.from_list(module.prompts(4))
    messages = {}

    def config(**kw):
        return GRPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to=[], max_steps=1, num_generations=2,
                          per_device_train_batch_size=2, gradient_checkpointing=False, **kw)

    def grpo(args, **kw):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return UlyssesGRPOTrainer(model=model, reward_funcs=module.letter_reward("ab"), args=args,
                                  train_dataset=prompts, processing_class=tokenizer, **kw)

    with script_run():
        attempts = {
            "cast_lm_head_to_fp32": lambda: grpo(config(cast_lm_head_to_fp32=True)),
            "tools": lambda: grpo(config(), tools=[len], ulysses_args=UlyssesArguments(sp_size=2)),
            "ulysses_args": lambda: UlyssesDPOTrainer(
                model=AutoModelForCausalLM.from_pretrained(model_dir), ulysses_args={"sp_size": 2},
                args=DPOConfig(output_dir=out, use_cpu=True, report_to=[]), processing_class=tokenizer,
                train_dataset=Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])),
        }
        for name, attempt in attempts.items():
            try:
                attempt()
                messages[name] = "not refused"
            except (ValueError, TypeError) as e:
                messages[name] = str(e)
        trainer = grpo(config())
        assert isinstance(trainer, UlyssesRLMixin)
        ids = torch.tensor([[5, 9, 33, 2, 71, 8]])
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        copy = unsharded_policy(trainer.model, trainer._sp_model, attn_implementation="sdpa", dtype=torch.float32,
                                device=torch.device("cpu"))
        with torch.no_grad():
            same_logits = torch.allclose(copy(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-6)
        weights = dict(named_full_weights(trainer.model, trainer._sp_model, dtype=torch.float32,
                                          device=torch.device("cpu")))
        want = dict(plain.named_parameters())
        same_weights = sorted(weights) == sorted(want) and all(torch.equal(weights[n], want[n]) for n in want)
    return {"messages": messages, "same_logits": same_logits, "same_weights": same_weights}


def test_refusals_name_the_argument_and_the_policy_copy_is_the_model(model_dirs, tmp_path):
    got = run_ranks(1, _construct, str(model_dirs["llama"]), str(tmp_path / "out"))[0]
    expected = {
        "cast_lm_head_to_fp32": "GRPOConfig.cast_lm_head_to_fp32=True is not supported by UlyssesGRPOTrainer",
        "tools": "tools= is not supported by UlyssesGRPOTrainer with sp_size > 1",
        "ulysses_args": "ulysses_args must be a UlyssesArguments, got dict",
    }
    for name, want in expected.items():
        assert want in got["messages"][name], (name, got["messages"][name])
    # The copy transformers generates with, and what vLLM is sent: the model's own logits and weights.
    assert got["same_logits"] and got["same_weights"]


# -- the library's GRPO loss is TRL's ------------------------------------------------------------

LIBRARY_CASES = [(t, "token", None) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")]
LIBRARY_CASES += [("grpo", "sequence", None), ("dapo", "token", 1.5)]


def _trl_losses(rank: int, world: int) -> list[dict]:
    """TRL's own ``GRPOTrainer._compute_loss`` (on a stand-in trainer whose log-probability call
    returns fixed tensors) and the library's ``grpo_loss`` on the same rollouts, for each case:
    the losses, their gradients and the logged KL and clip ratios."""
    from collections import defaultdict

    from trl import GRPOTrainer

    from ulysses_dtensor.parallel.policy_loss import grpo_loss

    g = torch.Generator().manual_seed(5)
    b, t = 4, 7
    mask = torch.ones(b, t)
    mask[0, 5:], mask[2, 3:] = 0, 0
    old = -torch.rand(b, t, generator=g) * 3
    ref = old + 0.3 * torch.randn(b, t, generator=g)
    logps0 = old + 0.4 * torch.randn(b, t, generator=g)  # far enough from old for clipping to bite
    advantages = torch.randn(b, generator=g)
    out = []
    for loss_type, level, delta in LIBRARY_CASES:
        accel = SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x)
        args = SimpleNamespace(use_bias_correction_kl=True, delta=delta, steps_per_generation=1,
                               sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
        logps = logps0.clone().requires_grad_(True)
        fake = SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.ones_like(logps), None),
            top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.1,
            loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=False, args=args,
            model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=9,
            accelerator=accel, _entropy_bonus_enabled=False, aux_loss_enabled=False,
            _metrics={"train": defaultdict(list)})
        inputs = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2),
                  "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
                  "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
                  "num_items_in_batch": mask.sum()}
        trl_loss = GRPOTrainer._compute_loss(fake, None, inputs)
        trl_loss.backward()
        trl_grad, logps.grad = logps.grad.clone(), None
        ours = grpo_loss(logps, advantages, mask, loss_type=loss_type, old_logps=old, ref_logps=ref, beta=0.1,
                         epsilon_low=0.2, epsilon_high=0.28, delta=delta, importance_sampling_level=level,
                         normalizer=mask.sum(), max_completion_length=9)
        ours.loss.backward()
        metrics = fake._metrics["train"]
        clip = (metrics.get("clip_ratio/region_mean") or metrics.get("cispo_clip_ratio") or [None])[0]
        ours_clip = None if clip is None else float(ours.clip_low + ours.clip_high)
        out.append({"trl": (float(trl_loss), trl_grad, metrics["kl"][0], clip),
                    "ours": (float(ours.loss), logps.grad.clone(), float(ours.kl), ours_clip)})
    return out


def test_library_grpo_loss_is_trls_for_every_loss_type():
    results = run_ranks(1, _trl_losses)[0]
    for (loss_type, level, delta), r in zip(LIBRARY_CASES, results):
        (tl, tg, tkl, tclip), (ol, og, okl, oclip) = r["trl"], r["ours"]
        what = f"{loss_type} ({level}, delta={delta})"
        assert ol == pytest.approx(tl, rel=1e-6), what
        torch.testing.assert_close(og, tg, rtol=1e-6, atol=1e-7, msg=what)
        assert okl == pytest.approx(tkl, rel=1e-6), what
        if tclip is not None:  # the clip ratio TRL logs (sapo logs none)
            assert oclip == pytest.approx(tclip, rel=1e-6, abs=1e-9), what
    assert any(r["trl"][3] for r in results), "no case clipped"
