"""Context-stage ropes on transformers models (``model.implementation = "transformers"``).

* ``set_rope`` on the adapted model gives the logits of a fresh transformers model
  built from a config.json with that rope (written as the export writes it, loaded
  with warnings as errors; its rope_parameters are the table a user writes) for
  every rope type, on families with a plain rope, a partial rotary (GLM-4), MLA's
  rope dims (DeepSeek-V3) and multimodal rope sections (Qwen2.5-VL); Phi-3's
  config refuses types other than default / longrope and Gemma3's per-layer ropes
  are refused, each with the reason.
* On sp 2, ``dynamic`` and ``longrope`` use the WHOLE sequence's length: rank 0's
  slice alone would pick other frequencies.
* The trainer on sp 2 (2 ranks): theta raised at stage 2, YaRN at stage 3 -- each
  step equals transformers' own model whose rotary module is rebuilt from the
  stage's config (every document alone, AdamW, clipping); the banner and rows name
  each stage's rope; a resume inside stage 3 gives the same step; the export's
  config.json holds the yarn rope and ``from_pretrained`` (no warning) gives the
  trained model's logits; a stage rope the family refuses stops the run.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import test_hf_integration as integration
import torch
from distributed import run_ranks
from packed_reference import builtin_corpus_loader, reference_step, trainer_adamw
from transformers_strict import no_transformers_warnings

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_hf_model import make_tiny_hf_model  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _ropes(rope_dim: int, original: int = 16) -> list:
    from ulysses_dtensor.models.rope import RopeConfig

    half = rope_dim // 2
    return [
        RopeConfig(theta=5e5),
        RopeConfig("linear", 1e4, factor=2.0),
        RopeConfig("yarn", 1e5, factor=4.0, original_max_position_embeddings=original),
        RopeConfig("llama3", 5e5, factor=8.0, original_max_position_embeddings=original, low_freq_factor=1.0,
                   high_freq_factor=4.0),
        RopeConfig("dynamic", 1e4, factor=2.0, original_max_position_embeddings=original),
        RopeConfig("longrope", 1e4, factor=4.0, original_max_position_embeddings=original,
                   short_factor=tuple(1 + 0.1 * i for i in range(half)), long_factor=tuple(1.0 + i for i in range(half))),
    ]


def _fresh(family: str, config):
    import transformers

    cls = integration.FAMILIES[family].model
    if cls:
        return getattr(transformers, cls)._from_config(config, attn_implementation="eager").eval()
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _rel(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_set_rope_equals_a_fresh_transformers_model_of_that_rope():
    from ulysses_dtensor.integrations.hf.causal_lm import adapt_causal_lm
    from ulysses_dtensor.integrations.hf.rotary import export_rope_fields

    ids = torch.randint(0, integration.VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    worst = {}
    for family in ("llama", "glm4", "deepseek_v3", "qwen2_5_vl"):
        model = integration.make_model(family).eval()
        source = model.config.to_dict()
        model = adapt_causal_lm(model)
        with torch.no_grad():
            before = model(ids)
        extras = model.rope_support.extras
        for rope in _ropes(model.rope_support.rope_dim):
            model.set_rope(rope)
            config, note = export_rope_fields(source, rope, trained_len=40)
            text = config.get("text_config", config)
            assert note is None and text["rope_parameters"] == {**extras, **rope.parameters()}, (family, rope)
            with no_transformers_warnings():
                fresh = _fresh(family, type(model.config).from_dict(config))
            fresh.load_state_dict(model.state_dict())
            with torch.no_grad():
                got, want = model(ids), fresh(ids).logits
            worst[(family, rope.rope_type)] = _rel(got, want)
            assert _rel(got, want) <= 1e-5, (family, rope.describe(), _rel(got, want))
            assert _rel(got, before) > 1e-4, (family, rope.describe())  # the rope changed the logits
    print("set_rope vs fresh transformers model, worst relative logits error:", f"{max(worst.values()):.1e}")

    # Families whose rope a stage cannot set, or whose config refuses a type: the reason.
    phi3 = adapt_causal_lm(integration.make_model("phi3"))
    with pytest.raises(ValueError, match=r"must be one of \['longrope'\], got yarn"):
        phi3.rope_support.check_rope(_ropes(phi3.rope_support.rope_dim)[2])
    gemma3 = adapt_causal_lm(integration.make_model("gemma3"))
    assert gemma3.rope is None and "one rope per layer type" in gemma3.rope_support.reason
    with pytest.raises(ValueError, match="Gemma3ForCausalLM has one rope per layer type"):
        gemma3.set_rope(_ropes(8)[0])


def _global_length_task(rank, world):
    from ulysses_dtensor.integrations.hf import parallelize_hf_model
    from ulysses_dtensor.integrations.hf.causal_lm import adapt_causal_lm
    from ulysses_dtensor.integrations.hf.rotary import export_rope_fields
    from ulysses_dtensor.parallel.mesh import ParallelDims

    seq = 48
    ids = torch.randint(0, integration.VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    pmesh = ParallelDims(1, 1, 2, world_size=2).build_mesh("cpu")
    with integration.registry_restored():
        model = integration.make_model("llama")
        source, state = model.config.to_dict(), copy.deepcopy(model.state_dict())
        parallelize_hf_model(model, pmesh, attn_backend="sdpa")
        model = adapt_causal_lm(model.eval(), pmesh)
        local = ids[:, rank * seq // 2:(rank + 1) * seq // 2]
        out = {}
        # original 32: rank 0's positions (< 24) alone stay within it, the sequence (48) does not.
        for rope in _ropes(model.rope_support.rope_dim, original=32)[4:]:
            model.set_rope(rope)
            with torch.no_grad():
                mine = model(local)
            whole = _gather(mine)
            config, _ = export_rope_fields(source, rope, trained_len=seq)
            fresh = _fresh("llama", type(model.config).from_dict(config))
            fresh.load_state_dict(state)
            sliced = _fresh("llama", type(model.config).from_dict(config))
            sliced.load_state_dict(state)
            with torch.no_grad():
                want = fresh(ids).logits
                # what one rank's slice alone would give (its own length)
                alone = sliced(ids[:, : seq // 2]).logits
            out[rope.rope_type] = (_rel(whole, want), _rel(whole[:, : seq // 2], alone))
    return out


def _gather(local):
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=1)


def test_length_dependent_ropes_use_the_whole_sequence_under_sp():
    out = run_ranks(2, _global_length_task)[0]
    for kind, (err, alone) in out.items():
        assert err <= 1e-5, (kind, err)
        assert alone > 1e-4, (kind, alone)  # the slice's own length would be wrong
    print("sp 2, global length:", {k: f"{v[0]:.1e}" for k, v in out.items()})


# ---------------------------------------------------------------------------
# The trainer: stage ropes on a transformers model
# ---------------------------------------------------------------------------

SHAPE = dict(vocab_size=320, dim=64, layers=2, heads=8, kv_heads=4, ffn_dim=96, init_std=0.08)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
STEPS, BATCH, LR = 4, 2, 3e-3


def _toml() -> dict:
    with open(REPO / "train_configs" / "debug_rope_llama.toml", "rb") as fh:
        toml = tomllib.load(fh)
    toml["model"]["implementation"] = "transformers"
    toml["training"].update(steps=STEPS, global_batch_size=BATCH)
    toml["checkpoint"].update(interval=3)
    toml["optimizer"].update(lr=LR)
    toml["lr_scheduler"] = {"warmup_steps": 0, "decay": "none"}
    toml["parallelism"].update(dp_shard=1, sp=2)
    toml["context"]["schedule"] = [
        {"start_step": 1, "seq_len": 32},
        {"start_step": 2, "seq_len": 32, "rope_theta": 1e5},  # theta only: llama3 kept
        {"start_step": 3, "seq_len": 64, "rope_scaling": dict(YARN)},  # yarn with theta 1e5
    ]
    return toml


def _overrides(hf_dir, dump) -> list[tuple[str, str]]:
    return [("model.hf_path", str(hf_dir)), ("data.tokenizer", "byte"), ("job.dump_folder", str(dump)),
            ("metrics.progress_bar", "false"), ("data.max_corpus_mb", "0.05"), ("activation_checkpoint.mode", "none")]


def _schedule_task(rank, world, toml, hf_dir, dump, resumed):
    import contextlib
    import io

    import torch.distributed as dist

    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.loop import train

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        first = train(parse_config(toml, _overrides(hf_dir, dump)))
    if rank == 0:
        shutil.copytree(Path(dump) / "checkpoint" / "step-3", Path(resumed) / "checkpoint" / "step-3")
    dist.barrier()
    second = train(parse_config(toml, _overrides(hf_dir, resumed)))
    return {"first": first, "second": second, "banner": printed.getvalue()}


def _reference(hf_dir, toml) -> list[dict]:
    """The schedule by hand on transformers' own model: at each stage its rotary module
    is rebuilt from a config carrying the stage's rope (as a user's config.json would)."""
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.trainer.config import parse_config

    cfg = parse_config(toml, _overrides(hf_dir, "unused"))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    base = dict(model.config.rope_parameters)
    stage_ropes = [base, {**base, "rope_theta": 1e5}, {"rope_theta": 1e5, **YARN}]
    adamw = trainer_adamw(model, cfg, LR)
    loader, schedule = builtin_corpus_loader(cfg)
    rows = []
    for step in range(1, STEPS + 1):
        config = copy.deepcopy(model.config)
        config.rope_parameters = dict(stage_ropes[schedule.stage_index(step)])
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
        batch = loader.next_batch(schedule.batch_size(step), schedule.seq_len(step))
        rows.append(reference_step(model, adamw, batch, cfg.training.max_norm))
    return rows


def test_trainer_stage_ropes_on_a_transformers_model(tmp_path):
    from test_trainer_transformers import _trained_model
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.export import export_checkpoint
    from ulysses_dtensor.models.rope import RopeConfig
    from ulysses_dtensor.trainer.config import (
        ConfigError,
        parse_config,
        validate_config,
    )

    hf_dir = tmp_path / "llama"
    make_tiny_hf_model(hf_dir, "llama", tokenizer=False, **SHAPE)  # llama3 rope, theta 1e4
    toml = _toml()
    dump, resumed = tmp_path / "dump", tmp_path / "resumed"
    out = run_ranks(2, _schedule_task, toml, str(hf_dir), str(dump), str(resumed))[0]
    first, second, banner = out["first"], out["second"], out["banner"]

    assert "implementation transformers" in banner
    assert "rope stage 1 (from step 2, seq_len 32): llama3 theta=100000 factor=8" in banner
    assert "rope stage 2 (from step 3, seq_len 64): yarn theta=100000 factor=4" in banner
    assert [(r["rope_type"], r["rope_theta"]) for r in first] == [
        ("llama3", 1e4), ("llama3", 1e5), ("yarn", 1e5), ("yarn", 1e5)]
    ref = _reference(hf_dir, toml)
    for r, want in zip(first, ref):
        assert r["loss"] == pytest.approx(want["loss"], rel=1e-5), (r["step"], r["loss"], want)
        assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (r["step"], r["grad_norm"], want)
    # resumed inside stage 3: its rope is restored
    assert [r["step"] for r in second] == [4] and second[0]["rope_type"] == "yarn"
    assert second[0]["loss"] == pytest.approx(first[3]["loss"], rel=1e-6)
    assert second[0]["grad_norm"] == pytest.approx(first[3]["grad_norm"], rel=1e-5)

    # export: the last stage's rope; from_pretrained gives the trainer's logits
    ckpt = dump / "checkpoint" / f"step-{STEPS}"
    export_checkpoint(ckpt, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e5, **YARN}
    assert config["max_position_embeddings"] == 4 * 32
    with no_transformers_warnings():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    trained = _trained_model(hf_dir, ckpt)
    start = trained.rope
    trained.set_rope(RopeConfig.from_parameters({"rope_theta": 1e5, **YARN}))
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want, got = trained(ids), hf(ids).logits
        trained.set_rope(start)
        other = trained(ids)
    assert _rel(got, want) <= 1e-5
    assert _rel(other, want) > 1e-3  # the starting rope gives other logits

    # a stage rope the family's config refuses stops the run, naming the stage and key
    phi3 = tmp_path / "phi3"
    integration.make_model("phi3", vocab_size=320).save_pretrained(phi3)
    bad = _toml()
    bad["context"]["schedule"][2]["rope_scaling"] = dict(YARN)
    with pytest.raises(ConfigError, match=r"context.schedule\[2\].rope_scaling.rope_type='yarn' cannot be used "
                                          r"by this model: .*must be one of \['longrope'\]"):
        validate_config(parse_config(bad, _overrides(phi3, tmp_path / "p")), 2)
