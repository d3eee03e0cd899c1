"""The trainer with a rope per context stage: tiny HF models, 4 gloo ranks (dp_shard 2 x sp 2).

* a schedule that raises theta at stage 2 and switches to YaRN at stage 3: the
  banner prints each stage's rope, every metrics.jsonl row names the rope in
  effect, resuming from a checkpoint inside stage 3 gives the exact trajectory,
  and the export loads in transformers without a warning and gives the trained
  model's logits (the same weights with the starting rope give others);
* the shipped CPU debug configs (``debug_rope_llama.toml``: theta per stage;
  ``debug_rope_qwen3_yarn.toml``: YaRN at the last stage) run end to end and
  show the rope change in the banner and in metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from transformers_strict import no_transformers_warnings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_hf_model import make_tiny_hf_model  # noqa: E402

SHAPE = dict(vocab_size=320, dim=64, layers=2, heads=8, kv_heads=4, ffn_dim=96, init_std=0.08)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def _train(toml: dict, overrides: list[str]) -> tuple[list[dict], str]:
    """Rows and (rank 0's) printed output of one training run."""
    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.loop import train

    pairs = [(overrides[i][2:], overrides[i + 1]) for i in range(0, len(overrides), 2)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rows = train(parse_config(toml, pairs))
    return rows, out.getvalue()


def _schedule_task(rank, world, toml: dict, hf_dir: str, dump: str, resumed: str) -> dict:
    import torch.distributed as dist

    common = ["--model.hf_path", hf_dir, "--data.tokenizer", "byte", "--metrics.progress_bar", "false"]
    first, banner = _train(toml, common + ["--job.dump_folder", dump])
    if rank == 0:
        shutil.copytree(Path(dump) / "checkpoint" / "step-3", Path(resumed) / "checkpoint" / "step-3")
    dist.barrier()
    second, banner2 = _train(toml, common + ["--job.dump_folder", resumed])
    return {"first": first, "second": second, "banner": banner, "banner2": banner2}


def _trained_model(hf_dir: Path, ckpt: Path):
    """Our model with the checkpoint's weights, read in one process."""
    import torch.distributed.checkpoint as dcp

    from ulysses_dtensor.models.llama import Llama
    from ulysses_dtensor.models.llama_checkpoint import (
        args_from_hf_config,
        quiet_single_process,
        read_hf_config,
    )

    model = Llama(args_from_hf_config(read_hf_config(hf_dir)))
    state = {"model": model.state_dict()}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(ckpt))
    model.load_state_dict(state["model"])
    return model.eval()


def test_rope_schedule_banner_rows_resume_and_export(tmp_path):
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.export import export_checkpoint
    from ulysses_dtensor.models.rope import RopeConfig

    hf_dir = tmp_path / "llama"
    make_tiny_hf_model(hf_dir, "llama", tokenizer=False, **SHAPE)  # llama3 rope, theta 1e4
    with open(REPO / "train_configs" / "debug_rope_llama.toml", "rb") as fh:
        toml = tomllib.load(fh)
    toml["training"].update(steps=4)
    toml["checkpoint"].update(interval=3)
    toml["context"]["schedule"] = [
        {"start_step": 1, "seq_len": 32},
        {"start_step": 2, "seq_len": 32, "rope_theta": 1e5},  # theta only: llama3 kept
        {"start_step": 3, "seq_len": 64, "rope_scaling": dict(YARN)},  # yarn with theta 1e5
    ]
    dump, resumed = tmp_path / "dump", tmp_path / "resumed"
    out = run_ranks(4, _schedule_task, toml, str(hf_dir), str(dump), str(resumed))[0]
    first, second = out["first"], out["second"]

    # Banner and rows say the rope of each stage.
    assert "rope stage 0 (from step 1, seq_len 32): llama3 theta=10000 factor=8" in out["banner"]
    assert "rope stage 1 (from step 2, seq_len 32): llama3 theta=100000 factor=8" in out["banner"]
    assert ("rope stage 2 (from step 3, seq_len 64): yarn theta=100000 factor=4 "
            "original_max_position_embeddings=32") in out["banner"]
    assert "step 3: rope -> yarn theta=100000" in out["banner"]
    assert [(r["rope_type"], r["rope_theta"], r["rope_factor"]) for r in first] == [
        ("llama3", 1e4, 8.0), ("llama3", 1e5, 8.0), ("yarn", 1e5, 4.0), ("yarn", 1e5, 4.0)]
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["rope_type"] for r in logged] == ["llama3", "llama3", "yarn", "yarn"]

    # Resumed inside stage 3: the yarn rope is restored, the step is the same.
    assert [r["step"] for r in second] == [4] and second[0]["rope_type"] == "yarn"
    assert second[0]["loss"] == pytest.approx(first[3]["loss"], rel=1e-6, abs=0)
    assert second[0]["grad_norm"] == pytest.approx(first[3]["grad_norm"], rel=1e-5, abs=0)
    state = json.loads((dump / "checkpoint" / "step-4" / "train_state.json").read_text())
    assert RopeConfig.from_dict(state["context"]["rope"]).rope_type == "yarn"

    # Export: config.json has the last stage's rope; from_pretrained gives the trained logits.
    ckpt = dump / "checkpoint" / "step-4"
    export_checkpoint(ckpt, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e5, **YARN}
    assert config["max_position_embeddings"] == 4 * 32  # yarn: factor x original (>= 64 trained)
    with no_transformers_warnings():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    trained = _trained_model(hf_dir, ckpt)
    trained.set_rope(RopeConfig.from_parameters({"rope_theta": 1e5, **YARN}))
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want, got = trained(ids), hf(ids).logits
        trained.set_rope(trained.args.rope)  # the same weights with the starting rope
        other = trained(ids)
    diff = ((got - want).abs().max() / want.abs().max()).item()
    print(f"export after theta (stage 2) and yarn (stage 3): from_pretrained logits rel diff {diff:.1e}; "
          f"with the starting rope {((other - want).abs().max() / want.abs().max()).item():.1e}")
    assert diff < 1e-5
    assert (other - want).abs().max() / want.abs().max() > 1e-3


