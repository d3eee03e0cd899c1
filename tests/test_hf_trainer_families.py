"""Every transformers family the integration runs trains through the trainer (``model.implementation``).

Each family's tiny config of ``test_hf_integration`` / ``test_hf_linear_attention``
(vocabulary raised to 320 for the byte tokenizer; the MoE families with a router
load-balancing loss get ``output_router_logits = true``) is saved as a model
directory and trained by ``train()`` for 2 steps of 2 x 32 tokens on sp 2 (all
families in ONE pooled 2-rank task). The reference is transformers' own unsharded
model in this process on the same global batch (the trainer's loader over the
built-in corpus): each packed document run alone, the token-mean loss plus
``router_aux_loss_coef x`` transformers' own ``load_balancing_loss_func`` over the
router logits of the whole batch, clipping and AdamW as the trainer does. Both
steps' loss (relative error <= 1e-5) and gradient norm (<= 1e-4) must match, and
``router_aux_loss`` equal transformers' aux loss.

A sample of the family matrix's passing families beyond these (:data:`SAMPLE`: ten, one of
each kind -- windows, MoE with and without a router loss, MLA, the Mamba-2, Mamba and
short-convolution hybrids; two of them a day, all with ``ULYSSES_TRAINER_SAMPLE=all``)
goes end to end: TOML, 2 steps at sp 2 against transformers' own, a DCP resume at step 1
on dp_shard 2, evaluation, and an export that loads in transformers with warnings as errors.

The VL model (Qwen2.5-VL) trains its text path (text-only calls: transformers'
own positions, the same on the three mrope sections); its run also checkpoints,
and the export of that checkpoint must hold the source's tensor names, config.json
and untouched (frozen) vision tower, load with the original class with warnings as
errors, and give the trainer's logits.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra (transformers)", allow_module_level=True)

import test_hf_integration as integration  # noqa: E402
import test_hf_linear_attention as linear  # noqa: E402
from distributed import run_ranks  # noqa: E402
from packed_reference import document_spans  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ, BATCH, STEPS, LR = 320, 32, 2, 2, 3e-3
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


# The VL model (its text path): token ids inside the vocabulary (a clean from_pretrained of the export).
VL, VL_TEXT = "qwen2_5_vl", dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _families() -> dict:
    """name -> (builder, router loss on)."""
    out = {name: (integration.make_model, spec.moe) for name, spec in integration.FAMILIES.items()}
    out.update({name: (linear.make_model, False) for name in linear.FAMILIES})
    return out


def _args(hf_dir, dump, checkpoint: bool = False) -> list[str]:
    return [
        "--config", str(REPO / "train_configs" / "debug_hf.toml"),
        "--model.hf_path", str(hf_dir), "--model.implementation", "transformers", "--data.tokenizer", "byte",
        "--job.dump_folder", str(dump), "--training.steps", str(STEPS), "--training.global_batch_size", str(BATCH),
        "--context.schedule", f"1:{SEQ}", "--parallelism.dp_shard", "1", "--parallelism.sp", "2",
        "--optimizer.lr", str(LR), "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay", "none",
        *(["--checkpoint.interval", str(STEPS)] if checkpoint else ["--checkpoint.enable", "false"]),
        "--data.max_corpus_mb", "0.05", "--metrics.log_freq", "1",
        "--metrics.progress_bar", "false",
    ]


def _train_all(rank, world, jobs, seeds):
    """Each job's metric rows; a job named in ``seeds`` first gets a checkpoint copied in."""
    import shutil

    import torch.distributed as dist

    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import train

    out = {}
    for name, argv in jobs.items():
        if name in seeds:
            if rank == 0:
                shutil.copytree(*seeds[name])
            dist.barrier()
        out[name] = train(load_config(argv))
    return out


def _aux_fn(model):
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models."))
    return importlib.import_module(cls.__module__).load_balancing_loss_func


