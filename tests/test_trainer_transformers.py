"""The trainer trains transformers models (``model.implementation``), against transformers itself.

A tiny random Qwen3-MoE (4 experts, 2 per token; per-expert tensors on disk, fused
in memory: the loader converts) is made with ``scripts/make_tiny_hf_model.py`` and
trained with ``train_configs/debug_hf_moe.toml`` (progressive 32 -> 64 tokens):

* in one process, on dp_shard 2 x sp 2 (full activation checkpointing, tiled
  loss, one all-to-all for q/k/v, checkpoints) and, resumed from its step-2
  checkpoint, on HSDP 2 x (1 x sp 2) with selective activation checkpointing
  and compiled layers: every step's loss and gradient norm equal a hand-written
  single-process loop over transformers' own model (``from_pretrained``, each
  packed document run alone, AdamW, clipping);
* the trainer's evaluation (dp 2 x sp 2) and ``-m ulysses_dtensor.eval`` on its
  checkpoint (one process) give the same numbers;
* ``-m ulysses_dtensor.export`` writes the source layout (per-expert tensors),
  config.json and tokenizer files; ``from_pretrained`` on it gives the logits of
  the trainer's model;
* the memory planner traces the same model (bf16; fp32 MoE is refused with the reason);
* config mistakes and models the integration refuses stop before anything starts.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from packed_reference import builtin_corpus_loader, reference_step, trainer_adamw, trainer_jobs

from ulysses_dtensor.trainer.config import ConfigError, load_config, model_args, validate_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_hf_model import make_tiny_hf_model  # noqa: E402

VOCAB = 320
SHAPE = dict(vocab_size=VOCAB, dim=64, layers=2, heads=8, kv_heads=4, ffn_dim=96, init_std=0.08)
STEPS, BATCH, SCHEDULE, LR = 4, 4, "1:32,3:64", 3e-3
EVAL_LENGTH = 301  # not a multiple of sp: evaluation pads


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_moe")
    make_tiny_hf_model(d, "qwen3_moe", tokenizer=False, seed=3, perturb=0.1, **SHAPE)
    # Tokenizer-side files travel to the export; without a tokenizer.json the run uses bytes.
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return d


def _args(hf_dir, dump, *extra) -> list[str]:
    return [
        "--config", str(REPO / "train_configs" / "debug_hf_moe.toml"),
        "--model.hf_path", str(hf_dir), "--job.dump_folder", str(dump),
        "--training.steps", str(STEPS), "--training.global_batch_size", str(BATCH),
        "--context.schedule", SCHEDULE, "--optimizer.lr", str(LR),
        "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay", "none",
        "--data.max_corpus_mb", "0.25", "--metrics.log_freq", "1", "--metrics.progress_bar", "false",
        *extra,
    ]


def _mesh(rep, shard, sp) -> list[str]:
    return ["--parallelism.dp_replicate", str(rep), "--parallelism.dp_shard", str(shard),
            "--parallelism.sp", str(sp)]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reference(hf_dir) -> list[dict]:
    """The same steps by hand on transformers' own model: the trainer's data
    (its loader over the built-in corpus), each packed document run alone, the
    token-mean loss of next-token targets inside documents, AdamW, clipping."""
    from transformers import AutoModelForCausalLM


    cfg = load_config(_args(hf_dir, "unused"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    adamw = trainer_adamw(model, cfg, LR)
    loader, schedule = builtin_corpus_loader(cfg)
    rows = []
    for step in range(1, STEPS + 1):
        batch = loader.next_batch(schedule.batch_size(step), schedule.seq_len(step))
        rows.append({"step": step, **reference_step(model, adamw, batch, cfg.training.max_norm)})
    return rows


def _eval_args(held_out) -> list[str]:
    return ["--eval.tasks", "loss,passkey", "--eval.lengths", str(EVAL_LENGTH), "--eval.depths", "2",
            "--eval.loss_rows", "2", "--eval.data_path", str(held_out)]


@pytest.fixture(scope="module")
def runs(moe_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_moe_runs")
    held_out = d / "held_out.txt"
    held_out.write_text(Path(json.__file__).read_text())  # documents training never reads
    sharded = _args(moe_dir, d / "sharded", *_mesh(1, 2, 2), "--checkpoint.interval", "2", "--training.pack_qkv",
                    "true", "--eval.interval", str(STEPS), *_eval_args(held_out))
    resumed = _args(moe_dir, d / "resumed", *_mesh(2, 1, 2), "--activation_checkpoint.mode", "selective",
                    "--memory.tiled_loss", "false", "--training.compile", "true", "--training.compile_backend",
                    "aot_eager")
    # ALST's memory switches and USP on the transformers path: every switch at once, ring 2 x ulysses 2,
    # full AC keeping the ring's attention kernel outputs (offloaded with the layer inputs).
    memory = _args(moe_dir, d / "memory", *_mesh(1, 1, 4), "--parallelism.ring", "2", "--activation_checkpoint.mode",
                   "full", "--activation_checkpoint.save_attention", "true", "--memory.tiled_mlp", "true",
                   "--memory.mlp_tiles", "3", "--memory.offload_activations", "true", "--memory.offload_params", "true",
                   "--checkpoint.enable", "false")
    run_ranks(4, trainer_jobs, [(sharded, None),
                         (resumed, (d / "sharded" / "checkpoint" / "step-2", d / "resumed" / "checkpoint" / "step-2")),
                         (memory, None)])
    return d, held_out


def test_trajectories_equal_transformers_on_every_mesh_and_on_resume(moe_dir, runs, capsys):
    d, _ = runs
    # One process: no activation checkpointing, whole-sequence loss, no checkpoints.
    from ulysses_dtensor.trainer.loop import train

    train(load_config(_args(moe_dir, d / "single", *_mesh(1, 1, 1), "--activation_checkpoint.mode", "none",
                            "--memory.tiled_loss", "false", "--checkpoint.enable", "false")))
    banner = capsys.readouterr().out
    assert "implementation transformers (model.implementation='transformers')" in banner
    ref = _reference(moe_dir)
    runs_ = {"1 process": _rows(d / "single" / "metrics.jsonl"),
             "dp_shard 2 x sp 2, full AC, tiled loss, packed q/k/v": _rows(d / "sharded" / "metrics.jsonl"),
             "resumed at step 2 on HSDP 2 x sp 2, selective AC, compiled": _rows(d / "resumed" / "metrics.jsonl"),
             "ring 2 x ulysses 2, tiled MLP, attention kept, offloaded activations and parameters":
                 _rows(d / "memory" / "metrics.jsonl")}
    worst = worst_norm = 0.0
    for name, rows in runs_.items():
        first = 3 if name.startswith("resumed") else 1
        assert [r["step"] for r in rows] == list(range(first, STEPS + 1)), name
        for r in rows:
            want = ref[r["step"] - 1]
            worst = max(worst, abs(r["loss"] - want["loss"]) / want["loss"])
            worst_norm = max(worst_norm, abs(r["grad_norm"] - want["grad_norm"]) / want["grad_norm"])
            assert r["loss"] == pytest.approx(want["loss"], rel=2e-6), (name, r["step"], r["loss"], want["loss"])
            assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-5), (name, r["step"])
            assert r["lr"] == pytest.approx(LR)
    print(f"worst relative difference to the transformers loop over 4 runs x {STEPS} steps: loss {worst:.2e}, "
          f"gradient norm {worst_norm:.2e}")
    assert [r["seq_len"] for r in runs_["1 process"]] == [32, 32, 64, 64]
    assert ref[-1]["loss"] < ref[0]["loss"]  # it trains
    # MFU needs FLOPs per token: counted (MoE: 2 of 4 experts) and logged.
    assert all(r["mfu"] is None for r in runs_["1 process"])  # CPU without metrics.peak_flops
    # The memory switches change what is kept, not what is logged: the same fields, the same
    # FLOPs per token, and the all-to-all share of the eager exchanges (ulysses 2) measured.
    plain, switched = runs_["dp_shard 2 x sp 2, full AC, tiled loss, packed q/k/v"], runs_[
        "ring 2 x ulysses 2, tiled MLP, attention kept, offloaded activations and parameters"]
    assert [set(r) for r in switched] == [set(r) for r in plain]
    assert all(r["exchange_ms"] > 0 and 0 < r["exchange_share"] < 1 for r in switched), switched


def test_eval_in_the_trainer_equals_eval_of_its_checkpoint(moe_dir, runs):
    from ulysses_dtensor.eval import evaluate

    d, held_out = runs
    trainer = [r for r in _rows(d / "sharded" / "eval" / "eval.jsonl") if r["step"] == STEPS]
    cli = evaluate(_args(moe_dir, d / "sharded", *_mesh(1, 1, 1), *_eval_args(held_out),
                         "--checkpoint", str(d / "sharded" / "checkpoint"), "--output", str(d / "cli")))
    assert [r["kind"] for r in cli] == [r["kind"] for r in trainer]
    assert {r["kind"] for r in cli} >= {"position_loss", "loss", "retrieval"}
    worst = 0.0
    for a, b in zip(cli, trainer):
        if a["kind"] == "eval":
            assert (a["mesh"]["sp"], b["mesh"]["sp"], b["mesh"]["dp_shard"]) == (1, 2, 2)
            continue
        for key in ("tokens", "correct", "accuracy"):
            assert a.get(key) == b.get(key), (a, b)
        for key in ("loss", "mean_logprob"):
            if b.get(key) is not None:
                worst = max(worst, abs(a[key] - b[key]))
    print(f"eval: max abs diff trainer (dp2 x sp2) vs checkpoint (1 process): {worst:.2e}")
    assert worst < 1e-5


def _trained_model(hf_dir, ckpt):
    """The trainer's model of a checkpoint, in this process, called as the trainer calls it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ulysses_dtensor.integrations.hf.causal_lm import adapt_causal_lm
    from ulysses_dtensor.integrations.hf.weights import init_non_persistent_buffers
    from ulysses_dtensor.trainer.checkpoint import load_model_weights

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    model.to_empty(device="cpu")
    init_non_persistent_buffers(model)
    load_model_weights(ckpt, model)
    return adapt_causal_lm(model.eval())


