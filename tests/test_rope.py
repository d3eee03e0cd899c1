"""Every rope type transformers computes, against transformers itself (no download).

* inverse frequencies, attention scaling and cos/sin of ``default``, ``linear``,
  ``dynamic``, ``yarn`` (also with mscale / beta / truncate), ``llama3`` and
  ``longrope`` equal transformers' ``ROPE_INIT_FUNCTIONS`` and rotary module at
  lengths below and above the original length;
* logits of tiny Llama, Qwen2, Qwen3 and Mistral models with each rope type,
  imported from their config.json, equal transformers' model (fp32, <= 1e-5
  relative) on plain rows, rows shorter than the original length, and packed
  documents (transformers' packed-batch rule for the length-dependent types);
* under sp 4 the length of ``dynamic`` / ``longrope`` is the whole sequence's,
  not a rank's slice; the trainer's length is the global batch's;
* ``set_rope`` changes the model's logits and nothing else;
* export of every rope type: ``from_pretrained`` with warnings as errors gives
  our logits, with the ``max_position_embeddings`` each type needs;
* bad stage rope tables: one ConfigError naming the stage's key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from transformers_strict import no_transformers_warnings

from ulysses_dtensor.models.llama import Llama
from ulysses_dtensor.models.llama_checkpoint import args_from_hf_config, hf_names
from ulysses_dtensor.models.rope import ROPE_TYPES, RopeConfig
from ulysses_dtensor.parallel.batch import shard_batch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_hf_model import FAMILIES, hf_config, hf_model  # noqa: E402

VOCAB, SEQ, SHORT, ORIG = 320, 24, 12, 16
REL_TOL = 1e-5
SHAPE = dict(vocab_size=VOCAB, dim=64, layers=2, heads=8, kv_heads=4, ffn_dim=96, init_std=0.08)


def rope_case(kind: str, head_dim: int) -> tuple[dict, int]:
    """(transformers rope_parameters, max_position_embeddings) of a test rope of ``kind``.

    A small base (100) so every frequency turns within a few dozen positions, and an
    original length of 16 so that 24-token rows are beyond it and 12-token rows within.
    """
    half = head_dim // 2
    table = {
        "default": {},
        "linear": {"factor": 4.0},
        "dynamic": {"factor": 4.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIG, "beta_fast": 4.0, "beta_slow": 0.5},
        "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": ORIG},
        "longrope": {"short_factor": [1.0 + 0.2 * i for i in range(half)],
                     "long_factor": [2.0 + 0.5 * i for i in range(half)],
                     "original_max_position_embeddings": ORIG, "factor": 4.0},
    }[kind]
    # dynamic reads its original length from max_position_embeddings; yarn wants factor x original.
    max_pos = {"dynamic": ORIG, "yarn": 4 * ORIG}.get(kind, 64)
    return {"rope_type": kind, "rope_theta": 100.0, **table}, max_pos


def with_rope(config, rope_parameters: dict, max_pos: int):
    """The transformers config ``config`` with another rope (validated by transformers)."""
    return type(config)(**{**config.to_dict(), "rope_parameters": dict(rope_parameters),
                           "max_position_embeddings": max_pos})


def config_json(hf) -> dict:
    """What ``save_pretrained`` writes to config.json for ``hf``."""
    config = json.loads(hf.config.to_json_string())
    config["architectures"] = [type(hf).__name__]  # save_pretrained sets it
    return config


def ours_from_hf(hf) -> Llama:
    """Our model from the HF model's config.json text and its weights (in memory)."""
    args = args_from_hf_config(config_json(hf))
    model = Llama(args)
    state = hf.state_dict()
    missing, unexpected = model.load_state_dict({n: state[h] for n, h in hf_names(args).items()}, strict=False)
    assert set(missing) <= {"output.weight"} and not unexpected  # tied output
    return model.eval()


def rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def packed_batch(seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    pos = torch.stack([torch.arange(seq), torch.cat([torch.arange(9), torch.arange(seq - 9)])])
    return {"input_ids": ids, "position_ids": pos}


# ---------------------------------------------------------------------------
# Frequencies, scaling, cos/sin
# ---------------------------------------------------------------------------

EXTRA_CASES = {  # yarn's other knobs
    "yarn mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": ORIG,
                    "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False},
    "yarn attention_factor": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                              "original_max_position_embeddings": ORIG, "attention_factor": 1.3},
}


def test_frequencies_scaling_and_cos_sin_equal_transformers_for_every_type():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from ulysses_dtensor.models.llama_checkpoint import rope_from_hf_config

    head_dim = 16
    cases = {k: rope_case(k, head_dim) for k in ROPE_TYPES}
    cases.update({k: (v, int(v["factor"]) * ORIG) for k, v in EXTRA_CASES.items()})
    default = RopeConfig(theta=100.0).inv_freq(head_dim)
    for name, (table, max_pos) in cases.items():
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=max_pos, rope_parameters=dict(table))
        rope = rope_from_hf_config(config.to_dict(), head_dim=head_dim)
        for length in (SHORT, SEQ):
            theirs = LlamaRotaryEmbedding(config)  # fresh: transformers caches dynamic lengths
            pos = torch.arange(length)[None]
            cos_t, sin_t = theirs(torch.zeros(1, dtype=torch.float32), pos)
            inv = rope.inv_freq(head_dim, length)
            cos, sin = (torch.cat([t, t], -1) for t in _cos_sin(pos, inv, rope.attention_scaling))
            assert rel(inv, theirs.inv_freq.double()) < 1e-6, (name, length)
            assert rope.attention_scaling == pytest.approx(theirs.attention_scaling, rel=1e-12), name
            # transformers forms the angles in float32 (~1e-6 off at these positions).
            assert rel(cos, cos_t) < REL_TOL and rel(sin, sin_t) < REL_TOL, (name, length)
        if name != "default":  # the type changes the frequencies (beyond the original length)
            assert rel(rope.inv_freq(head_dim, SEQ), default) > 1e-2 or rope.attention_scaling != 1, name
    # The length-dependent types: within the original length dynamic is the default rope,
    # longrope uses its short factors; beyond it they differ.
    dyn = rope_from_hf_config(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=ORIG,
                                          rope_parameters=dict(cases["dynamic"][0])).to_dict())
    assert torch.equal(dyn.inv_freq(16, SHORT), default) and not torch.equal(dyn.inv_freq(16, SEQ), default)


def _cos_sin(pos, inv, scaling):
    from ulysses_dtensor.models.rope import rope_cos_sin

    return rope_cos_sin(pos, inv, scaling)


# ---------------------------------------------------------------------------
# Logits of imported models, every family x every rope type
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_models():
    return {f: hf_model(hf_config(f, **SHAPE), seed=i, perturb=0.1) for i, f in enumerate(FAMILIES)}