def reference(model, argv, router: bool, steps: int = STEPS) -> list[dict]:
    """The trainer's first ``steps`` steps of ``argv`` (constant lr) by hand on transformers'
    own unsharded model: loss (+ coef x aux), router_aux_loss, gradient norm before clipping."""
    from ulysses_dtensor.data import build_tokenizer
    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.data_setup import build_training_data

    cfg = load_config(argv)
    opt = cfg.optimizer
    adamw = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                              weight_decay=opt.weight_decay)
    # the trainer's global batches (one dp rank reading all of them)
    schedule = cfg.context_schedule()
    loader = build_training_data(cfg).loader(build_tokenizer(cfg.data.tokenizer), 0, 1, schedule, 0, None)
    rows = []
    for step in range(1, steps + 1):
        batch = loader.batch_for(step)
        total, count, logits_per_doc = 0.0, 0, []
        for ids, pos in zip(batch["input_ids"], batch["position_ids"]):
            for a, b in document_spans(pos):
                out = model(input_ids=ids[None, a:b], output_router_logits=True) if router else model(ids[None, a:b])
                if router:
                    logits_per_doc.append(out.router_logits)
                if b - a < 2:
                    continue
                total = total + F.cross_entropy(out.logits[0, :-1].float(), ids[a + 1:b], reduction="sum")
                count += b - a - 1
        loss, row = total / count, {}
        if router:
            aux = _aux_fn(model)(tuple(torch.cat(layer) for layer in zip(*logits_per_doc)),
                                 model.num_experts, model.num_experts_per_tok)
            loss = loss + model.router_aux_loss_coef * aux
            row["router_aux_loss"] = aux.item()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        adamw.step()
        adamw.zero_grad()
        rows.append({"loss": loss.item(), "grad_norm": norm.item(), **row})
    loader.close()
    return rows


def test_every_family_trains_through_the_trainer_as_transformers(tmp_path, capsys):
    families = _families()
    jobs, models = {}, {}
    for name, (build, router) in families.items():
        extra = {"output_router_logits": True} if router else {}
        if name == VL:
            extra = VL_TEXT
        model = build(name, vocab_size=VOCAB, **extra)
        model.save_pretrained(tmp_path / name)
        jobs[name] = _args(tmp_path / name, tmp_path / "runs" / name, checkpoint=name == VL)
        models[name] = model
    # The VL run also checkpoints (steps 1, 2: resume, export) and evaluates at step 2; it
    # resumes from step 1 on another mesh (dp_shard 2: the frozen vision tower has no optimizer
    # state to restore).
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(Path(json.__file__).read_text())
    jobs[VL] += ["--checkpoint.interval", "1", *_vl_eval_args(held_out)]
    resumed = VL + " resumed"
    jobs[resumed] = _args(tmp_path / VL, tmp_path / "runs" / resumed, checkpoint=True)
    jobs[resumed][jobs[resumed].index("--parallelism.dp_shard") + 1: jobs[resumed].index("--parallelism.sp") + 2] = [
        "2", "--parallelism.sp", "1"]
    seeds = {resumed: (tmp_path / "runs" / VL / "checkpoint" / "step-1",
                       tmp_path / "runs" / resumed / "checkpoint" / "step-1")}
    out = run_ranks(2, _train_all, jobs, seeds)[0]
    table = []
    for name, (_, router) in families.items():
        model = models[name].train()
        ref = reference(model, jobs[name], router)
        rows = out[name]
        assert [r["step"] for r in rows] == [1, 2], name
        loss_rel = max(abs(r["loss"] - w["loss"]) / w["loss"] for r, w in zip(rows, ref))
        norm_rel = max(abs(r["grad_norm"] - w["grad_norm"]) / w["grad_norm"] for r, w in zip(rows, ref))
        assert loss_rel <= LOSS_RTOL, (name, [r["loss"] for r in rows], [w["loss"] for w in ref])
        assert norm_rel <= GRAD_RTOL, (name, [r["grad_norm"] for r in rows], [w["grad_norm"] for w in ref])
        if router:
            for r, w in zip(rows, ref):
                assert r["router_aux_loss"] == pytest.approx(w["router_aux_loss"], rel=LOSS_RTOL), name
        else:
            assert all("router_aux_loss" not in r for r in rows), name
        table.append(f"{name}: loss {loss_rel:.1e}, grad norm {norm_rel:.1e}" + (" (with router aux loss)" if router else ""))
        if name == VL:
            # resumed at step 1 on dp_shard 2: step 2 as the uninterrupted run's
            again = out[resumed]
            assert [r["step"] for r in again] == [2], again
            assert again[0]["loss"] == pytest.approx(ref[1]["loss"], rel=LOSS_RTOL)
            assert again[0]["grad_norm"] == pytest.approx(ref[1]["grad_norm"], rel=GRAD_RTOL)
    table.append(_vl_eval(tmp_path / "runs" / VL, models[VL].eval(), held_out))
    table.append(_vl_export(tmp_path, models[VL]))
    table.append(_vl_plan(jobs[VL], models[VL]))
    with capsys.disabled():
        print("\ntrainer (sp 2) vs transformers unsharded, worst relative error over 2 steps:\n  " + "\n  ".join(table))