def test_export_is_the_source_layout_and_gives_the_trainers_logits(moe_dir, runs, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.export import main as export_main

    d, _ = runs
    ckpt, out = d / "sharded" / "checkpoint" / f"step-{STEPS}", tmp_path / "hf"
    assert export_main(["--checkpoint", str(ckpt), "--out", str(out), "--max-shard-size", "60KB"]) == 0
    keys = lambda p: {k for f in p.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}  # noqa: E731
    assert keys(out) == keys(moe_dir)  # experts one by one again, as save_pretrained writes them
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    config, source = (json.loads((p / "config.json").read_text()) for p in (out, moe_dir))
    assert config["max_position_embeddings"] == source["max_position_embeddings"]  # 4096 > 64 trained
    assert {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")}
    assert (out / "tokenizer_config.json").read_text() == (moe_dir / "tokenizer_config.json").read_text()

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    trained = _trained_model(moe_dir, ckpt)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    before = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want, got, start = trained(ids), exported(ids).logits, before(ids).logits
    diff = (got - want).abs().max().item()
    print(f"export -> from_pretrained logits vs the trainer's model: max |diff| {diff:.2e}; "
          f"training moved them by {(want - start).abs().max().item():.2e}")
    assert diff < 1e-5
    assert (want - start).abs().max() > 1e-2


# ---------------------------------------------------------------------------
# The key, and what stops a run before it starts (one process, no ranks)
# ---------------------------------------------------------------------------


# Qwen/Qwen3-30B-A3B's published config.json (written by transformers 4.51).
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_implementation_key_choices_and_refusals(moe_dir, tmp_path):
    from ulysses_dtensor.trainer.hf_model import resolve_implementation

    llama = tmp_path / "llama"
    make_tiny_hf_model(llama, "llama", tokenizer=False, **SHAPE)
    base = ["--config", str(REPO / "train_configs" / "debug_hf.toml"), "--job.dump_folder", str(tmp_path / "x")]

    def cfg(*extra):
        return load_config(base + list(extra))

    # auto: our Llama where it can load the checkpoint, transformers otherwise, with the reason.
    native = resolve_implementation(cfg("--model.hf_path", str(llama)))
    assert (native.name, native.reason) == ("native", "auto: LlamaForCausalLM loads into this package's Llama")
    auto = resolve_implementation(cfg("--model.hf_path", str(moe_dir)))
    assert auto.name == "transformers" and "Qwen3MoeForCausalLM" in auto.reason and "not supported" in auto.reason
    forced = cfg("--model.hf_path", str(llama), "--model.implementation", "transformers")
    assert resolve_implementation(forced).name == "transformers"
    assert validate_config(forced, 4).sp == 2
    # native on a family our Llama lacks: the native loader's message, listing what it supports.
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM'\] is not supported; supported: LlamaForCausalLM"):
        validate_config(cfg("--model.hf_path", str(moe_dir), "--model.implementation", "native"), 4)

    def refused(extra, *words, world=4):
        with pytest.raises(ConfigError) as e:
            validate_config(cfg(*extra), world)
        for w in words:
            assert w in str(e.value), (w, str(e.value))

    moe = ["--model.hf_path", str(moe_dir)]
    # Every memory switch and USP take the transformers model too.
    switched = cfg(*moe, "--activation_checkpoint.mode", "full", "--memory.tiled_mlp", "true", "--memory.mlp_tiles", "4",
                   "--memory.offload_activations", "true", "--memory.offload_params", "true", "--parallelism.sp", "4",
                   "--parallelism.ring", "2")
    assert validate_config(switched, 4).ring == 2
    with pytest.raises(ConfigError, match=r"model\.implementation='transformers' .*has no effect.*model\.hf_path=''"):
        load_config(["--model.implementation", "transformers"])
    # meshes and models the integration cannot run, named with the class and the value
    windowed = tmp_path / "mistral"
    make_tiny_hf_model(windowed, "mistral", tokenizer=False, **SHAPE)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    refused(["--model.hf_path", str(windowed), "--parallelism.sp", "4", "--parallelism.ring", "2"],
            "parallelism.ring=2", "MistralForCausalLM", "sliding window (window=16)", "ring=1")
    refused([*moe, "--memory.offload_activations", "true"], "memory.offload_activations=true",
            "activation_checkpoint.mode='full'")
    refused([*moe, "--parallelism.sp", "3", "--parallelism.dp_shard", "1", "--context.schedule", "1:96"],
            "Qwen3MoeForCausalLM", "sp=3",
            world=3)
    routed = tmp_path / "routed"
    shutil.copytree(moe_dir, routed)
    config = json.loads((routed / "config.json").read_text())
    (routed / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    assert validate_config(cfg("--model.hf_path", str(routed)), 4).sp == 2  # the router loss trains (test_hf_trainer_moe)
    # The shipped GPU config validates with Qwen3-30B-A3B's published config.json in place (8 GPUs).
    big = tmp_path / "Qwen3-30B-A3B"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    shutil.copy(next(moe_dir.glob("*.safetensors")), big / "model-00001-of-00016.safetensors")
    gpu = load_config(["--config", str(REPO / "train_configs" / "qwen3_30b_a3b_128k.toml"), "--model.hf_path", str(big),
                       "--data.path", "", "--job.dump_folder", str(tmp_path / "y")])
    assert validate_config(gpu, 8).sp == 8 and [s.seq_len for s in gpu.stages()] == [32768, 65536, 131072]
    shape = model_args(gpu, 0)
    assert (shape.architecture, shape.num_experts, shape.experts_per_token, shape.n_kv_heads) == (
        "Qwen3MoeForCausalLM", 128, 8, 4)
    not_lm = tmp_path / "t5"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}))
    shutil.copy(next(moe_dir.glob("*.safetensors")), not_lm)
    refused(["--model.hf_path", str(not_lm)], "not a causal LM transformers can build")


