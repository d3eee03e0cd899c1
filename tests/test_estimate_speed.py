"""The planner's fast path: edge pieces, the solved-for search, the host ceiling.

Both halves of issue 42: the fast answer is the full-trace answer (within the
stated precision, here where both run), and what a search costs is a bounded
count of traced steps whatever the length it finds. tests/test_estimate.py
holds the planner's ground truth (planned vs real steps) and the older search
contract (``granularity``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from ulysses_dtensor.estimate import GIB, find_max_seq_len, plan_memory
from ulysses_dtensor.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--model.flavor", "debug", "--model.dim", "64", "--model.ffn_dim", "256",
    "--model.vocab_size", "2048", "--training.global_batch_size", "1", "--parallelism.sp", "2",
]
SWITCHES = ["--activation_checkpoint.mode", "full", "--memory.tiled_mlp", "true", "--memory.tiled_loss", "true",
            "--memory.offload_activations", "true"]


@pytest.fixture
def small_norm_chunks(monkeypatch):
    """RMSNorm chunks of 100 rows at dim 64 (the real 64M elements would be one chunk here)."""
    from ulysses_dtensor.models import norm

    monkeypatch.setattr(norm, "CHUNK_ELEMENTS", 64 * 100)


def _same(a, b) -> None:
    assert a.phase_peaks == b.phase_peaks and a.peak_phase == b.peak_phase
    assert a.breakdown == b.breakdown and a.kinds == b.kinds
    assert a.host_bytes == b.host_bytes and a.end_of_forward == b.end_of_forward


def _tiny_hf(tmp_path, family: str, **config) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_hf_model import hf_config

    d = tmp_path / family
    d.mkdir()
    hf = hf_config(family, vocab_size=320, dim=64, layers=2, heads=8, kv_heads=4, ffn_dim=96)
    for k, v in config.items():
        setattr(hf, k, v)
    hf.to_json_file(d / "config.json")
    return d


def test_edge_pieces_plan_the_memory_of_every_piece(small_norm_chunks):
    # Every loop over the sequence at once: MLP tiles (9 of 114 tokens, the last 112 long),
    # loss chunks (7), RMSNorm chunks (11 per norm), under full AC with offloaded block
    # inputs, planned for CUDA (FlashAttention workspace, host memory).
    cfg = load_config(TINY + SWITCHES + ["--model.n_layers", "2", "--memory.mlp_tiles", "9",
                                          "--memory.loss_chunks", "7"])
    edges = plan_memory(cfg, 2, 2048, device="cuda", loops="edges")
    every = plan_memory(cfg, 2, 2048, device="cuda", loops="all")
    _same(edges, every)
    assert edges.host_bytes > 0 and edges.trace["loops"] == "edges" and every.trace["loops"] == "all"
    assert edges.trace["ops"] < 0.6 * every.trace["ops"], (edges.trace["ops"], every.trace["ops"])


def test_edge_chunks_and_ring_steps_plan_the_memory_of_every_one():
    # Head chunks (4 of a rank's 4 query heads, one kv head: traced 0, 1 and 3) under USP with a
    # ring of 8 (traced steps 0, 1, 2 and 7), at their edges against every chunk and step, on
    # 16 fake ranks (ring 8 x ulysses 2), full AC with offload, planned for CUDA.
    cfg = load_config(["--model.flavor", "debug_gqa", "--model.vocab_size", "512", "--model.n_layers", "1",
                       "--training.global_batch_size", "1", "--parallelism.sp", "16", "--parallelism.ring", "8",
                       "--memory.head_chunks", "4", *SWITCHES, "--memory.mlp_tiles", "4", "--memory.loss_chunks", "4"])
    edges = plan_memory(cfg, 16, 4096, device="cuda", loops="edges")
    every = plan_memory(cfg, 16, 4096, device="cuda", loops="all")
    assert edges.phase_peaks == every.phase_peaks and edges.host_bytes == every.host_bytes
    assert edges.trace["ops"] < 0.6 * every.trace["ops"], (edges.trace["ops"], every.trace["ops"])


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_router_loss"])
def test_edge_pieces_plan_transformers_models_exactly(tmp_path, family):
    # The transformers path's own loops: the tiled per-token block (here an MoE block whole:
    # router, experts; a dense MLP is the same loop) and the output head's chunks; transformers' RMSNorm swapped for ours (lean norms). With
    # the router loss, transformers records every tile's router logits through hooks that
    # a skipped tile would not run: the planner traces every piece.
    router = family.endswith("_router_loss")
    d = _tiny_hf(tmp_path, family.removesuffix("_router_loss"), **({"output_router_logits": True} if router else {}))
    cfg = load_config(["--model.hf_path", str(d), "--model.implementation", "transformers",
                       "--training.global_batch_size", "1", "--parallelism.sp", "2",
                       "--training.mixed_precision_param", "bfloat16", *SWITCHES,
                       "--memory.mlp_tiles", "8", "--memory.loss_chunks", "6"])
    edges = plan_memory(cfg, 2, 1024, device="cuda", loops="edges")
    every = plan_memory(cfg, 2, 1024, device="cuda", loops="all")
    _same(edges, every)
    if router:
        assert edges.trace["loops"] == "all" and any("router logits" in n for n in edges.notes)
    else:
        assert edges.trace["loops"] == "edges" and edges.trace["ops"] < every.trace["ops"]


def test_an_edge_trace_costs_the_same_at_any_length(small_norm_chunks):
    # Automatic tile counts grow with the length (a tile is about dim^2 / ffn = 16 tokens
    # here: 32 tiles per layer at 1024 tokens on 2 ranks, 256 at 8192; RMSNorm chunks 6
    # and 41); edge pieces trace four of each. (What tracing every piece costs: the
    # first test.)
    from ulysses_dtensor.memory.tiling import auto_num_tiles

    cfg = load_config(TINY + SWITCHES + ["--model.n_layers", "2"])
    assert [auto_num_tiles(s // 2, 256, 64) for s in (1024, 8192)] == [32, 256]
    # The first trace of a process also runs one-time ops (caches filling): traced first, unused.
    _, short, long = (plan_memory(cfg, 2, s, device="cuda") for s in (1024, 1024, 8192))
    assert short.peak_bytes < long.peak_bytes
    assert short.trace["loops"] == long.trace["loops"] == "edges"
    assert short.trace["ops"] == long.trace["ops"]


# Deeper than the 4/5/6 blocks extrapolated from (layers="extrapolate": at 7 blocks tracing
# them all would cost as little); tile and chunk counts pinned (5: edge pieces leave one
# out), so that a trace of every piece costs no more at 500K tokens than at 1K.
DEEP = TINY + SWITCHES + ["--model.n_layers", "7", "--memory.mlp_tiles", "5", "--memory.loss_chunks", "5"]


def _fits(cfg, seq: int, budget_gib: float) -> bool:
    return plan_memory(cfg, 2, seq, device="cuda", layers="full", loops="all").peak_bytes <= budget_gib * GIB


def test_fast_answer_is_the_full_trace_answer():
    """The fast search's answer fits when every block and every piece is traced, and 1 % more
    does not: the full-trace search's answer lies within 1 % of it."""
    cfg = load_config(DEEP)
    budget = 1.0
    res = find_max_seq_len(cfg, 2, budget_gib=budget, headroom_gib=0, host_budget_gib=None, layers="extrapolate")
    assert res.best.trace["extrapolated"] and res.best.trace["layers_traced"] == [4, 5, 6]
    assert res.best.trace["loops"] == "edges" and not res.confirmed
    assert res.precision <= 0.005 and res.binding == "device"
    print(f"fast answer {res.max_seq_len:,} (limit below {res.limit_below:,}), {len(res.plans)} lengths, "
          f"{res.traces} traces, {res.seconds:.1f} s")
    assert res.traces == 2 * len(res.plans) + 1 <= 9  # 4 and 6 blocks per length, the 5-block check once
    assert _fits(cfg, res.max_seq_len, budget)
    over = math.ceil(res.max_seq_len * 1.01 / res.unit) * res.unit
    assert not _fits(cfg, over, budget)