def _debug_configs_task(rank, world, llama_dir: str, qwen_dir: str, dumps: str) -> dict:
    out = {}
    for name, hf_dir in (("debug_rope_llama", llama_dir), ("debug_rope_qwen3_yarn", qwen_dir)):
        with open(REPO / "train_configs" / f"{name}.toml", "rb") as fh:
            toml = tomllib.load(fh)
        rows, printed = _train(toml, ["--model.hf_path", hf_dir, "--data.tokenizer", "byte",
                                      "--job.dump_folder", f"{dumps}/{name}", "--metrics.progress_bar", "false"])
        out[name] = {"rows": rows, "printed": printed}
    return out


def test_debug_rope_configs_run_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.export import export_checkpoint

    make_tiny_hf_model(tmp_path / "llama", "llama", tokenizer=False, **SHAPE)
    make_tiny_hf_model(tmp_path / "qwen3", "qwen3", tokenizer=False, **SHAPE)
    out = run_ranks(4, _debug_configs_task, str(tmp_path / "llama"), str(tmp_path / "qwen3"),
                    str(tmp_path / "dumps"))[0]
    llama, qwen = out["debug_rope_llama"], out["debug_rope_qwen3_yarn"]
    assert "rope stage 1 (from step 3, seq_len 128): default theta=100000" in llama["printed"]
    assert "rope stage 2 (from step 5, seq_len 256): default theta=1e+06" in llama["printed"]
    assert [(r["seq_len"], r["rope_type"], r["rope_theta"]) for r in llama["rows"]] == [
        (64, "llama3", 1e4)] * 2 + [(128, "default", 1e5)] * 2 + [(256, "default", 1e6)] * 2
    assert ("rope stage 1 (from step 3, seq_len 256): yarn theta=1e+06 factor=4 "
            "original_max_position_embeddings=64") in qwen["printed"]
    assert [(r["rope_type"], r["rope_factor"]) for r in qwen["rows"]] == [("default", None)] * 2 + [("yarn", 4.0)] * 2
    for name, step in (("debug_rope_llama", 6), ("debug_rope_qwen3_yarn", 4)):
        export = export_checkpoint(tmp_path / "dumps" / name / "checkpoint" / f"step-{step}", tmp_path / f"{name}_hf")
        with no_transformers_warnings():
            AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert json.loads((tmp_path / "debug_rope_qwen3_yarn_hf" / "config.json").read_text())[
        "max_position_embeddings"] == 256


# Qwen's published config.json of Qwen3-8B (rope theta 1e6, native 32K, no scaling).
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_shipped_context_extension_configs_validate(tmp_path):
    """The GPU configs validate on 8 ranks with stand-ins of their model directories, and
    their stages get the ropes their comments promise."""
    from safetensors.torch import save_file
    from test_hf_checkpoint import LLAMA31_8B_CONFIG

    from ulysses_dtensor.trainer.config import load_config, model_args, validate_config
    from ulysses_dtensor.trainer.rope_stages import stage_ropes

    described = {}
    for name, source in (("llama3_8b_hf_512k", LLAMA31_8B_CONFIG), ("qwen3_8b_hf_yarn_128k", QWEN3_8B_CONFIG)):
        model_dir = tmp_path / name
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(source))
        save_file({"stand_in": torch.zeros(1)}, str(model_dir / "model-00001-of-00004.safetensors"))
        cfg = load_config(["--config", str(REPO / "train_configs" / f"{name}.toml"), "--model.hf_path", str(model_dir)])
        assert validate_config(cfg, 8).sp == 8
        assert cfg.eval.lengths == [st.seq_len for st in cfg.stages()]  # [eval] at each stage's length
        described[name] = [r.describe() for r in stage_ropes(cfg, model_args(cfg, 0))]
    assert described["llama3_8b_hf_512k"] == [
        "llama3 theta=500000 factor=8 original_max_position_embeddings=8192 low_freq_factor=1 high_freq_factor=4",
        "default theta=8e+06", "default theta=1.28e+08"]
    assert described["qwen3_8b_hf_yarn_128k"] == [
        "default theta=1e+06", "yarn theta=1e+06 factor=4 original_max_position_embeddings=32768"]