def test_logits_match_transformers_for_every_rope_type_and_family(base_models):
    from transformers import AutoModelForCausalLM

    plain = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    short = plain[:, :SHORT]
    batch = packed_batch()
    figures = {}
    for family, base in base_models.items():
        head_dim = getattr(base.config, "head_dim", None) or SHAPE["dim"] // SHAPE["heads"]
        for kind in ROPE_TYPES:
            table, max_pos = rope_case(kind, head_dim)
            config = with_rope(base.config, table, max_pos)
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            hf.load_state_dict(base.state_dict())
            ours = ours_from_hf(hf)
            assert ours.rope.rope_type == kind
            sb = shard_batch(batch)
            with torch.no_grad():
                # transformers keeps the longest length seen for dynamic: short rows first.
                diffs = [rel(ours(short), hf(short).logits), rel(ours(plain), hf(plain).logits),
                         rel(ours(sb["input_ids"], sb["position_ids"], sb["document_ids"]),
                             # No cache: transformers then masks the packed documents apart.
                             hf(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits)]
                figures[f"{family} {kind}"] = max(diffs)
                assert max(diffs) < REL_TOL, (family, kind, diffs)
                if kind != "default":  # the rope type matters at these lengths
                    ours.set_rope(RopeConfig(theta=100.0))
                    assert rel(ours(plain), hf(plain).logits) > 1e-3, (family, kind)
    worst = max(figures.values())
    print(f"logits max|diff| / max|ref| over families x rope types: worst {worst:.1e}; "
          + ", ".join(f"{k} {v:.1e}" for k, v in figures.items()))


# ---------------------------------------------------------------------------
# Sequence parallelism: the length is the whole sequence's
# ---------------------------------------------------------------------------


def _sp_length_task(rank, world, config: dict, state: dict) -> dict:
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.parallel.mesh import ParallelDims
    from ulysses_dtensor.trainer.rope_stages import global_rope_length

    args = args_from_hf_config(config)
    reference = Llama(args)
    reference.load_state_dict(state, strict=False)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(ids)
    pmesh = ParallelDims(sp=world, dp_shard=1).build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(args)
    parallelize_llama(model, pmesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(_shard_of(p, reference.get_parameter(name)))
    local = shard_batch({"input_ids": ids}, pmesh.sp)
    n = SEQ // world
    with torch.no_grad():
        got = model(local["input_ids"], local["position_ids"])
        # What this rank alone would compute from its slice's length.
        model.rope_seq_len = int(local["position_ids"].max()) + 1
        alone = model(local["input_ids"], local["position_ids"])
        model.rope_seq_len = None
    mine = want[:, rank * n:(rank + 1) * n]
    # The trainer's length: every rank's share of the global batch, whatever the mesh.
    pos = torch.arange(5 + 7 * rank)[None]
    return {"diff": rel(got, mine), "alone": rel(alone, mine), "global": global_rope_length(pos, pmesh.loss)}


def _shard_of(param, full):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    for d, (k, o) in enumerate(zip(shape, offset)):
        full = full.narrow(d, o, k)
    return full


def test_length_dependent_ropes_under_sp_use_the_whole_sequence(base_models):
    base = base_models["llama"]
    out = {}
    for kind in ("longrope", "dynamic"):
        table, max_pos = rope_case(kind, SHAPE["dim"] // SHAPE["heads"])
        config = {**json.loads(with_rope(base.config, table, max_pos).to_json_string()),
                  "architectures": [type(base).__name__]}
        args = args_from_hf_config(config)
        state = {n: base.state_dict()[h] for n, h in hf_names(args).items()}
        results = run_ranks(4, _sp_length_task, config, state)
        for rank, r in enumerate(results):
            assert r["diff"] < REL_TOL, (kind, rank, r)
            assert r["global"] == 5 + 7 * 3, r  # 1 + the largest position of every rank
        # Rank 0 holds positions 0..5, within the original 16: alone it would pick other frequencies.
        assert results[0]["alone"] > 1e-3, (kind, results[0])
        out[kind] = max(r["diff"] for r in results)
    print(f"sp 4 vs one process, logits rel diff: {out}")


# ---------------------------------------------------------------------------
# Export of every rope type: from_pretrained without a warning gives our logits
# ---------------------------------------------------------------------------


def test_export_every_rope_type_loads_without_warnings(base_models, tmp_path):
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.export import export_checkpoint
    from ulysses_dtensor.trainer.checkpoint import CheckpointManager

    base = base_models["qwen2"]
    source = config_json(base)
    ours = ours_from_hf(base)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    # The source's max_position_embeddings (4096) is larger than the 48 tokens trained;
    # yarn needs factor x original, dynamic its own original length.
    expected = {"default": 4096, "linear": 4096, "dynamic": ORIG, "yarn": 4 * ORIG, "llama3": 4096,
                "longrope": 4096}
    for kind in ROPE_TYPES:
        table, max_pos = rope_case(kind, ours.args.head_dim)
        rope = RopeConfig.from_parameters(table, head_dim=ours.args.head_dim, max_position_embeddings=max_pos)
        ours.set_rope(rope)
        with torch.no_grad():
            want = ours(ids)
        info = {"args": dataclasses.asdict(ours.args), "hf_config": source, "hf_path": None,
                "tokenizer": "byte", "max_seq_len": 48, "rope": rope.to_dict()}
        opt = torch.optim.SGD(ours.parameters(), lr=0.0)
        ckpt = CheckpointManager(tmp_path / kind / "ckpt", interval=1).save(1, ours, opt, {"step": 1}, model_info=info)
        out = export_checkpoint(ckpt, tmp_path / kind / "hf")
        config = json.loads((out / "config.json").read_text())
        assert config["max_position_embeddings"] == expected[kind], kind
        with no_transformers_warnings():
            hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            assert rel(hf(ids).logits, want) < REL_TOL, kind
        assert hf.config.rope_parameters["rope_type"] == kind
    # The check can fail: llama3 with max_position_embeddings not above its original length
    # is what transformers warns about (through its logger), and what the export avoids.
    bad = tmp_path / "llama3" / "hf"
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "max_position_embeddings": ORIG}))
    with pytest.raises(AssertionError, match="original_max_position_embeddings field must be less than"):
        with no_transformers_warnings():
            AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32)
    # Our own flavor (no source config), trained at 256 tokens, within its llama3 rope's
    # original 8192 (issue: the export wrote 8192 and transformers warned on every load).
    from ulysses_dtensor.models.llama import llama_args
    from ulysses_dtensor.models.llama_checkpoint import hf_config_from_args

    own = Llama(llama_args("debug", vocab_size=VOCAB))
    own.init_weights(seed=3)
    info = {"args": dataclasses.asdict(own.args), "hf_config": None, "hf_path": None, "tokenizer": "byte",
            "max_seq_len": 256, "rope": own.rope.to_dict()}
    ckpt = CheckpointManager(tmp_path / "own" / "ckpt", interval=1).save(
        1, own, torch.optim.SGD(own.parameters(), lr=0.0), {"step": 1}, model_info=info)
    out = export_checkpoint(ckpt, tmp_path / "own" / "hf")
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 8 * 8192
    with no_transformers_warnings():
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(hf(ids).logits, own(ids)) < REL_TOL

    # Trained within the original 16: llama3 needs more than that (factor x original).
    expected = {"default": 12, "linear": 12, "dynamic": ORIG, "yarn": 4 * ORIG, "llama3": 8 * ORIG, "longrope": 12}
    for kind in ROPE_TYPES:
        table, max_pos = rope_case(kind, ours.args.head_dim)
        rope = RopeConfig.from_parameters(table, max_position_embeddings=max_pos)
        config = hf_config_from_args(ours.args, rope=rope, trained_len=12)
        assert config["max_position_embeddings"] == expected[kind], kind


