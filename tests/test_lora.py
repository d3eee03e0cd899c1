"""LoRA (``[lora]``): peft's adapters under SP, against peft's own unsharded model.

A tiny random HF Llama (``scripts/make_tiny_hf_model.py``) is trained on the built-in
corpus (packed rows) with rank-4 adapters on every projection:

* parity: the trainer's model (``build_model``, ``train_step``) on dp_shard 2 x sp 2 and
  sp 4 (USP for transformers' class), with the memory switches, for transformers' class
  and for this package's Llama: every step's loss and EVERY adapter gradient equal a hand-written loop
  over ``get_peft_model`` on transformers' ``from_pretrained`` model, each packed document
  run alone (3 steps, AdamW between them);
* recomputation (activation checkpointing, offload, tiled MLPs; compiled blocks too)
  replays LoRA dropout's masks;
* the trainer's checkpoints hold the adapters only and resume exactly on another mesh;
  the export gives a peft adapter directory (``PeftModel.from_pretrained``) and merged
  weights (``from_pretrained``), both with the trainer's logits;
* what is refused, before anything starts.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from packed_reference import builtin_corpus_loader, packed_documents_loss, trainer_jobs

pytest.importorskip("peft")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_hf_model import make_tiny_hf_model  # noqa: E402

VOCAB, STEPS, BATCH, SEQ, LR, RANK = 320, 3, 4, 64, 3e-3, 4
SHAPE = dict(vocab_size=VOCAB, dim=64, layers=2, heads=8, kv_heads=4, ffn_dim=96, init_std=0.08)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_lora")
    make_tiny_hf_model(d, "llama", tokenizer=False, seed=3, perturb=0.1, **SHAPE)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return d


def _argv(hf_dir, dump, impl, mesh, *extra) -> list[str]:
    rep, shard, sp = mesh
    return ["--config", str(REPO / "train_configs" / "debug_lora.toml"), "--model.hf_path", str(hf_dir),
            "--model.implementation", impl, "--job.dump_folder", str(dump), "--training.steps", str(STEPS),
            "--training.global_batch_size", str(BATCH), "--context.schedule", f"1:{SEQ}", "--optimizer.lr", str(LR),
            "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay", "none", "--data.max_corpus_mb", "0.25",
            "--lora.rank", str(RANK), "--metrics.log_freq", "1", "--metrics.progress_bar", "false",
            "--parallelism.dp_replicate", str(rep), "--parallelism.dp_shard", str(shard), "--parallelism.sp", str(sp),
            *extra]


# ---------------------------------------------------------------------------
# Parity with peft's unsharded model
# ---------------------------------------------------------------------------

RUNS = {  # name: (implementation, mesh, switches)
    "transformers, dp_shard 2 x sp 2, full AC, tiled MLP, tiled loss, norms saved whole": (
        "transformers", (1, 2, 2), ["--activation_checkpoint.mode", "full", "--memory.tiled_mlp", "true",
                                    "--memory.mlp_tiles", "3", "--memory.tiled_loss", "true",
                                    "--lora.modules_to_save", "norm"]),
    "transformers, sp 4 = ring 2 x ulysses 2, offloaded layer inputs and parameters": (
        "transformers", (1, 1, 4), ["--parallelism.ring", "2", "--activation_checkpoint.mode", "full",
                                    "--memory.offload_activations", "true", "--memory.offload_params", "true"]),
    "native Llama, sp 4, selective AC, tiled loss": (
        "native", (1, 1, 4), ["--activation_checkpoint.mode", "selective", "--memory.tiled_loss", "true"]),
}


def _trainer_steps(rank, world, runs):
    """Each run's per-step loss and full adapter gradients (rank 0), and its initial trained tensors."""
    from ulysses_dtensor.integrations.lora import base_name
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import count_valid_tokens, global_loss
    from ulysses_dtensor.trainer.build import build_model
    from ulysses_dtensor.trainer.config import load_config, validate_config
    from ulysses_dtensor.trainer.step import build_optimizer, train_step

    out = {}
    for name, argv in runs:
        cfg = load_config(argv)
        dims = validate_config(cfg, world)
        pmesh = dims.build_mesh("cpu")
        model = build_model(cfg, pmesh, VOCAB, torch.device("cpu"))
        trained = {base_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        first = {n: p.detach().full_tensor().clone() for n, p in trained.items()}
        optimizer = build_optimizer(cfg, model)
        loader, schedule = builtin_corpus_loader(cfg)
        steps = []
        for step in range(1, STEPS + 1):
            batch = loader.next_batch(schedule.batch_size(step), schedule.seq_len(step))
            local = BATCH // dims.dp
            mine = {k: v[pmesh.dp_rank * local:(pmesh.dp_rank + 1) * local] for k, v in batch.items()}
            shard = shard_batch(mine, pmesh.sp, pad=False)
            n_valid = count_valid_tokens(shard["labels"], pmesh.loss)
            grads = {}

            def at(phase):
                if phase == "clip":  # gradients complete, before clipping
                    grads.update({n: p.grad.full_tensor().clone() for n, p in trained.items()})

            loss_sum, norm = train_step(model, optimizer, shard, n_valid, max_norm=cfg.training.max_norm, lr=LR,
                                        on_phase=at)
            steps.append((global_loss(loss_sum, pmesh.loss).item(), float(norm), grads))
        out[name] = (first, steps)
    return out if rank == 0 else None


def _reference(hf_dir, names_of, first, saved: list[str]):
    """The same steps by hand: peft's ``get_peft_model`` on ``from_pretrained``, the trainer's
    initial adapters copied in, each packed document alone, clipping, AdamW."""
    from packed_reference import trainer_adamw
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.trainer.config import load_config

    cfg = load_config(_argv(hf_dir, "unused", "transformers", (1, 1, 1)))
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules,
                                            modules_to_save=saved or None)).train()
    params = {_plain(n): p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, t in first.items():
            params[names_of(n)].copy_(t)
    assert len(params) == len(first), (sorted(params), sorted(first))
    adamw = trainer_adamw(model, cfg, LR)
    loader, schedule = builtin_corpus_loader(cfg)
    steps = []
    for step in range(1, STEPS + 1):
        loss = packed_documents_loss(model, loader.next_batch(schedule.batch_size(step), schedule.seq_len(step)))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in params.items()}
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.training.max_norm)
        adamw.step()
        adamw.zero_grad()
        steps.append((loss.item(), norm.item(), grads))
    return steps