def test_memory_planner_traces_the_transformers_model(moe_dir):
    from ulysses_dtensor.estimate import plan_memory

    argv = _args(moe_dir, "unused", *_mesh(1, 2, 2), "--training.mixed_precision_param", "bfloat16")
    plan = plan_memory(load_config(argv), 4, 64, rows=1, device="cpu")
    assert sum(plan.breakdown.values()) == plan.peak_bytes and plan.n_layers == SHAPE["layers"]
    # fp32 masters sharded over dp_shard 2 x sp 2: a quarter of the parameters (FSDP pads dim 0 per rank)
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(moe_dir).parameters())
    assert plan.phase_peaks["setup"] > 0
    sharded = plan.breakdown.get("Sharded Param") or plan.end_of_forward.get("Sharded Param")
    assert sharded == pytest.approx(4 * n_params / 4, rel=0.05)
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM .*needs training.mixed_precision_param='bfloat16'"):
        plan_memory(load_config(_args(moe_dir, "unused", *_mesh(1, 2, 2))), 4, 64, rows=1, device="cpu")


def test_planner_sizes_a_transformers_model_from_its_config_alone(moe_dir, tmp_path):
    """No weights needed to size a run: config.json alone, every memory switch, USP, and a search."""
    from ulysses_dtensor.estimate import find_max_seq_len, plan_memory

    bare = tmp_path / "config_only"
    bare.mkdir()
    shutil.copy(moe_dir / "config.json", bare / "config.json")
    base = _args(bare, "unused", *_mesh(1, 1, 4), "--parallelism.ring", "2", "--training.mixed_precision_param",
                 "bfloat16", "--activation_checkpoint.mode", "full")
    with pytest.raises(ConfigError, match="safetensors"):  # training does need the weights
        validate_config(load_config(base), 4)
    switches = ["--memory.tiled_mlp", "true", "--memory.mlp_tiles", "2", "--memory.offload_activations", "true",
                "--memory.offload_params", "true"]
    plain = plan_memory(load_config(base), 4, 128, rows=1, device="cuda", layers="full")
    switched = plan_memory(load_config(base + switches), 4, 128, rows=1, device="cuda", layers="full")
    assert switched.features["tiled_mlp"] and switched.features["offload"] and switched.features["offload_params"]
    # Parameter state and layer inputs moved to the host: less on the device, some on the host.
    assert switched.peak_bytes < plain.peak_bytes and switched.host_bytes > plain.host_bytes == 0
    # The shipped 5M-token Qwen3-8B config validates against Qwen3-8B's published config.json alone.
    shipped = load_config(["--config", str(REPO / "train_configs" / "qwen3_8b_hf_5m.toml"), "--model.hf_path",
                           str(REPO / "benchmarks" / "model_configs" / "qwen3_8b"), "--data.path", ""])
    assert validate_config(shipped, 8, weights=False).sp == 8 and shipped.memory.offload_params
    found = find_max_seq_len(load_config(base + switches), 4, budget_gib=switched.peak_gib * 1.5, headroom_gib=0,
                             granularity=32, rows=1, device="cuda", layers="full", confirm=False)
    assert found.max_seq_len >= 128 and found.best.peak_bytes <= 1.5 * switched.peak_bytes < found.next_up.peak_bytes
