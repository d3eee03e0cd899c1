"""Trainer config: precedence, types, and one clear message per bad value."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ulysses_dtensor.trainer.config import (
    ConfigError,
    JobConfig,
    config_help,
    inactive_settings,
    load_config,
    parse_config,
    validate_config,
)
from ulysses_dtensor.trainer.schedule import Stage

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def one_error(fn, *args, match):
    with pytest.raises(ConfigError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)  # one message, one line
    return str(info.value)


def test_defaults_have_required_keys():
    c = JobConfig()
    for dotted in ("job.dump_folder", "job.seed", "training.steps", "training.seq_len",
                   "parallelism.dp_replicate", "parallelism.dp_shard", "parallelism.sp",
                   "checkpoint.interval", "data.path"):
        section, key = dotted.split(".")
        assert hasattr(getattr(c, section), key)
        assert f"--{dotted} " in config_help()


def test_toml_then_cli_precedence(tmp_path):
    path = write(tmp_path, """
[job]
seed = 7
dump_folder = "from_toml"
[training]
steps = 20
max_norm = 0.5
[optimizer]
lr = 1
betas = [0.8, 0.9]
[context]
schedule = [{start_step = 1, seq_len = 64}, {start_step = 5, seq_len = 128}]
""")
    c = load_config(["--config", path, "--training.steps=30", "--job.seed", "9",
                     "--training.compile", "true", "--metrics.enable_tensorboard"])
    assert c.job.seed == 9 and c.training.steps == 30          # CLI wins
    assert c.job.dump_folder == "from_toml" and c.training.max_norm == 0.5  # TOML wins
    assert c.optimizer.lr == 1.0 and isinstance(c.optimizer.lr, float)
    assert c.optimizer.betas == [0.8, 0.9]
    assert c.training.compile is True and c.metrics.enable_tensorboard is True
    assert c.context.schedule == [Stage(1, 64), Stage(5, 128)]
    assert c.parallelism.sp == 1 and c.checkpoint.interval == 500  # defaults
    c = load_config(["--config", path, "--context.schedule", "1:32,3:64,9:128",
                     "--optimizer.betas", "0.9,0.99", "--training.compile=false"])
    assert c.context.schedule == [Stage(1, 32), Stage(3, 64), Stage(9, 128)]
    assert c.optimizer.betas == [0.9, 0.99] and c.training.compile is False
    # [[context.schedule]] array-of-tables form
    path2 = write(tmp_path, "[[context.schedule]]\nstart_step = 1\nseq_len = 8\n", "d.toml")
    assert load_config(["--config", path2]).context.schedule == [Stage(1, 8)]


def test_unknown_names_suggest_nearest(tmp_path):
    msg = one_error(load_config, ["--training.step", "3"], match=r"unknown config key training.step")
    assert "did you mean 'training.steps'" in msg and "seq_len" in msg
    msg = one_error(parse_config, {"trainig": {"steps": 1}}, match="unknown config section 'trainig'")
    assert "did you mean 'training'" in msg
    one_error(parse_config, {"checkpoint": {"intervall": 3}},
              match=r"checkpoint.intervall.*did you mean 'checkpoint.interval'")
    one_error(load_config, ["--steps", "3"], match=r"--section.key.*did you mean 'training.steps'")
    one_error(load_config, ["stray"], match="unexpected argument 'stray'")
    one_error(load_config, ["--training.steps"], match="--training.steps needs a value")
    one_error(parse_config, {"context": {"schedule": [{"start": 1, "seq_len": 8}]}},
              match=r"unknown key 'start' in context.schedule\[0\].*start_step")


def test_wrong_types():
    one_error(parse_config, {"training": {"steps": "ten"}},
              match=r"training.steps must be an integer, got 'ten'")
    one_error(parse_config, {"training": {"steps": 1.5}}, match="training.steps must be an integer")
    one_error(parse_config, {"training": {"compile": 1}}, match=r"training.compile must be a bool")
    one_error(parse_config, {"parallelism": {"sp": True}}, match="parallelism.sp must be an integer")
    one_error(load_config, ["--training.steps", "1e3"], match=r"--training.steps must be an integer")
    one_error(load_config, ["--training.compile", "maybe"], match="must be a bool")
    one_error(load_config, ["--context.schedule", "1-128"], match=r"start_step:seq_len")
    one_error(parse_config, {"lr_scheduler": {"decay": "cosin"}},
              match=r"lr_scheduler.decay='cosin'.*did you mean 'cosine'.*valid: linear, cosine, none")
    one_error(parse_config, {"model": {"attn_backend": "flash"}},
              match=r"model.attn_backend='flash'.*valid: auto, sdpa, flex, varlen, flash_attn")
    one_error(parse_config, {"training": {"mixed_precision_param": "fp16"}},
              match="valid: float32, bfloat16")
    one_error(parse_config, {"training": {"steps": 0}}, match=r"training.steps=0 must be >= 1")
    one_error(parse_config, {"context": {"schedule": [{"start_step": 2, "seq_len": 8}]}},
              match="must start at step 1")


def test_world_and_mesh():
    c = parse_config({"parallelism": {"sp": 3}})
    msg = one_error(validate_config, c, 4, match=r"world_size=4 is not divisible")
    assert msg.startswith("parallelism:")
    c = parse_config({"parallelism": {"dp_shard": 2, "sp": 4}})
    one_error(validate_config, c, 4, match=r"2\*4 = 8 does not match world_size=4")
    c = parse_config({"parallelism": {"dp_shard": 2, "sp": 2}})
    dims = validate_config(c, 4)
    assert (dims.dp_replicate, dims.dp_shard, dims.sp, dims.dp) == (1, 2, 2, 2)


def test_every_stage_seq_len_multiple_of_sp():
    c = parse_config({"parallelism": {"sp": 4},
                      "context": {"schedule": [{"start_step": 1, "seq_len": 128},
                                               {"start_step": 3, "seq_len": 130}]}})
    one_error(validate_config, c, 4,
              match=r"context.schedule\[1\].seq_len=130 .* not a multiple of parallelism.sp=4")
    c = parse_config({"parallelism": {"sp": 2}, "training": {"seq_len": 63}})
    one_error(validate_config, c, 2, match=r"seq_len=63 .*parallelism.sp=2")


def test_heads_incompatible_with_sp():
    c = parse_config({"parallelism": {"sp": 16}, "training": {"seq_len": 64}})
    one_error(validate_config, c, 16, match=r"model.flavor='debug' with parallelism.sp=16.*heads % sp")
    # 12 q heads, 3 kv heads on sp=4: kv heads can be neither split nor replicated.
    c = parse_config({"parallelism": {"sp": 4},
                      "model": {"dim": 96, "n_heads": 12, "n_kv_heads": 3}})
    one_error(validate_config, c, 4, match=r"kv_heads=3 on sp=4")


def test_batch_not_divisible_by_dp():
    c = parse_config({"training": {"global_batch_size": 6}, "parallelism": {"dp_shard": 4}})
    one_error(validate_config, c, 4, match=r"global batch of 6 sequences.*4 data-parallel streams")
    c = parse_config({"training": {"tokens_per_step": 1024},
                      "context": {"constant_tokens_per_step": True,
                                  "schedule": [{"start_step": 1, "seq_len": 128},
                                               {"start_step": 4, "seq_len": 512}]},
                      "parallelism": {"dp_shard": 4}})
    one_error(validate_config, c, 4, match=r"batch of 2 sequences.*stage from step 4")


def test_missing_files_and_unknown_flavor(tmp_path):
    c = parse_config({"data": {"path": str(tmp_path / "nope.jsonl")}})
    one_error(validate_config, c, 1, match=r"data.path=.*nope.jsonl' does not exist")
    (tmp_path / "x.csv").write_text("a")
    c = parse_config({"data": {"path": str(tmp_path / "x.csv")}})
    one_error(validate_config, c, 1, match=r"suffix '.csv'; valid: .txt, .jsonl")
    c = parse_config({"data": {"tokenizer": str(tmp_path / "tokenizer.json")}})
    one_error(validate_config, c, 1, match=r"data.tokenizer=.*no such file")
    c = parse_config({"model": {"flavor": "llama3_8bb"}})
    one_error(validate_config, c, 1, match=r"model.flavor='llama3_8bb'.*did you mean 'llama3_8b'")
    one_error(load_config, ["--config", str(tmp_path / "missing.toml")], match="no such file")


def test_tokenizers_extra_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    c = parse_config({"data": {"tokenizer": str(tok)}})
    one_error(validate_config, c, 1, match=r"pip install 'ulysses-dtensor\[tokenizers\]'")


def test_shipped_configs_parse():
    for path in sorted((REPO / "train_configs").glob("*.toml")):
        c = load_config(["--config", str(path)])
        if c.model.hf_path:
            continue  # needs its model directory: validated in test_hf_checkpoint.py
        if c.parallelism.sp == "auto":  # fitted to the world: every size from one process to a node
            for world in range(1, 9):
                validate_config(load_config(["--config", str(path)]), world)
            continue
        n = c.parallelism.dp_replicate * max(c.parallelism.dp_shard, 1) * c.parallelism.sp * c.parallelism.tp
        validate_config(c, n)


BAD_CLI = [
    (["--parallelism.sp", "3"], "world_size=1 is not divisible"),
    (["--training.seq_len", "100", "--parallelism.sp", "1", "--data.path", "/no/such/file.txt"],
     "does not exist"),
    (["--trainng.steps", "2"], "did you mean 'training'"),
]


def _bad_cli_argv(tmp_path, args):
    return ["--config", str(REPO / "train_configs" / "debug_model.toml"),
            "--job.dump_folder", str(tmp_path / "dump"), "--checkpoint.enable", "true", *args]


@pytest.mark.parametrize("args, match", BAD_CLI)
def test_bad_config_exits_before_work(tmp_path, capsys, monkeypatch, args, match):
    """The trainer's entry point: exit status 2, one line on stderr, nothing created."""
    from ulysses_dtensor.train import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(_bad_cli_argv(tmp_path, args))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert err.count("config error:") == 1 and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_bad_config_cli_process_exits_before_work(tmp_path):
    """The same through a real `python -m ulysses_dtensor.train` process."""
    args, match = BAD_CLI[0]
    proc = subprocess.run(
        [sys.executable, "-m", "ulysses_dtensor.train", *_bad_cli_argv(tmp_path, args)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr
    assert match in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("config error:") == 1
    assert list(tmp_path.iterdir()) == []


def test_memory_section_parses_and_offload_needs_full_ac():
    from ulysses_dtensor.trainer.config import ConfigError, parse_config

    cfg = parse_config(
        {"memory": {"tiled_mlp": True, "tiled_loss": True, "loss_chunks": 4},
         "activation_checkpoint": {"mode": "full"}},
        [("memory.offload_activations", "true")],
    )
    assert (cfg.memory.tiled_mlp, cfg.memory.loss_chunks, cfg.memory.offload_activations) == (True, 4, True)
    with pytest.raises(ConfigError, match=r"memory.offload_activations=true needs activation_checkpoint.mode='full'"):
        parse_config({"memory": {"offload_activations": True}})
    with pytest.raises(ConfigError, match=r"memory.mlp_tiles=-1 must be >= 0"):
        parse_config({"memory": {"mlp_tiles": -1}})


# --------------------------------------------------------------------------- #
# No setting is silently ignored
# --------------------------------------------------------------------------- #

# key -> (a non-default value, the switch settings that make it take effect)
EFFECT_CASES = {
    "training.seq_len": ("512", []),  # (with no schedule it is the one stage)
    "training.tokens_per_step": ("4096", ["--context.constant_tokens_per_step", "true"]),
    "training.global_batch_size": ("4", []),
    "training.compile_backend": ("aot_eager", ["--training.compile", "true"]),
    "training.pack_qkv": ("true", ["--parallelism.sp", "2"]),
    "activation_checkpoint.selective": ("2", ["--activation_checkpoint.mode", "selective"]),
    "memory.mlp_tiles": ("4", ["--memory.tiled_mlp", "true"]),
    "memory.loss_chunks": ("4", ["--memory.tiled_loss", "true"]),
    "memory.offload_dir": ("/tmp", ["--memory.offload_activations", "true", "--activation_checkpoint.mode", "full"]),
    "float8.recipe_name": ("tensorwise", ["--float8.enable", "true", "--float8.emulate", "true"]),
    "float8.filter_fqns": ("output", ["--float8.enable", "true", "--float8.emulate", "true"]),
    "float8.emulate": ("true", ["--float8.enable", "true"]),
    "float8.enable_fsdp_float8_all_gather": ("true", ["--float8.enable", "true", "--float8.emulate", "true",
                                                      "--float8.recipe_name", "tensorwise"]),
    "checkpoint.folder": ("ckpts", ["--checkpoint.enable", "true"]),
    "checkpoint.interval": ("7", ["--checkpoint.enable", "true"]),
    "checkpoint.keep_latest_k": ("2", ["--checkpoint.enable", "true"]),
    "lr_scheduler.decay": ("cosine", ["--lr_scheduler.warmup_steps", "2"]),
    "lr_scheduler.min_lr_ratio": ("0.1", []),
    "model.vocab_multiple_of": ("128", []),
    "data.max_corpus_mb": ("1", []),
    "data.packing_window": ("128", ["--data.packing", "bfd"]),
    "data.overlong": ("drop", ["--data.packing", "bfd"]),
    **{f"lora.{k}": (v, ["--lora.rank", "8", "--model.hf_path", "hf_model_dir"]) for k, v in (
        ("alpha", "32"), ("dropout", "0.1"), ("target_modules", "q_proj,v_proj"), ("modules_to_save", "norm"))},
    "metrics.exchange_timing": ("false", ["--parallelism.sp", "2"]),
    "eval.depths": ("4", []),
    "eval.samples": ("2", []),
    "eval.seed": ("5", []),
    "eval.loss_rows": ("2", []),
    "eval.data_path": ("held_out.jsonl", []),
    "eval.holdout_fraction": ("0.1", []),
    # Without effect under model.hf_path (its config.json sets them).
    "model.flavor": ("llama3_8b", []),
    "model.vocab_size": ("512", []),
    "model.dim": ("128", []),
    "model.n_layers": ("4", []),
    "model.n_heads": ("4", []),
    "model.n_kv_heads": ("2", []),
    "model.ffn_dim": ("256", []),
    "model.rope_theta": ("10000", []),
    # model.implementation chooses what trains model.hf_path's model.
    "model.implementation": ("transformers", ["--model.hf_path", "hf_model_dir"]),
}
# What turns each off (the defaults already do for the others).
EFFECT_OFF = {
    "training.seq_len": ["--context.schedule", "1:64,3:128"],
    "training.global_batch_size": ["--context.constant_tokens_per_step", "true",
                                   "--training.tokens_per_step", "4096"],
    "lr_scheduler.decay": ["--lr_scheduler.warmup_steps", "10"],
    "lr_scheduler.min_lr_ratio": ["--lr_scheduler.decay", "none"],
    "model.vocab_multiple_of": ["--model.vocab_size", "512"],
    "data.max_corpus_mb": ["--data.path", "corpus.txt"],
    **{f"eval.{k}": ["--eval.tasks", "loss"] for k in ("depths", "samples", "seed")},
    **{f"eval.{k}": ["--eval.tasks", "passkey"] for k in ("loss_rows", "data_path", "holdout_fraction")},
    **{f"model.{k}": ["--model.hf_path", "hf_model_dir"] for k in (
        "flavor", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta")},
}


def test_every_effect_rule_is_tested():
    from ulysses_dtensor.trainer.config_effects import EFFECT_RULES

    assert {r.key for r in EFFECT_RULES} == set(EFFECT_CASES)


@pytest.mark.parametrize("key", sorted(EFFECT_CASES))
def test_a_setting_without_effect_is_an_error_naming_both_keys(key, tmp_path):
    value, switch_on = EFFECT_CASES[key]
    off = EFFECT_OFF.get(key, [])
    base = ["--training.steps", "10"]
    if key == "training.seq_len":  # both on one command line contradict each other
        msg = one_error(load_config, [*base, *off, f"--{key}", value], match="both set the sequence length")
        assert "training.seq_len=512" in msg and "context.schedule=1:64,3:128" in msg
        return
    msg = one_error(load_config, [*base, *off, f"--{key}", value], match="has no effect")
    assert msg.startswith(f"{key}=") and "(from the command line)" in msg
    switches = [a[2:] for a in (off or switch_on) if a.startswith("--")]
    assert any(s in msg for s in switches), msg
    if not off:  # switched on, the same setting is accepted
        c = load_config([*base, *switch_on, f"--{key}", value])
        assert inactive_settings(c) == []


def test_a_later_source_may_switch_a_setting_off(tmp_path):
    """A TOML's checkpoint cadence under --checkpoint.enable false: accepted, listed."""
    path = write(tmp_path, "[checkpoint]\nenable = true\ninterval = 7\n")
    c = load_config(["--config", path, "--checkpoint.enable", "false"])
    assert inactive_settings(c) == [
        "checkpoint.interval=7 (from the TOML file): checkpoint.enable=false (from the command line)"
    ]
    # The other way round is the user's own contradiction.
    path = write(tmp_path, "[checkpoint]\nenable = false\n", "off.toml")
    one_error(load_config, ["--config", path, "--checkpoint.interval", "7"], match="has no effect")


def test_seq_len_versus_schedule_the_later_source_wins(tmp_path):
    debug = str(REPO / "train_configs" / "debug_model.toml")
    # The example: honoured, then checked against sp like any stage.
    c = load_config(["--config", debug, "--training.seq_len", "1001", "--parallelism.sp", "2"])
    assert c.stages() == [Stage(1, 1001)] and inactive_settings(c) == []
    msg = one_error(validate_config, c, 4, match=r"training.seq_len=1001 .*not a multiple of parallelism.sp=2")
    assert "context.schedule" not in msg
    c = load_config(["--config", debug, "--training.seq_len", "512"])
    assert c.stages() == [Stage(1, 512)]
    path = write(tmp_path, "[training]\nseq_len = 256\n")
    c = load_config(["--config", path, "--context.schedule", "1:64,3:128"])
    assert c.stages() == [Stage(1, 64), Stage(3, 128)]
    assert inactive_settings(c) == [
        "training.seq_len=256 (from the TOML file): context.schedule=1:64,3:128 (from the command line)"
    ]
    path = write(tmp_path, "[training]\nseq_len = 256\n[context]\nschedule = [{start_step = 1, seq_len = 64}]\n", "both.toml")
    one_error(load_config, ["--config", path], match=r"training.seq_len=256 \(from the TOML file\) and context.schedule")


def test_settings_that_depend_on_the_world_or_the_data(tmp_path):
    c = parse_config({"training": {"global_batch_size": 8}}, [("training.micro_batch_size", "4")])
    validate_config(c, 1)  # 8 sequences on one rank: 2 passes of 4
    one_error(validate_config, c, 2, match=r"training.micro_batch_size=4 .*no effect.*at most 4 per step")
    txt = tmp_path / "doc.txt"
    txt.write_text("some text")
    c = parse_config({"data": {"path": str(txt), "text_key": "body"}})
    one_error(validate_config, c, 1, match=r"data.text_key='body' \(from the TOML file\) has no effect.*\.jsonl")
    (tmp_path / "more.jsonl").write_text('{"body": "x"}\n')
    validate_config(parse_config({"data": {"path": str(tmp_path), "text_key": "body"}}), 1)


# The default config fitted to the world (trainer/mesh_fit.py): (dp_shard, sp, global batch) per world size
# for the debug model (8 heads, 4 kv heads; stages of 128 and 256 tokens; 8 sequences per data-parallel rank).
FITTED = {1: (1, 1, 8), 2: (1, 2, 8), 3: (3, 1, 24), 4: (1, 4, 8), 5: (5, 1, 40), 6: (3, 2, 24), 7: (7, 1, 56),
          8: (1, 8, 8)}


@pytest.mark.parametrize("world", sorted(FITTED))
def test_default_config_fits_every_world(world, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    c = load_config(["--config", str(REPO / "train_configs" / "debug_model.toml")])
    dims = validate_config(c, world)
    assert (dims.dp_shard, dims.sp, c.training.global_batch_size) == FITTED[world]
    assert c.fitted[0].startswith(f"parallelism.sp=auto -> {dims.sp}: ")
    assert c.fitted[1] == (f"training.global_batch_size -> {FITTED[world][2]}: training.local_batch_size=8 "
                           f"sequences x {dims.dp} data-parallel rank{'s' if dims.dp > 1 else ''}")
    if world == 6:  # what was passed over, and why
        assert "(not 6: 8 heads do not split over 6 ranks; not 3: 8 heads do not split over 3 ranks)" in c.fitted[0]
    assert validate_config(c, world) == dims and len(c.fitted) == 2  # fitted once: nothing left to fit


def test_auto_sp_stays_within_a_node_and_fits_lengths_and_ring(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two nodes of 4: the all-to-all stays on a node
    c = parse_config({"parallelism": {"sp": "auto"}, "model": {"flavor": "debug"}, "training": {"seq_len": 128}})
    dims = validate_config(c, 8)
    assert (dims.dp_shard, dims.sp) == (2, 4) and "within a node of 4 ranks" in c.fitted[0]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    c = parse_config({"parallelism": {"sp": "auto"}, "training": {"seq_len": 100}})  # 100 % 8 != 0
    assert validate_config(c, 8).sp == 4 and "not 8: seq_len 100 is not a multiple of 8" in c.fitted[0]
    c = parse_config({"parallelism": {"sp": "auto", "ring": 2}, "training": {"seq_len": 128}})
    assert validate_config(c, 8).sp == 8  # ring 2 x ulysses 4
    c = parse_config({"parallelism": {"sp": "auto", "ring": 3}, "training": {"seq_len": 128}})
    one_error(validate_config, c, 2, match=r"parallelism.sp=auto: no sequence-parallel degree fits 2 ranks "
                                         r"\(sp=2: parallelism.ring=3 does not divide it; sp=1: .*\); give parallelism.sp")


def test_explicit_sizes_still_refuse_a_world_they_do_not_fit(tmp_path):
    toml = write(tmp_path, "[parallelism]\nsp = 2\n[training]\nlocal_batch_size = 8\n")
    one_error(validate_config, load_config(["--config", toml]), 3,
              match=r"world_size=3 is not divisible by dp_replicate\*sp=1\*2=2.*divisors of 3")
    both = write(tmp_path, "[training]\nlocal_batch_size = 8\nglobal_batch_size = 16\n", "both.toml")
    one_error(load_config, ["--config", both],
              match=r"training.local_batch_size=8 \(from the TOML file\) and training.global_batch_size=16 "
                    r"\(from the TOML file\) both set the batch; give one")
    # The later source wins: a command-line global batch over the TOML's local one (parity runs need it).
    c = load_config(["--config", toml, "--training.global_batch_size", "6"])
    assert validate_config(c, 4).dp == 2 and c.training.global_batch_size == 6
    one_error(parse_config, {"training": {"local_batch_size": 2, "tokens_per_step": 1024}},
              match=r"training.local_batch_size=2 .* with training.tokens_per_step=1024 .*give one")
    one_error(parse_config, {"parallelism": {"sp": "all"}},
              match=r"config key parallelism.sp must be an integer or 'auto', got 'all'")
    one_error(load_config, ["--parallelism.sp", "0"], match=r"parallelism.sp=0 must be >= 1")


def test_float8_section_checks_before_any_work():
    """[float8]: its options become the library's Float8Options; what cannot run is refused by name."""
    from ulysses_dtensor.trainer.float8_config import float8_options

    assert float8_options(parse_config({})) is None
    on = parse_config({"float8": {"enable": True, "emulate": True, "recipe_name": "tensorwise",
                                  "enable_fsdp_float8_all_gather": True}})
    opts = float8_options(on)
    assert (opts.recipe_name, opts.emulate, opts.enable_fsdp_float8_all_gather) == ("tensorwise", True, True)
    assert opts.filter_fqns == ("output", "lm_head", "gate", "router")
    one_error(parse_config, {"float8": {"enable": True, "recipe_name": "blockwise"}},
              match=r"float8.recipe_name='blockwise' is not valid.*; valid: rowwise, rowwise_with_gw_hp, tensorwise")
    bad = parse_config({"float8": {"enable": True, "enable_fsdp_float8_all_gather": True}})
    one_error(validate_config, bad, 1, match=r"float8.enable_fsdp_float8_all_gather=true needs recipe_name="
                                             r"'tensorwise'")
    tp = parse_config({"float8": {"enable": True, "emulate": True}, "parallelism": {"tp": 2}})
    one_error(validate_config, tp, 2, match=r"float8.enable=true with parallelism.tp=2: .*float8.enable=false")