def _plain(name: str) -> str:
    return name.removeprefix("base_model.model.").replace("modules_to_save.default.", "")


def test_loss_and_every_adapter_gradient_equal_peft_unsharded(llama_dir, tmp_path):
    import dataclasses

    from ulysses_dtensor.export.adapters import hf_name_of
    from ulysses_dtensor.trainer.config import load_config, model_args

    runs = [(name, _argv(llama_dir, tmp_path / str(i), impl, mesh, *extra))
            for i, (name, (impl, mesh, extra)) in enumerate(RUNS.items())]
    got = run_ranks(4, _trainer_steps, runs)[0]
    native_args = dataclasses.asdict(model_args(load_config(runs[-1][1]), VOCAB))
    worst = {"loss": 0.0, "grad": 0.0}
    refs = {}
    for name, (impl, _, extra) in RUNS.items():
        first, steps = got[name]
        names_of = hf_name_of({"implementation": impl, "args": native_args})
        saved = extra[extra.index("--lora.modules_to_save") + 1:][:1] if "--lora.modules_to_save" in extra else []
        key = (impl, tuple(saved))
        if key not in refs:  # transformers runs share their initial adapters: the seed, not the mesh, sets them
            refs[key] = (first, _reference(llama_dir, names_of, first, saved))
        else:
            assert all(torch.equal(first[n], refs[key][0][n]) for n in first), name
        ref = refs[key][1]
        assert len(first) == 2 * 7 * 2 + (5 if saved else 0)  # A and B of 7 projections x 2 layers (+ 5 norms)
        for step, ((loss, norm, grads), (rloss, rnorm, rgrads)) in enumerate(zip(steps, ref), start=1):
            worst["loss"] = max(worst["loss"], abs(loss - rloss) / rloss)
            assert loss == pytest.approx(rloss, rel=2e-6), (name, step)
            assert norm == pytest.approx(rnorm, rel=2e-5), (name, step)
            for n, g in grads.items():
                r = rgrads[names_of(n)]
                err = ((g - r).norm() / r.norm().clamp(min=1e-12)).item() if r.norm() > 0 else g.norm().item()
                worst["grad"] = max(worst["grad"], err)
                assert err < 1e-4, (name, step, n, err)
    print(f"LoRA vs peft unsharded, {len(RUNS)} runs x {STEPS} steps: worst loss rel. err. {worst['loss']:.1e}, "
          f"worst adapter gradient rel. err. {worst['grad']:.1e}")


# ---------------------------------------------------------------------------
# Dropout under recomputation
# ---------------------------------------------------------------------------