# ---------------------------------------------------------------------------
# Stage ropes: resolution and bad tables
# ---------------------------------------------------------------------------


def _stage_error(schedule: list[dict]) -> str:
    from ulysses_dtensor.trainer.config import (
        ConfigError,
        parse_config,
        validate_config,
    )

    cfg = parse_config({"model": {"flavor": "debug"}, "context": {"schedule": schedule}})
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, 1)
    return str(e.value)


def test_bad_stage_rope_is_one_error_naming_the_stage_and_key():
    from ulysses_dtensor.trainer.config import ConfigError, parse_config

    def stage(**rope):
        return [{"start_step": 1, "seq_len": 64}, {"start_step": 3, "seq_len": 128, **rope}]

    cases = [
        (stage(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
         "context.schedule[1].rope_scaling of rope_type 'yarn' lacks original_max_position_embeddings; "
         "it needs factor, original_max_position_embeddings"),
        (stage(rope_scaling={"rope_type": "ntk", "factor": 4.0}),
         "context.schedule[1].rope_scaling.rope_type is 'ntk'; valid: default, linear, dynamic, yarn, llama3, "
         "longrope"),
        (stage(rope_scaling={"rope_type": "linear", "factor": 4.0, "low_freq_factor": 1.0}),
         "context.schedule[1].rope_scaling.low_freq_factor is not a parameter of rope_type 'linear'; valid: "
         "rope_type, rope_theta, factor"),
        (stage(rope_scaling={"rope_type": "linear", "factor": 0.5}),
         "context.schedule[1].rope_scaling.factor=0.5 must be >= 1"),
        (stage(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
         "context.schedule[1].rope_scaling of rope_type 'dynamic' lacks original_max_position_embeddings"),
        (stage(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3,
                             "original_max_position_embeddings": 64, "factor": 4.0}),
         "context.schedule[1].rope_scaling.short_factor has 3 entries; this model's head_dim 8 needs 4"),
        (stage(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5}),
         "context.schedule[1].rope_scaling.partial_rotary_factor=0.5: this model rotates the whole head"),
        (stage(rope_theta=1e5, rope_scaling={"rope_type": "default", "rope_theta": 1e6}),
         "context.schedule[1].rope_theta=100000 and context.schedule[1].rope_scaling.rope_theta=1000000.0 "
         "disagree"),
    ]
    for schedule, message in cases:
        got = _stage_error(schedule)
        assert message in got, (message, got)
    with pytest.raises(ConfigError, match=r"context\.schedule\[1\]\.rope_theta=-1 must be > 0"):
        parse_config({"context": {"schedule": stage(rope_theta=-1.0)}})
    with pytest.raises(ConfigError, match=r"unknown key 'rope_scale' in context\.schedule\[1\]"):
        parse_config({"context": {"schedule": stage(rope_scale={"rope_type": "linear"})}})