TWO_BLOCKS = TINY + SWITCHES + ["--model.n_layers", "2", "--memory.mlp_tiles", "8", "--memory.loss_chunks", "8"]


@pytest.fixture(scope="module")
def two_blocks_free():
    """The search of TWO_BLOCKS at 0.5 GiB without a host ceiling (~250K tokens)."""
    return find_max_seq_len(load_config(TWO_BLOCKS), 2, budget_gib=0.5, headroom_gib=0, host_budget_gib=None)


def test_a_search_is_a_bounded_count_of_traces(two_blocks_free):
    # 16x the budget, ~16x the answer (~4M tokens), the same handful of traced steps
    # (two blocks, traced whole: one per length; the extrapolated count is the test above's).
    free = two_blocks_free
    big = find_max_seq_len(load_config(TWO_BLOCKS), 2, budget_gib=8.0, headroom_gib=0, host_budget_gib=None)
    print(f"{free.max_seq_len:,} and {big.max_seq_len:,} tokens: {free.traces} and {big.traces} traces")
    assert big.max_seq_len > 3_000_000 and big.max_seq_len > 12 * free.max_seq_len
    for res in (free, big):
        assert res.precision <= 0.005 and not res.best.trace["extrapolated"]
        assert res.traces == len(res.plans) <= 4


