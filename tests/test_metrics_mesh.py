"""No figure depends on the mesh unless its name says so.

One small job (3 steps of 4 x 64 tokens from a warm-up lr, then the held-out
loss by position and the passkey task at step 3, the built-in corpus with 5%
held out) runs on one process and on four gloo ranks as dp_shard 2 x sp 2,
ring 2 x ulysses 2 and dp_replicate 2 x sp 2. Every field of ``metrics.jsonl``
and ``eval.jsonl`` is classified, from the rows themselves (a new field fails
the test until it is classified):

* invariant: equal on every mesh (exactly for counts, within fp32 noise for
  losses and norms);
* per device: named ``*_per_device`` / ``*_per_rank`` and named in docs/metrics.md;
* timing (wall clock) and the mesh description: not compared.

The logged throughput is checked against its formula on every mesh: ``tps x
step_time`` is the step's global tokens, ``tps_per_device`` is ``tps`` over the
world size, and ``mfu`` is ``tps_per_device x flops_per_token(seq_len) /
peak_flops``. ``test_throughput_formula`` checks the same figures on a synthetic
step time.

To check another model kind, add its arguments to ``MODELS``. The transformers
kind (``model.implementation = "transformers"``: a tiny Qwen3-MoE with its router
load-balancing loss on) runs on one process and dp_shard 2 x sp 2 (ring meshes are
refused for it); its first step's loss (with ``router_aux_loss_coef x`` the aux
loss), ``router_aux_loss`` and gradient norm also equal transformers' own
unsharded model on the same global batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from distributed import run_ranks

from ulysses_dtensor.trainer.config import load_config

REPO = Path(__file__).resolve().parents[1]
STEPS, SEQ, BATCH, EVAL_LENGTH = 3, 64, 4, 224  # passkey needs 211 byte tokens
PEAK_FLOPS = 1e12

# model kind -> trainer arguments ({hf}: the kind's model directory, made by _model_dir)
MODELS = {
    "llama": ["--model.flavor", "debug"],
    "transformers": ["--model.hf_path", "{hf}", "--model.implementation", "transformers"],
}
# model kind -> the meshes it runs on (default: every mesh)
MODEL_MESHES = {"transformers": ("dp2 x sp2",)}
# name -> (dp_replicate, dp_shard, sp, ring)
MESHES = {
    "dp2 x sp2": (1, 2, 2, 1),
    "ring2 x ulysses2": (1, 1, 4, 2),
    "dp_replicate2 x sp2": (2, 1, 2, 1),
}
REFERENCE = "1 process"

INVARIANT, PER_DEVICE, TIMING, MESH = "invariant", "per device", "timing", "mesh"
METRIC_FIELDS = {
    **dict.fromkeys(("step", "seq_len", "batch_size", "loss", "grad_norm", "lr", "tokens_seen",
                     "rope_type", "rope_theta", "rope_factor", "router_aux_loss"), INVARIANT),
    **dict.fromkeys(("tps_per_device", "peak_memory_gib_per_device"), PER_DEVICE),
    **dict.fromkeys(("tps", "mfu", "step_time", "time", "exchange_ms", "exchange_fwd_ms", "exchange_bwd_ms",
                     "exchange_share", "data_wait_ms"), TIMING),
}
EVAL_FIELDS = {
    **dict.fromkeys(("kind", "step", "lengths", "tasks", "length", "rows", "tokens", "loss", "start", "end",
                     "task", "depth", "samples", "accuracy", "mean_logprob", "correct", "needle_index",
                     "answer", "answer_tokens"), INVARIANT),
    "forward_passes_per_rank": PER_DEVICE,
    **dict.fromkeys(("seconds", "train_step_seconds", "train_steps_equivalent"), TIMING),
    "mesh": MESH,
}
FP32 = dict(rel=2e-5, abs=1e-6)


def _model_dir(model: str, root: Path) -> Path | None:
    """The model directory of a transformers kind (a tiny Qwen3-MoE with output_router_logits)."""
    if model != "transformers":
        return None
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_hf_model import make_tiny_hf_model

    hf = root / "hf"
    make_tiny_hf_model(hf, "qwen3_moe", tokenizer=False, seed=3, perturb=0.1, vocab_size=320, dim=64, layers=2,
                       heads=8, kv_heads=4, ffn_dim=96, init_std=0.08)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "output_router_logits": True, "router_aux_loss_coef": 0.1}))
    return hf


def _args(dump: Path, model: str, mesh: tuple[int, int, int, int], hf: Path | None = None) -> list[str]:
    rep, shard, sp, ring = mesh
    return [
        "--config", str(REPO / "train_configs" / "debug_model.toml"),
        *[str(hf) if a == "{hf}" else a for a in MODELS[model]],
        "--job.dump_folder", str(dump),
        "--training.steps", str(STEPS), "--training.seq_len", str(SEQ),
        "--training.global_batch_size", str(BATCH),
        "--lr_scheduler.warmup_steps", "2",
        "--checkpoint.enable", "false",
        "--metrics.log_freq", "1", "--metrics.peak_flops", str(PEAK_FLOPS),
        "--parallelism.dp_replicate", str(rep), "--parallelism.dp_shard", str(shard),
        "--parallelism.sp", str(sp), "--parallelism.ring", str(ring),
        "--eval.interval", str(STEPS), "--eval.lengths", str(EVAL_LENGTH), "--eval.tasks", "loss,passkey",
        "--eval.depths", "2", "--eval.loss_rows", "2", "--eval.holdout_fraction", "0.05",
    ]


def _train_jobs(rank: int, world: int, jobs: list) -> None:
    from ulysses_dtensor.trainer.loop import train

    for argv in jobs:
        train(load_config(argv))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module", params=list(MODELS))
def runs(request, tmp_path_factory):
    """{mesh name: (metric rows, eval rows, world size, argv)} of one model kind."""
    model = request.param
    root = tmp_path_factory.mktemp(f"metrics-{model}")
    hf = _model_dir(model, root)
    meshes = MODEL_MESHES.get(model, tuple(MESHES))
    argv = {REFERENCE: _args(root / "ref", model, (1, 1, 1, 1), hf)}
    argv.update({name: _args(root / f"m{i}", model, MESHES[name], hf) for i, name in enumerate(meshes)})
    _train_jobs(0, 1, [argv[REFERENCE]])  # a world of one, as `python -m ulysses_dtensor.train` runs
    run_ranks(4, _train_jobs, [argv[name] for name in meshes])
    out = {}
    for name, args in argv.items():
        dump = Path(args[args.index("--job.dump_folder") + 1])
        world = 1 if name == REFERENCE else math.prod(MESHES[name][:3])
        out[name] = (_rows(dump / "metrics.jsonl"), _rows(dump / "eval" / "eval.jsonl"), world, args)
    return model, out


def _classify(rows: list[dict], classes: dict[str, str], where: str) -> dict[str, str]:
    unknown = sorted({key for row in rows for key in row} - set(classes))
    assert not unknown, (
        f"{where} has fields {unknown} that this test does not classify: add each to "
        f"{'METRIC_FIELDS' if where == 'metrics.jsonl' else 'EVAL_FIELDS'} as invariant (same on every "
        f"mesh), per device (name it *_per_device / *_per_rank) or timing"
    )
    return {key: classes[key] for row in rows for key in row}


def _difference(a, b) -> float:
    """0 for equal values; the absolute difference of two floats; inf for any other mismatch."""
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return 0.0 if a is b else math.inf
        if a == pytest.approx(b, **FP32):
            return abs(a - b)
        return math.inf
    return 0.0 if a == b else math.inf


def _compare(name: str, rows: list[dict], ref: list[dict], classes: dict, worst: dict, prefix: str = "") -> None:
    assert [r.get("kind") for r in rows] == [r.get("kind") for r in ref], name
    for row, expected in zip(rows, ref):
        keys = {k for k in row if classes[k] == INVARIANT}
        assert keys == {k for k in expected if classes[k] == INVARIANT}, (name, row, expected)
        for key in keys:
            diff = _difference(row[key], expected[key])
            assert diff != math.inf, (
                f"{name}: {key} = {row[key]!r}, on one process {expected[key]!r} (row {expected})")
            worst[prefix + key] = max(worst.get(prefix + key, 0.0), diff)


def test_every_invariant_figure_equals_one_process(runs):
    model, out = runs
    ref_metrics, ref_eval, _, _ = out[REFERENCE]
    assert [r["step"] for r in ref_metrics] == list(range(1, STEPS + 1))
    metric_classes = _classify([r for m, *_ in out.values() for r in m], METRIC_FIELDS, "metrics.jsonl")
    eval_classes = _classify([r for _, e, *_ in out.values() for r in e], EVAL_FIELDS, "eval.jsonl")
    # The features the comparison must see: an lr that changes, losses and a passkey grid.
    assert len({r["lr"] for r in ref_metrics}) == STEPS
    assert {r["kind"] for r in ref_eval} == {"position_loss", "loss", "retrieval", "retrieval_mean", "eval"}

    table = []
    for name in [m for m in MESHES if m in out]:
        metrics, evals, _, _ = out[name]
        worst: dict[str, float] = {}
        _compare(name, metrics, ref_metrics, metric_classes, worst)
        _compare(name, evals, ref_eval, eval_classes, worst, prefix="eval.")
        # each run ran on the mesh it was asked for
        (summary,) = [r for r in evals if r["kind"] == "eval"]
        rep, shard, sp, ring = MESHES[name]
        assert summary["mesh"] == {"dp_replicate": rep, "dp_shard": shard, "sp": sp, "ring": ring}, name
        table.append((name, worst))
    print(f"\nmodel {model}: max |difference| to one process, per invariant field")
    for name, worst in table:
        print(f"  {name:>20}: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))
    # Every invariant field was compared on every mesh.
    invariant = {k for k, c in metric_classes.items() if c == INVARIANT}
    invariant |= {"eval." + k for k, c in eval_classes.items() if c == INVARIANT}
    for name, worst in table:
        assert set(worst) == invariant, (name, invariant - set(worst))


def test_per_device_figures_are_labelled(runs):
    _, out = runs
    page = (REPO / "docs" / "metrics.md").read_text()
    rows = [r for m, e, *_ in out.values() for r in m + e]
    per_device = sorted({k for r in rows for k in r if {**METRIC_FIELDS, **EVAL_FIELDS}.get(k) == PER_DEVICE})
    assert per_device == ["forward_passes_per_rank", "peak_memory_gib_per_device", "tps_per_device"]
    for key in per_device:
        assert key.endswith(("_per_device", "_per_rank")), key
        assert f"`{key}`" in page, f"docs/metrics.md does not name the per-device field {key}"


def test_throughput_follows_the_formula_on_every_mesh(runs):
    """tps from the global tokens of the step; per device over the world size; MFU from it."""
    import torch

    from ulysses_dtensor.data import build_tokenizer
    from ulysses_dtensor.models.llama import Llama
    from ulysses_dtensor.trainer.build import resolve_vocab_size
    from ulysses_dtensor.trainer.config import model_args

    model, out = runs
    for name, (metrics, _, world, argv) in out.items():
        cfg = load_config(argv)
        vocab = resolve_vocab_size(cfg, build_tokenizer(cfg.data.tokenizer).vocab_size)
        if model == "transformers":  # the adapter's count, on the meta model
            from ulysses_dtensor.integrations.hf.causal_lm import adapt_causal_lm
            from ulysses_dtensor.trainer.hf_model import _hf_config, _meta_model

            flops = adapt_causal_lm(_meta_model(_hf_config(cfg))).flops_per_token
        else:
            with torch.device("meta"):
                flops = Llama(model_args(cfg, vocab)).flops_per_token
        for r in metrics:
            assert r["tps"] * r["step_time"] == pytest.approx(r["batch_size"] * r["seq_len"], rel=1e-12), name
            assert r["tps_per_device"] == pytest.approx(r["tps"] / world, rel=1e-12), name
            assert r["mfu"] == pytest.approx(r["tps_per_device"] * flops(r["seq_len"]) / PEAK_FLOPS, rel=1e-12)
            assert r["peak_memory_gib_per_device"] > 0


@pytest.mark.parametrize("runs", ["transformers"], indirect=True)
def test_transformers_first_step_equals_transformers_unsharded(runs):
    """Loss with the router aux loss, the aux loss and the gradient norm of step 1 on every
    mesh equal transformers' own unsharded model on the same global batch."""
    import torch
    from test_hf_trainer_families import reference
    from transformers import AutoModelForCausalLM

    _, out = runs
    argv = out[REFERENCE][3]
    hf = argv[argv.index("--model.hf_path") + 1]
    torch.manual_seed(0)
    ref = reference(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).train(), argv, router=True, steps=1)[0]
    for name, (metrics, *_) in out.items():
        row = metrics[0]
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5), (name, row["loss"], ref)
        assert row["router_aux_loss"] == pytest.approx(ref["router_aux_loss"], rel=1e-5), (name, row, ref)
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (name, row["grad_norm"], ref)
    print(f"\ntransformers kind, step 1 vs transformers unsharded: loss {ref['loss']:.6f} "
          f"(router aux {ref['router_aux_loss']:.6f}), grad norm {ref['grad_norm']:.6f}")