def test_stage_ropes_resolve_in_order_from_the_models_own():
    from ulysses_dtensor.trainer.config import ConfigError, model_args, parse_config
    from ulysses_dtensor.trainer.rope_stages import stage_ropes

    cfg = parse_config({"model": {"flavor": "debug"}, "context": {"schedule": [
        {"start_step": 1, "seq_len": 64},
        {"start_step": 2, "seq_len": 64, "rope_theta": 1e6},  # keeps llama3, new base
        {"start_step": 3, "seq_len": 128, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 64}},
        {"start_step": 4, "seq_len": 128},  # keeps yarn with base 1e6
    ]}})
    args = model_args(cfg, 256)
    ropes = stage_ropes(cfg, args)
    assert ropes[0] == args.rope and ropes[0].rope_type == "llama3"
    assert ropes[1] == args.rope.with_theta(1e6)
    assert ropes[2] == ropes[3] == RopeConfig(rope_type="yarn", theta=1e6, factor=4.0,
                                              original_max_position_embeddings=64)
    # An implementation that computes fewer types names the stage and what it can take.
    with pytest.raises(ConfigError, match=r"rope_type of context\.schedule\[0\] \(kept from the model\)='llama3' "
                                          r"cannot be used by family X; valid: default, yarn"):
        stage_ropes(cfg, args, rope_types=("default", "yarn"), family="family X")
    with pytest.raises(ConfigError, match=r"context\.schedule\[2\]\.rope_scaling\.rope_type='yarn' cannot be "
                                          r"used by family X; valid: default, llama3"):
        stage_ropes(cfg, args, rope_types=("default", "llama3"), family="family X")


def test_checkpoints_saved_before_llamaargs_rope_still_export():
    """model.json of older checkpoints has the llama3-only fields; they map onto RopeConfig."""
    from ulysses_dtensor.models.llama import FLAVORS, LlamaArgs

    new = dataclasses.asdict(FLAVORS["debug"])
    old = {k: v for k, v in new.items() if k != "rope"}
    old.update(rope_theta=500000.0, rope_scaling=True, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_max_len=8192)
    assert LlamaArgs.from_dict(old) == LlamaArgs.from_dict(new) == FLAVORS["debug"]
    plain = LlamaArgs.from_dict({**old, "rope_scaling": False, "rope_theta": 1e4})
    assert plain.rope == RopeConfig(theta=1e4)