def test_recomputation_replays_lora_dropout(monkeypatch):
    """Full / selective AC, host offload, tiled MLPs and compiled checkpointed blocks recompute
    with forward's dropout masks (the RNG state is replayed); without the replay the
    gradients would differ."""
    import torch.distributed as dist

    from ulysses_dtensor.integrations.lora import LoraSpec, add_lora
    from ulysses_dtensor.models import llama_parallelize as parallelize
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.parallel.mesh import ParallelDims

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pmesh = ParallelDims(1, 1, 1, world_size=1).build_mesh("cpu")

    def grads(**kw):
        with torch.device("meta"):
            model = Llama(llama_args("debug"))
        add_lora(model, LoraSpec(rank=4, alpha=8, target_modules=("wq", "wv", "w1", "w2"), dropout=0.3))
        parallelize.parallelize_llama(model, pmesh, **kw)
        model.to_empty(device="cpu")
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().copy_(torch.randn(p.shape, generator=g) * 0.05)
        ids = torch.randint(0, 512, (2, 32), generator=g)
        torch.manual_seed(5)
        model(ids, labels=ids, num_valid_tokens=64).backward()
        return [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]

    try:
        plain = grads()
        for recomputed in (dict(ac_mode="full"), dict(ac_mode="selective"),
                           dict(ac_mode="full", offload_activations=True),
                           dict(ac_mode="full", compile=True, compile_backend="aot_eager")):
            assert max((x - y).abs().max().item() for x, y in zip(plain, grads(**recomputed))) < 1e-7, recomputed
        tiled = dict(tiled_mlp=True, mlp_tiles=3)  # tiles draw their masks tile by tile: compared among themselves
        a, b = grads(**tiled), grads(ac_mode="full", **tiled)
        assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-7
        monkeypatch.setattr(parallelize, "needs_rng_replay", lambda model: False)  # the old behaviour
        assert max((x - y).abs().max().item() for x, y in zip(plain, grads(ac_mode="full"))) > 1e-5
    finally:
        if own:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Checkpoints, resume on another mesh, export
# ---------------------------------------------------------------------------