def test_throughput_formula(tmp_path):
    """tps = global tokens / step time, tps_per_device = tps / world, mfu = that x FLOPs per token / peak."""
    import torch

    from ulysses_dtensor.trainer.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, rank=0, world_size=8, total_steps=2, device=torch.device("cpu"),
                           flops_per_token=lambda seq: 6_000_000 + 1_000 * seq, peak_flops=1e12,
                           show_progress=False)
    # 4 sequences of 1024 tokens in 0.5 s on 8 devices
    row = logger.log(step=1, seq_len=1024, batch_size=4, loss=2.0, grad_norm=1.0, lr=1e-3,
                     tokens_seen=4096, step_tokens=4 * 1024, step_time=0.5)
    assert row["tps"] == 8192.0
    assert row["tps_per_device"] == 1024.0
    assert row["mfu"] == pytest.approx(1024.0 * (6_000_000 + 1_024_000) / 1e12, rel=1e-15)  # 0.00719258
    assert row["mfu"] == pytest.approx(0.007192576, rel=1e-9)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["tps_per_device"] == 1024.0
    # No known peak (CPU) and no metrics.peak_flops: MFU is null, tokens/s still exact.
    plain = MetricsLogger(tmp_path / "b", rank=0, world_size=2, total_steps=1, device=torch.device("cpu"),
                          flops_per_token=lambda seq: 1, show_progress=False)
    row = plain.log(step=1, seq_len=8, batch_size=2, loss=0.0, grad_norm=0.0, lr=0.0, tokens_seen=16,
                    step_tokens=16, step_time=0.25)
    assert (row["tps"], row["tps_per_device"], row["mfu"]) == (64.0, 32.0, None)
