"""scripts/gpu_perf.sh, the one-call GPU kit, run whole on the CPU at tiny sizes.

On a machine without CUDA every piece runs at tiny sizes, so the kit cannot rot
between GPU leases. Checked on its outputs:

* every piece ran and exited 0, and everything is in the tarball a lease brings back;
* env: every backend name was tried, and what ran includes ``auto`` and ``sdpa``;
* each shape: the auto kernel at every layer count of its fit plus the record
  extrapolated to full depth, finite figures at full depth in the summary, and the
  save_attention variant measured or skipped with its reason;
* the region table of a profiled step: its lines add up to the step; the ops'
  self times fit inside the step's wall time (each counted once) and cover most of
  it; attention shows forward, recompute and backward; the MLP is recomputed (full
  AC); the backward is mapped to forward regions (almost nothing left unmapped);
* the planner check: the measured peak at the planned maximum is within 5 % of the plan;
* the RESULTS.md block has every section.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from script_module import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_perf")
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_perf.sh"), str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "## " in proc.stdout and "gpu_perf: done in" in proc.stderr
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def test_every_piece_ran_and_everything_is_in_the_tarball(kit):
    pieces = {p["piece"]: p for p in _lines(kit / "pieces.jsonl")}
    assert set(pieces) == {"env", "plan", "shape_llama", "profile_llama", "shape_qwen", "plan_check"}
    assert all(p["rc"] == 0 for p in pieces.values()), pieces
    with tarfile.open(kit / "gpu_perf.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"env.json", "shape_llama.jsonl", "shape_qwen.jsonl", "profile_llama.json", "plan.json",
            "plan_check.json", "summary.json", "RESULTS_block.md", "pieces.jsonl"} <= names


def test_env_tries_every_backend(kit):
    from ulysses_dtensor.attention.select import BACKENDS

    env = json.loads((kit / "env.json").read_text())
    assert env["tiny"] is True and env["backends"] == list(BACKENDS)
    assert set(env["kernels"]) == set(BACKENDS)
    assert {"auto", "sdpa"} <= set(env["runs_here"]) and env["auto"] == "sdpa"
    assert all(v["error"] for v in env["kernels"].values() if not v["runs"])  # a reason for each


@pytest.mark.parametrize("shape", ["llama", "qwen"])
def test_each_shape_has_its_fit_and_full_depth_figures(kit, shape):
    spec = load_script(REPO / "benchmarks" / "gpu_perf.py").TINY_SHAPES[shape]
    recs = _lines(kit / f"shape_{shape}.jsonl")
    auto = [r for r in recs if r["kit"]["kernel"] == "auto" and r["kit"]["ac"] == "full"]
    measured = [r for r in auto if "extrapolated" not in r]
    assert [r["config"]["model"]["n_layers"] for r in measured] == spec["fit"]
    assert all(r["communication"].startswith("skipped (fake process group)") for r in measured)
    assert all(r["world_size"] == 8 and r["config"]["mesh"]["sp"] == 8 for r in measured)
    (ex,) = [r for r in auto if "extrapolated" in r]
    assert ex["config"]["model"]["n_layers"] == spec["layers"]
    sa = [r for r in recs if r["kit"]["ac"] == "save_attention"]
    assert sa and all("skipped" in r or r["config"]["save_attention"] for r in sa)
    summary = json.loads((kit / "summary.json").read_text())["shapes"][shape]
    v = summary["variants"]["auto / full AC"]
    assert _finite(v["compute_only"]["step_s"], v["compute_only"]["tokens_per_s_per_gpu"], v["peak_gib"],
                   v["modelled_400"]["step_s"], v["modelled_300"]["step_s"])
    # The modelled collectives only add time, more at the lower bandwidth.
    assert v["compute_only"]["step_s"] <= v["modelled_400"]["step_s"] <= v["modelled_300"]["step_s"]
    flops = v["flops_per_token"]
    assert flops["hardware"] > flops["model"] > 0  # full AC recomputes


def test_the_region_table_adds_up_to_the_step_and_maps_the_backward(kit):
    table_mod = load_script(REPO / "benchmarks" / "_region_table.py")
    table = json.loads((kit / "profile_llama.json").read_text())["table"]
    t, rows = table["totals"], table["rows"]
    step = t["step_ms"]
    assert table_mod.rows_sum_ms(table) == pytest.approx(step, rel=1e-3)
    # Self CPU times, each op once: inside the step's wall time, and most of it.
    assert -0.01 * step <= t["idle_ms"] <= 0.25 * step
    assert t["unlinked_ms"] == 0 and t["concurrent_ms"] == 0
    for phase in ("forward", "recompute", "backward"):
        assert rows["attention"][phase] > 0 and rows["exchange layout copies"][phase] > 0
    assert rows["mlp"]["recompute"] > 0 and rows["projections q/k/v/o"]["backward"] > 0
    assert rows["optimizer"]["total"] > 0 and rows["clip"]["total"] > 0 and rows["norms"]["total"] > 0
    assert rows["loss (output head)"]["recompute"] > 0  # tiled loss: each chunk recomputed in backward
    backward = sum(r["backward"] for r in rows.values())
    assert sum(table["unmapped_backward"].values()) < 0.1 * backward


def test_planner_check_is_close(kit):
    plan = json.loads((kit / "plan.json").read_text())
    check = json.loads((kit / "plan_check.json").read_text())
    assert plan["max_seq_len"] > 0 and check["seq_len"] == plan["max_seq_len"]
    assert check["ratio"] == pytest.approx(1.0, abs=0.05), check


def test_the_results_block_has_every_section(kit):
    block = (kit / "RESULTS_block.md").read_text()
    for needle in ("TINY CPU SMOKE RUN", "torch ", "`auto` -> `sdpa`", "### tiny Llama", "### tiny Qwen3-shaped",
                   "Layer fit (auto, full AC)", "### Targets", "### Where a step goes", "| **step** |",
                   "### Planner check", "save_attention", "400 GB/s", "300 GB/s"):
        assert needle in block, needle