EVAL_LENGTH, EVAL_ROWS = 33, 2  # sp does not divide the length: evaluation pads


def _vl_eval_args(held_out) -> list[str]:
    return ["--eval.interval", str(STEPS), "--eval.tasks", "loss", "--eval.lengths", str(EVAL_LENGTH),
            "--eval.loss_rows", str(EVAL_ROWS), "--eval.data_path", str(held_out)]


def _vl_eval(dump, trained_ref, held_out) -> str:
    """The trainer's held-out loss at step 2 (sp 2) equals transformers' trained model's
    over the same rows (each packed document alone)."""
    rel = _eval_loss(dump, trained_ref, held_out)
    assert rel <= 1e-5, rel
    return f"{VL} eval (sp 2, length {EVAL_LENGTH}) vs transformers' trained model: loss {rel:.1e}"


def _vl_export(tmp_path, trained_ref) -> str:
    """The VL run's checkpoint exported: the source's tensor names and config.json, loaded by
    the original class with warnings as errors; its text logits equal the trainer's model
    (the checkpoint in the adapter) and transformers' own model trained alongside; the
    frozen vision tower exactly as loaded."""
    import transformers
    from safetensors import safe_open
    from transformers_strict import no_transformers_warnings

    from ulysses_dtensor.export import main as export_main
    from ulysses_dtensor.integrations.hf.causal_lm import adapt_causal_lm
    from ulysses_dtensor.integrations.hf.weights import init_non_persistent_buffers
    from ulysses_dtensor.trainer.checkpoint import load_model_weights

    src, ckpt, out = tmp_path / VL, tmp_path / "runs" / VL / "checkpoint" / f"step-{STEPS}", tmp_path / "vl_hf"
    assert export_main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    tensors = lambda d: {k: f.get_tensor(k) for p in d.glob("*.safetensors")  # noqa: E731
                         for f in [safe_open(str(p), "pt")] for k in f.keys()}
    exported_t, source_t = tensors(out), tensors(src)
    assert exported_t.keys() == source_t.keys()  # save_pretrained's layout ("model.layers.*", "visual.*")
    vision = [k for k in source_t if k.startswith("visual.")]
    assert vision and all(torch.equal(exported_t[k], source_t[k]) for k in vision)  # frozen
    config, source = (json.loads((d / "config.json").read_text()) for d in (out, src))
    assert {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")}

    cls = getattr(transformers, integration.FAMILIES[VL].model)
    with no_transformers_warnings():
        exported = cls.from_pretrained(out, dtype=torch.float32).eval()
    with torch.device("meta"):
        trainer_model = cls._from_config(transformers.AutoConfig.from_pretrained(src), dtype=torch.float32)
    trainer_model.to_empty(device="cpu")
    init_non_persistent_buffers(trainer_model)
    load_model_weights(ckpt, trainer_model)
    trainer_model = adapt_causal_lm(trainer_model.eval())
    start = cls.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = trainer_model(ids), exported(input_ids=ids).logits
        ref, before = trained_ref(input_ids=ids).logits, start(input_ids=ids).logits
    diff, ref_diff = (got - want).abs().max().item(), (got - ref).abs().max().item()
    assert diff < 1e-5 and ref_diff < 1e-4, (diff, ref_diff)
    moved = (want - before).abs().max().item()
    assert moved > 1e-2, moved  # it trained
    return (f"{VL} export -> from_pretrained: logits vs the trainer's {diff:.1e}, vs transformers' trained "
            f"{ref_diff:.1e} (training moved them {moved:.1e})")


def _vl_plan(argv, model) -> str:
    """The memory planner traces the VL model (sp 2 x dp_shard 2, fake ranks): optimizer state for
    the text path only (AdamW's two fp32 moments, sharded over 4 ranks; a vision tower that
    trained would add its own), and the frozen tower's FSDP group, never gathered, traces."""
    from ulysses_dtensor.estimate import plan_memory
    from ulysses_dtensor.trainer.config import load_config

    argv = list(argv)
    argv[argv.index("--parallelism.dp_shard") + 1] = "2"
    plan = plan_memory(load_config(argv), 4, SEQ, rows=1, device="cpu")
    vision = sum(p.numel() for p in model.model.visual.parameters())
    text = sum(p.numel() for p in model.parameters()) - vision
    state = plan.breakdown.get("OptState") or plan.end_of_forward.get("OptState")
    assert state == pytest.approx(2 * 4 * text / 4, rel=0.02), (state, text, vision)
    assert vision * 2 * 4 / 4 > 0.05 * state  # a trained tower would be seen
    return f"{VL} memory plan: optimizer state {state} B for {text} text parameters ({vision} frozen vision)"


# ---------------------------------------------------------------------------
# A sample of the family matrix's families end to end: TOML, DCP resume on another mesh, eval, export
# ---------------------------------------------------------------------------

# Ten families beyond the twenty above, one of each kind the matrix passes: sliding windows
# (OLMo-3), MoE without (GLM-4-MoE) and with a router loss (PhiMoE), MLA (DeepSeek-V2), and the
# hybrids: Mamba-2 mixers (Bamba, Nemotron-H with its MLP / MoE layers, Falcon-H1 with attention
# and Mamba in one layer and a muP head, Zamba2 with its shared attention block), short
# convolutions (LFM2) and Jamba's Mamba (with a router loss).
SAMPLE = ("olmo3", "glm4_moe", "phimoe", "deepseek_v2", "bamba", "nemotron_h", "falcon_h1", "zamba2", "lfm2",
          "jamba")
# Each suite run trains ROTATING of them (the day's; each costs a few seconds of 2 ranks): all ten
# pass (ULYSSES_TRAINER_SAMPLE=all runs them all; a comma-separated list names some).
ROTATING = 2
SAMPLE_ENV = "ULYSSES_TRAINER_SAMPLE"


def trainer_sample() -> list[str]:
    """The families of :data:`SAMPLE` this run trains: those :data:`SAMPLE_ENV` names, else the day's."""
    import datetime
    import os
    import random

    named = os.environ.get(SAMPLE_ENV, "")
    if named == "all":
        return list(SAMPLE)
    if named:
        return [t for t in named.split(",") if t in SAMPLE]
    day = datetime.date.today().toordinal()
    return sorted(random.Random(day).sample(SAMPLE, ROTATING), key=SAMPLE.index)


def _matrix_model(name: str):
    """The family matrix's tiny model of ``name`` with the byte tokenizer's vocabulary."""
    from ulysses_dtensor.integrations.hf.matrix import check as family_check
    from ulysses_dtensor.integrations.hf.matrix import tiny_configs as family_matrix

    config = family_matrix.tiny_config(name)
    config.get_text_config().vocab_size = VOCAB
    model = family_matrix.tiny_model(config)
    router = family_check.router_loss(model) is not None
    if router:
        model.config.get_text_config().output_router_logits = True
    return model, router


def _eval_loss(dump, trained_ref, held_out) -> float:
    """The trainer's held-out loss at step 2 against transformers' trained model (each document alone)."""
    from ulysses_dtensor.data import TokenStream, build_source, build_tokenizer

    rows = [json.loads(line) for line in (dump / "eval" / "eval.jsonl").read_text().splitlines() if line.strip()]
    (got,) = [r for r in rows if r["kind"] == "loss" and r["step"] == STEPS]
    stream = TokenStream(build_source(str(held_out)), build_tokenizer("byte"), seed=1234, shuffle=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(EVAL_ROWS):
            ids, pos = (torch.from_numpy(a) for a in stream.take(EVAL_LENGTH))
            for a, b in document_spans(pos):
                if b - a > 1:
                    logits = trained_ref(input_ids=ids[None, a:b]).logits[0, :-1]
                    total += F.cross_entropy(logits, ids[a + 1:b], reduction="sum").item()
                    count += b - a - 1
    assert got["tokens"] == count, (got, count)
    return abs(got["loss"] - total / count) / (total / count)


def _export_diff(src, ckpt, out, trained_ref) -> tuple[float, float]:
    """Export ``ckpt`` and load it with transformers' own class, warnings as errors: (max logits
    difference to the checkpoint's weights in transformers' class, max difference to transformers'
    model trained alongside relative to its logits' scale)."""
    import transformers
    from transformers_strict import no_transformers_warnings

    from ulysses_dtensor.export import main as export_main
    from ulysses_dtensor.integrations.hf.weights import init_non_persistent_buffers
    from ulysses_dtensor.trainer.checkpoint import load_model_weights

    assert export_main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    with no_transformers_warnings():
        exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.device("meta"):
        trained = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(src),
                                                                dtype=torch.float32)
    trained.to_empty(device="cpu")
    init_non_persistent_buffers(trained)
    load_model_weights(ckpt, trained)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want, ref = (m.eval()(input_ids=ids).logits for m in (exported, trained, trained_ref))
    return (got - want).abs().max().item(), ((got - ref).abs().max() / ref.abs().max()).item()


def test_sampled_families_resume_on_another_mesh_evaluate_and_export(tmp_path, capsys):
    sample = trainer_sample()
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(Path(json.__file__).read_text())
    jobs, seeds, models = {}, {}, {}
    for name in sample:
        model, router = _matrix_model(name)
        model.save_pretrained(tmp_path / name)
        models[name] = (model, router)
        jobs[name] = _args(tmp_path / name, tmp_path / "runs" / name, checkpoint=True) + [
            "--checkpoint.interval", "1", *_vl_eval_args(held_out)]
        # Resumed from step 1 on dp_shard 2 (another mesh: parameters sharded over 2 ranks, no sp).
        resumed = f"{name} resumed"
        jobs[resumed] = _args(tmp_path / name, tmp_path / "runs" / resumed, checkpoint=True)
        at = jobs[resumed].index("--parallelism.dp_shard")
        jobs[resumed][at + 1: at + 4] = ["2", "--parallelism.sp", "1"]
        seeds[resumed] = (tmp_path / "runs" / name / "checkpoint" / "step-1",
                          tmp_path / "runs" / resumed / "checkpoint" / "step-1")
    # Each family trains twice (sp 2, then resumed on dp_shard 2) and checkpoints: ten of them take
    # minutes on a loaded 2-core machine, more than the pool's default task timeout.
    out = run_ranks(2, _train_all, jobs, seeds, timeout=120 + 120 * len(sample))[0]
    table = []
    for name in sample:
        model, router = models[name]
        ref = reference(model.train(), jobs[name], router)
        rows, again = out[name], out[f"{name} resumed"]
        assert [r["step"] for r in rows] == [1, 2] and [r["step"] for r in again] == [2], (name, rows, again)
        loss = max(abs(r["loss"] - w["loss"]) / w["loss"] for r, w in zip([*rows, *again], [*ref, ref[1]]))
        norm = max(abs(r["grad_norm"] - w["grad_norm"]) / w["grad_norm"] for r, w in zip([*rows, *again],
                                                                                          [*ref, ref[1]]))
        assert loss <= LOSS_RTOL and norm <= GRAD_RTOL, (name, rows, again, ref)
        evaluated = _eval_loss(tmp_path / "runs" / name, model.eval(), held_out)
        assert evaluated <= 1e-5, (name, evaluated)
        exported, vs_ref = _export_diff(tmp_path / name, tmp_path / "runs" / name / "checkpoint" / f"step-{STEPS}",
                                        tmp_path / "export" / name, model)
        # The export is the checkpoint exactly; the checkpoint is transformers' own training to
        # Adam's rounding (parameters whose gradient is rounding noise move by lr either way).
        assert exported < 1e-5 and vs_ref < 1e-3, (name, exported, vs_ref)
        table.append(f"{name}: loss {loss:.1e}, grad norm {norm:.1e} (sp 2, resumed on dp_shard 2), eval "
                     f"{evaluated:.1e}, export logits {exported:.1e} (vs transformers' trained {vs_ref:.1e})"
                     + (" (router loss)" if router else ""))
    with capsys.disabled():
        print(f"\nsampled families through the trainer vs transformers unsharded ({SAMPLE_ENV}="
              f"{','.join(sample)}):\n  " + "\n  ".join(table))