def _rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _trained_model(hf_dir, ckpt):
    """The trainer's LoRA model of a checkpoint, in this process, called as the trainer calls it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ulysses_dtensor.integrations.hf.causal_lm import adapt_causal_lm
    from ulysses_dtensor.integrations.hf.weights import load_transformers_weights
    from ulysses_dtensor.integrations.lora import LoraSpec, add_lora
    from ulysses_dtensor.trainer.checkpoint import load_model_weights

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    lo = json.loads((ckpt / "model.json").read_text())["lora"]
    add_lora(model, LoraSpec(rank=lo["rank"], alpha=lo["alpha"], target_modules=tuple(lo["target_modules"]),
                             modules_to_save=tuple(lo["modules_to_save"])))
    model.to_empty(device="cpu")
    load_transformers_weights(model, hf_dir)
    load_model_weights(ckpt, model, trainable_only=True)
    return adapt_causal_lm(model.eval())


def test_checkpoint_holds_adapters_resumes_on_another_mesh_and_exports(llama_dir, tmp_path):
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.export import main as export_main

    saved = ["--lora.modules_to_save", "norm", "--checkpoint.interval", "2"]
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(Path(json.__file__).read_text())  # documents training never reads
    evals = ["--eval.tasks", "loss", "--eval.lengths", str(SEQ), "--eval.loss_rows", "2", "--eval.data_path",
             str(held_out)]
    full = _argv(llama_dir, tmp_path / "full", "transformers", (1, 2, 2), *saved, "--eval.interval", str(STEPS),
                 *evals)
    resumed = _argv(llama_dir, tmp_path / "resumed", "transformers", (1, 1, 4), *saved)
    run_ranks(4, trainer_jobs, [(full, None),
                               (resumed, (tmp_path / "full" / "checkpoint" / "step-2",
                                          tmp_path / "resumed" / "checkpoint" / "step-2"))])
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "resumed")
    assert [r["step"] for r in b] == [3]
    assert b[0]["loss"] == pytest.approx(a[2]["loss"], rel=1e-6) and b[0]["grad_norm"] == pytest.approx(
        a[2]["grad_norm"], rel=1e-5)
    ckpt = tmp_path / "full" / "checkpoint" / f"step-{STEPS}"
    # the evaluation of the checkpoint (one process: base from model.hf_path + the adapters) is the trainer's
    from ulysses_dtensor.eval import evaluate

    cli = evaluate(_argv(llama_dir, tmp_path / "full", "transformers", (1, 1, 1), *saved, *evals, "--checkpoint",
                         str(ckpt), "--output", str(tmp_path / "eval")))
    during = [json.loads(line) for line in (tmp_path / "full" / "eval" / "eval.jsonl").read_text().splitlines()]
    (a_loss,), (b_loss,) = ([r["loss"] for r in rows if r["kind"] == "loss"] for rows in (cli, during))
    assert a_loss == pytest.approx(b_loss, abs=1e-5)
    keys = [k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(".lora_" in k or k.endswith("norm.weight") for k in keys)  # no base weight
    assert len(keys) == 2 * 7 * 2 + 5

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    trained = _trained_model(llama_dir, ckpt)
    assert export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "adapter")]) == 0
    assert export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["base_model_name_or_path"]) == ("LORA", RANK, str(llama_dir))
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    start = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = trained(ids)
        diffs = {"peft adapter": (adapter(ids).logits - want).abs().max().item(),
                 "merged": (merged(ids).logits - want).abs().max().item()}
        moved = (start(ids).logits - want).abs().max().item()
    print(f"export round trips, max |logits - trainer's|: {diffs}; training moved the logits by {moved:.2e}")
    assert max(diffs.values()) < 1e-5 and moved > 1e-2
    # --merge of a checkpoint that holds every weight: nothing to merge, refused
    plain = tmp_path / "plain"
    shutil.copytree(ckpt, plain)
    info = json.loads((plain / "model.json").read_text())
    (plain / "model.json").write_text(json.dumps({**info, "lora": None}))
    from ulysses_dtensor.export import export_checkpoint
    from ulysses_dtensor.models.llama_checkpoint import HFCheckpointError

    with pytest.raises(HFCheckpointError, match=r"--merge: .*plain holds every weight of the model \(no \[lora\]"):
        export_checkpoint(plain, tmp_path / "x", merge=True)


# ---------------------------------------------------------------------------
# Refused before anything starts
# ---------------------------------------------------------------------------


def test_refusals_name_the_key_and_what_is_valid(llama_dir, tmp_path):
    from ulysses_dtensor.trainer.config import ConfigError, load_config, validate_config

    tied = tmp_path / "tied"
    make_tiny_hf_model(tied, "qwen2", tokenizer=False, **SHAPE)

    def refused(hf_dir, impl, *extra, match):
        with pytest.raises(ConfigError, match=match):
            validate_config(load_config(_argv(hf_dir, tmp_path / "d", impl, (1, 1, 1), *extra)), 1)

    for impl in ("transformers", "native"):
        refused(llama_dir, impl, "--lora.target_modules", "q_proj,qproj",
                match=r"lora.target_modules: 'qproj' matches no module of (LlamaForCausalLM|Llama); its Linear layers")
        refused(llama_dir, impl, "--lora.target_modules", "lm_head",
                match=r"'lm_head' .*is (LlamaForCausalLM|Llama)'s output head .* train it whole with lora.modules_to_save")
        refused(tied, impl, "--lora.modules_to_save", "embed_tokens",
                match=r"lora.modules_to_save: 'embed_tokens' .* shares its weight with another module of .*\(tied embeddings\)")
    refused(llama_dir, "transformers", "--lora.target_modules", "self_attn", match=r"LlamaAttention; LoRA adapters go on Linear")
    with pytest.raises(ConfigError, match=r"lora.rank=4 \(from the command line\) adapts a pretrained model: set "
                                          r"model.hf_path"):
        load_config(["--lora.rank", "4"])
    with pytest.raises(ConfigError, match=r"lora.rank=4 \(from the command line\) with parallelism.tp=2 \(from "
                                          r"the command line\): LoRA adapters are not tensor-parallel here.*set "
                                          r"parallelism.tp = 1"):
        load_config(["--lora.rank", "4", "--model.hf_path", str(llama_dir), "--parallelism.tp", "2"])


def test_planner_counts_adapter_state_only_and_a_bf16_base(llama_dir):
    """The memory planner traces the LoRA step: AdamW state for the adapters alone, the
    frozen base held in bf16 (no float32 master copy), the adapters in float32."""
    from ulysses_dtensor.estimate import plan_memory
    from ulysses_dtensor.models.llama import Llama
    from ulysses_dtensor.trainer.config import load_config, model_args
    from ulysses_dtensor.trainer.lora_setup import apply_lora

    def plan(*extra):
        cfg = load_config(["--model.hf_path", str(llama_dir), "--model.implementation", "native",
                           "--training.mixed_precision_param", "bfloat16", "--training.global_batch_size", "1",
                           "--training.seq_len", "256", *extra])
        return cfg, plan_memory(cfg, 1, 256, layers="full").breakdown

    _, full = plan()
    cfg, lora = plan("--lora.rank", "4")
    with torch.device("meta"):
        model = apply_lora(cfg, Llama(model_args(cfg, VOCAB)), native=True)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert abs(lora["OptState"] - 8 * trained) < 1024 and abs(full["OptState"] - 8 * frozen) < 1024
    assert lora["Sharded Param"] == 2 * frozen + 4 * trained
    print(f"planned (1 rank, 256 tokens): AdamW state {full['OptState'] / 1e3:.0f} KB -> {lora['OptState'] / 1e3:.1f} "
          f"KB, parameters {full['Sharded Param'] / 1e3:.0f} KB -> {lora['Sharded Param'] / 1e3:.0f} KB with LoRA")