def test_host_ceiling_binds_and_is_named(two_blocks_free):
    # Two blocks (traced whole). Offloaded block inputs: 2 x (S / 2) x 64 x 4 bytes of host
    # memory per GPU, 0.06 GiB at the device's limit of 0.5 GiB (~250K tokens).
    from ulysses_dtensor.estimate.cli import _search_report

    cfg = load_config(TWO_BLOCKS)
    free = two_blocks_free
    assert free.binding == "device" and free.host_budget_gib is None and free.best.host_bytes > 0.05 * GIB
    tight = find_max_seq_len(cfg, 2, budget_gib=0.5, headroom_gib=0, host_budget_gib=0.02)
    assert tight.binding == "host" and tight.host_budget_gib == 0.02 and tight.precision <= 0.005
    assert tight.best.host_bytes <= 0.02 * GIB and tight.max_seq_len < 0.4 * free.max_seq_len
    report = _search_report(tight)  # what the command prints
    assert f"{tight.max_seq_len:,} tokens" in report and " ± " in report and "binding ceiling: host memory" in report
    # Planning for the CPU, host and device memory are one: no second ceiling.
    cpu = find_max_seq_len(cfg, 2, budget_gib=0.5, headroom_gib=0, host_budget_gib=0.02, device="cpu")
    assert cpu.host_budget_gib is None and cpu.binding == "device" and cpu.max_seq_len > tight.max_seq_len


def test_cli_states_the_precision_and_the_binding_ceiling(capsys):
    from ulysses_dtensor.estimate.cli import main

    args = [*TWO_BLOCKS, "--world-size", "2", "--max-seq-len", "--budget-gib", "0.5", "--headroom-gib", "0",
            "--host-budget-gib", "0.02"]
    capsys.readouterr()
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["binding"] == "host" and 0 < res["precision"] <= 0.005 and res["limit_below"] > res["max_seq_len"]
    assert res["best"]["host_bytes"] <= 0.02 * GIB and res["host_budget_gib"] == 0.02
    assert main(args + ["--precision", "0"]) == 2
    assert "--precision" in capsys.readouterr().err


def test_a_peaks_split_carried_to_full_depth_never_outgrows_the_peak():
    # 4 and 6 layers: at the first trace's peak an all-to-all buffer is alive, at the
    # second's a projection instead. A line per kind to 36 layers runs negative for one;
    # the parts must still sum to the carried whole, none below zero.
    from ulysses_dtensor.estimate.trace import _lin_split

    w = (36 - 4) / (6 - 4)
    four, six = {"a2a": 10, "attn_proj": 2, "mlp": 5}, {"a2a": 4, "attn_proj": 9, "mlp": 6}
    whole = sum(four.values()) + (sum(six.values()) - sum(four.values())) * w
    split = _lin_split(four, six, w)
    assert min(split.values()) >= 0 and abs(sum(split.values()) - whole) <= len(split)
    assert split == {k: round(v * whole / sum(six.values())) for k, v in six.items()}
    # Where every line stays positive it is the line itself.
    assert _lin_split({"a": 1, "b": 2}, {"a": 2, "b": 3}, 3.0) == {"a": 4, "b": 5}
