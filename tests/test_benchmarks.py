"""The attention and ring benchmarks in their quick modes: JSON lines, exact bytes, parity.

Runs ``benchmarks/bench_attention.py --quick`` as a subprocess (it spawns its
own gloo ranks for sp 1 and 2) and checks what it prints: one JSON object per
configuration, the bytes each rank sent through all-to-all equal to
``exchange_bytes_per_rank``, only all-to-alls (no all-gather), and outputs
and gradients equal to unsharded attention. The DeepSpeed side-by-side runs
only where deepspeed is installed (a benchmark-only extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ulysses_dtensor.parallel.ulysses import exchange_bytes_per_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_attention.py")
FP32_TOL = 1e-5


def _run(*args: str, timeout: float, script: str = SCRIPT) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, script, "--quick", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    # stdout is JSON lines only (ranks' logs go to stderr)
    return [json.loads(line) for line in lines]


def _expected_bytes(cfg: dict) -> int:
    return exchange_bytes_per_rank(
        cfg["batch"], cfg["seq"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["sp"], 4
    )


def test_bench_attention_quick():
    records = _run("--deepspeed", "off", "--check", "--bench", "sp", "layout", timeout=180)
    sp_records = [r for r in records if r["bench"] == "attention"]
    layout = [r for r in records if r["bench"] == "attention_layout"]
    assert [r["config"]["sp"] for r in sp_records] == [1, 2]
    for rec in sp_records:
        for key in ("device", "torch", "date", "config", "variants", "ratios", "agreement"):
            assert key in rec, key
        cfg = rec["config"]
        assert cfg["dtype"] == "float32"
        expected = _expected_bytes(cfg)
        assert rec["expected_sent_bytes_per_rank"] == expected
        if cfg["sp"] == 2:
            assert expected > 0 and rec["kv_replication"] == 2  # MQA: kv head replicated
        for name, n_a2a in (("ours_separate", 8), ("ours_packed", 4)):
            var = rec["variants"][name]
            assert var["sent_bytes_per_rank"] == expected
            # forward + backward all-to-alls and nothing else: no all-gather;
            # at sp=1 the style is a no-op, so no collective at all.
            assert var["collectives"] == ({"all_to_all_single": n_a2a} if cfg["sp"] > 1 else {})
            assert var["median_ms"] > 0 and var["n"] == cfg["iters"]
            assert var["peak_mem_bytes"] > 0
        for diffs in rec["agreement"].values():
            assert max(diffs.values()) <= FP32_TOL, rec["agreement"]
        assert "reference_vs_ours_separate" in rec["agreement"]
        assert ("local" in rec["variants"]) == (cfg["sp"] == 1)
    assert [r["config"]["sp"] for r in layout] == [1, 2]
    for rec in layout:
        assert set(rec["variants"]) == {"layout_separate", "layout_packed", "attn"}
        assert rec["ratios"]["layout_separate/attn"] > 0


def test_bench_attention_vs_deepspeed():
    pytest.importorskip("deepspeed")
    # the first DeepSpeed init on a machine JIT-builds its shm comm op (~1 min, cached after)
    (rec,) = _run("--deepspeed", "on", "--sp", "2", "--no-local", timeout=600)
    cfg = rec["config"]
    ds = rec["variants"]["deepspeed"]
    # DeepSpeed's layer moves the same bytes through plain torch.distributed all-to-alls
    assert ds["collectives"] == {"alltoall_base_": 8}
    assert ds["sent_bytes_per_rank"] == _expected_bytes(cfg)
    diffs = rec["agreement"]["deepspeed_vs_ours_separate"]
    assert max(diffs.values()) <= FP32_TOL, diffs
    assert rec["ratios"]["ours_separate/deepspeed"] > 0


def test_bench_ring_quick():
    """bench_ring.py --quick (ring 2 on 2 gloo ranks, GQA): its bytes are the ring's
    k/v traffic counted by hand, both variants equal unsharded attention."""
    (rec,) = _run("--check", timeout=180, script=os.path.join(ROOT, "benchmarks", "bench_ring.py"))
    cfg = rec["config"]
    ring, uly, b, seq, kv, d = (cfg[k] for k in ("ring", "ulysses", "batch", "seq", "kv_heads", "head_dim"))
    assert (ring, uly) == (2, 1)
    # Each ring step moves one k/v block (seq / ring tokens of k and v, fp32):
    # ring - 1 steps forward; backward ring - 1 k/v steps and ring dk/dv steps.
    block = 2 * b * (seq // ring) * kv * d * 4
    assert rec["sent_bytes_per_rank"] == rec["expected_sent_bytes_per_rank"] == (3 * ring - 2) * block
    assert rec["collectives"] == {"all_to_all_single": 3 * ring - 2}
    assert rec["max_abs_diff_overlapped_vs_serial"] <= FP32_TOL
    assert rec["max_abs_diff_vs_unsharded"] <= FP32_TOL
    for name in ("overlapped", "serial", "transfers"):
        assert rec["variants"][name]["n"] == 3 and rec["variants"][name]["median_ms"] > 0
    assert rec["ratios"]["overlapped_over_serial"] > 0
