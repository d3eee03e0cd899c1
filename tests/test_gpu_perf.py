"""scripts/gpu_perf.sh, the one-call GPU kit, run whole on the CPU at tiny sizes.

On a machine without CUDA every piece runs at tiny sizes, so the kit cannot rot
between GPU leases. Checked on its outputs:

* every piece ran and exited 0, and everything is in the tarball a lease brings back;
  the kit's settings (kit.json) say the kit set the allocator's expandable segments;
* env: every backend name was tried, what ran includes ``auto`` and ``sdpa``, and each
  that ran says the kernel its forward dispatched to; env.json is complete;
* parity: on a real (gloo) process group of one rank, ``sdpa`` + save_attention equals
  ``sdpa`` + full AC, ``auto`` matches the float64 reference, and the perturbed
  reference fails the comparison;
* each shape: the plan first; the auto kernel at every layer count of its fit plus the
  record extrapolated to full depth, save_attention at two layer counts, each timed
  step with a finite loss and gradient norm on defined collective outputs; in the
  summary, both variants with finite figures from their own lines;
* the region table of a profiled step: its lines add up to the step; the ops'
  self times fit inside the step's wall time (each counted once) and cover most of
  it; attention shows forward, recompute and backward; the MLP is recomputed (full
  AC); every backward node a forward op made is mapped to that op's region;
* the planner ran with no GPU visible and no CUDA context; the planner check: the
  measured peak at the planned maximum is within 5 % of the plan;
* the RESULTS.md block has every section.

The report's rules on synthetic records (no figure from one layer count, errors for
MFU over 100 % or a non-finite loss, ...) are tests/test_gpu_perf_report.py's.
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
PIECES = ("env", "parity", "plan", "disk", "shape_llama", "profile_llama", "shape_qwen", "plan_check")


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    """The pieces' files as a lease brings them back: unpacked from the tarball."""
    out = tmp_path_factory.mktemp("gpu_perf")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env.update(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_perf.sh"), str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "## " in proc.stdout and "gpu_perf: done in" in proc.stderr
    # What a lease brings back (at most 8 files): the tarball and the report beside it.
    assert sorted(p.name for p in out.iterdir()) == ["RESULTS_block.md", "gpu_perf.tar.gz", "report.txt",
                                                     "summary.json"]
    with tarfile.open(out / "gpu_perf.tar.gz") as tar:
        tar.extractall(out / "unpacked", filter="data")
    return out / "unpacked" / "pieces"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def test_every_piece_ran_and_everything_is_in_the_tarball(kit):
    pieces = {p["piece"]: p for p in _lines(kit / "pieces.jsonl")}
    assert set(pieces) == set(PIECES)
    assert all(p["rc"] == 0 for p in pieces.values()), pieces
    names = {p.name for p in kit.iterdir()}
    assert {"kit.json", "env.json", "parity.json", "shape_llama.jsonl", "shape_qwen.jsonl", "profile_llama.json",
            "plan.json", "plan_check.json", "summary.json", "RESULTS_block.md", "pieces.jsonl"} <= names
    assert {f"{p}.log" for p in pieces} <= names  # each piece's own log
    settings = json.loads((kit / "kit.json").read_text())
    assert settings["tiny"] is True and set(settings["limits"]) == set(PIECES)
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert settings["alloc_conf_set_by"] == "the kit"


def test_env_tries_every_backend(kit):
    from ulysses_dtensor.attention.select import BACKENDS

    env = json.loads((kit / "env.json").read_text())
    assert env["tiny"] is True and env["backends"] == list(BACKENDS) and env["complete"] is True
    assert set(env["kernels"]) == set(BACKENDS)
    assert {"auto", "sdpa"} <= set(env["runs_here"]) and env["auto"] == "sdpa"
    assert all(v["error"] for v in env["kernels"].values() if not v["runs"])  # a reason for each
    # The kernel each backend's forward dispatched to: auto is sdpa here, both the CPU's flash kernel.
    cpu_flash = ["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert env["kernels"]["auto"]["dispatch"] == env["kernels"]["sdpa"]["dispatch"] == cpu_flash
    assert env["allocator"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "set_by": "the kit"}


def test_parity_on_a_real_process_group_of_one(kit):
    parity = json.loads((kit / "parity.json").read_text())
    assert parity["process_group"] == "gloo" and parity["world_size"] == 1
    assert parity["kernel"] == "sdpa" and parity["auto_is"] == "sdpa"  # cuDNN's stand-in on the CPU
    assert parity["passed"] is True
    assert all(c["passed"] for c in parity["checks"].values()), parity["checks"]
    kept = parity["checks"]["save_attention_equals_full_ac"]
    assert kept["loss_rel"] == 0.0 and kept["grad_rel"] <= kept["tolerance"]["grad"]
    # The comparison can fail: the perturbed reference is far outside the tolerance.
    wrong = parity["perturbed_reference"]
    assert wrong["failed_as_it_must"] is True and wrong["worst_param_rel"] > 10 * wrong["tolerance"]["worst"]


@pytest.mark.parametrize("shape", ["llama", "qwen"])
def test_each_shape_has_its_fit_and_full_depth_figures(kit, shape):
    spec = load_script(REPO / "benchmarks" / "_gpu_perf_common.py").TINY_SHAPES[shape]
    plan, *recs = _lines(kit / f"shape_{shape}.jsonl")
    full, kept = "auto (sdpa) / full AC", "auto (sdpa) / save_attention"
    assert plan["plan"]["variants"] == [full, kept]  # nothing else runs a backward on the CPU
    assert plan["plan"]["left_out"]["sdpa"].startswith("what `auto` runs here")
    auto = [r for r in recs if r["kit"]["kernel"] == "auto" and r["kit"]["ac"] == "full"]
    measured = [r for r in auto if "extrapolated" not in r]
    assert [r["config"]["model"]["n_layers"] for r in measured] == spec["fit"]
    assert all(r["communication"].startswith("skipped (fake process group)") for r in measured)
    assert all(r["config"]["clock"] == "process CPU seconds" for r in measured)  # the smoke run's clock
    assert all(r["world_size"] == 8 and r["config"]["mesh"]["sp"] == 8 for r in measured)
    (ex,) = [r for r in auto if "extrapolated" in r]
    assert ex["config"]["model"]["n_layers"] == spec["layers"]
    sa = [r for r in recs if r["kit"]["ac"] == "save_attention" and "extrapolated" not in r]
    assert [r["config"]["model"]["n_layers"] for r in sa] == spec["fit"][:2]
    assert all(r["config"]["save_attention"] for r in sa)
    for r in measured + sa:  # real numbers: defined collective outputs, finite loss and gradient norm
        assert r["collectives"]["outputs"] == "defined" and r["collectives"]["unknown"] == {}
        assert r["timed_steps"]["finite"] is True and len(r["timed_steps"]["loss"]) == r["config"]["iters"]
    summary = json.loads((kit / "summary.json").read_text())["shapes"][shape]
    assert summary["carrier"] == full
    assert summary["variants"][kept]["figures"]["line"]["layers"] == spec["fit"][:2]
    v = summary["variants"][full]["figures"]
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
    # Every backward node a forward op made maps to that op's region; left over are only the
    # nodes no forward op makes: gradient accumulation into the parameters and FSDP's hook.
    no_forward_op = {"torch::autograd::AccumulateGrad", "RegisterPostBackwardFunctionBackward"}
    assert set(table["unmapped_backward"]) <= no_forward_op


def test_planner_check_is_close(kit):
    plan = json.loads((kit / "plan.json").read_text())
    check = json.loads((kit / "plan_check.json").read_text())
    assert plan["cuda_visible_devices"] == "" and plan["cuda_initialized"] is False  # no GPU, no CUDA context
    assert plan["max_seq_len"] > 0 and check["seq_len"] == plan["max_seq_len"]
    assert check["reserved_bytes"] is None and check["headroom_covers_gap"] is None  # the CPU has no reserve
    assert check["ratio"] == pytest.approx(1.0, abs=0.05), check


def test_the_disk_tier_is_written_read_back_and_timed(kit):
    disk = json.loads((kit / "disk.json").read_text())
    # 32 MiB in 4 MiB layers through the offloader's own store, in the kit's folder; its file is gone.
    assert disk["tiny"] is True and disk["bytes"] == 32 << 20 and disk["layers"] == 8 and disk["read_back_equal"]
    assert disk["directory"].endswith("pieces/disk_probe") and not os.listdir(kit / "disk_probe")  # no file left
    assert _finite(disk["write_gbps"], disk["write_sync_gbps"], disk["read_gbps"])
    assert disk["write_s"] <= disk["write_sync_s"] and disk["staging_bytes"] > 0


def test_the_results_block_has_every_section(kit):
    block = (kit / "RESULTS_block.md").read_text()
    for needle in ("TINY CPU SMOKE RUN", "torch ", "`auto` -> `sdpa`", "### tiny Llama", "### tiny Qwen3-shaped",
                   "its own line through its measured layer counts", "| auto (sdpa) / save_attention | 1: ",
                   "### Targets", "n/a (tiny CPU run)", "### 1-GPU check", "failed, as it must",
                   "### Where a step goes", "| **step** |", "### Planner check", "Reserved vs allocated",
                   "Allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by the kit)", "400 GB/s",
                   "### The disk tier's bandwidth", "| write (page cache) |",
                   "300 GB/s"):
        assert needle in block, needle
    assert "MET" not in block and "error" not in block


class _Span:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


class _Events:
    """Profiler events as torch's FunctionEvent shows them (what region_table reads)."""

    def __init__(self):
        self.all = []

    def op(self, name, start, end, parent=None, *, thread=1, seq=-1, fwd_thread=None, kernels=(), annotation=False):
        from types import SimpleNamespace

        e = SimpleNamespace(name=name, device_type=SimpleNamespace(name="CPU"), is_async=False, thread=thread,
                            fwd_thread=thread if fwd_thread is None else fwd_thread, sequence_nr=seq,
                            time_range=_Span(start, end), cpu_parent=parent, cpu_children=[],
                            is_user_annotation=annotation,
                            kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels])
        if parent is not None:
            parent.cpu_children.append(e)
        e.self_cpu_time_total = end - start
        self.all.append(e)
        return e

    def device(self, name, start, end, annotation=False):
        from types import SimpleNamespace

        self.all.append(SimpleNamespace(name=name, device_type=SimpleNamespace(name="CUDA"), is_async=False,
                                        time_range=_Span(start, end), is_user_annotation=annotation,
                                        cpu_parent=None, cpu_children=[], kernels=[], sequence_nr=-1))


def test_device_time_goes_to_forward_recompute_and_backward_rows_once():
    # The CUDA path of region_table, which the CPU smoke run never takes, on a hand-made profile:
    # forward on thread 1, autograd's engine on thread 2, a checkpoint recompute inside a backward node.
    table_mod = load_script(REPO / "benchmarks" / "_region_table.py")
    ev = _Events()
    fwd = ev.op("ud.step.forward", 0, 100, annotation=True)
    att = ev.op("ud.attention", 10, 30, fwd, annotation=True, kernels=[("ud.attention", 60)])  # its own GPU span
    ev.op("aten::_flash_attention_forward", 12, 20, att, seq=5, kernels=[("flash_fwd", 50)])
    mlp = ev.op("ud.mlp", 40, 60, fwd, annotation=True)
    ev.op("aten::mm", 41, 50, mlp, seq=6, kernels=[("gemm", 30)])
    gather = ev.op("FSDP::all_gather_copy_in", 70, 80, fwd, annotation=True)
    ev.op("aten::copy_", 71, 72, gather, kernels=[("copy", 5)])
    out = ev.op("ud.offload.copy_out", 85, 90, fwd, annotation=True)
    ev.op("aten::copy_", 86, 87, out, kernels=[("Memcpy DtoH", 20)])
    clip = ev.op("ud.step.clip", 300, 320, annotation=True)
    ev.op("cudaStreamSynchronize", 301, 304, clip)
    node = ev.op(f"{table_mod.EVALUATE}FlashAttnBackward0", 200, 260, thread=2, seq=5, fwd_thread=1)
    ev.op("aten::_flash_attention_backward", 201, 250, node, thread=2, kernels=[("flash_bwd", 100)])
    ckpt = ev.op(f"{table_mod.EVALUATE}CheckpointFunctionBackward", 261, 290, thread=2, seq=9, fwd_thread=1)
    rec = ev.op("ud.mlp.recompute", 262, 270, ckpt, thread=2, annotation=True)
    ev.op("aten::mm", 263, 269, rec, thread=2, seq=7, kernels=[("gemm", 30)])
    mm_bwd = ev.op(f"{table_mod.EVALUATE}MmBackward0", 271, 289, ckpt, thread=2, seq=7, fwd_thread=2)
    ev.op("aten::mm", 272, 288, mm_bwd, thread=2, kernels=[("gemm", 60)])
    lost = ev.op(f"{table_mod.EVALUATE}MmBackward0", 291, 295, thread=2, seq=99, fwd_thread=1)
    ev.op("aten::mm", 292, 294, lost, thread=2, kernels=[("gemm", 10)])
    for name, a, b in (("flash_fwd", 1000, 1050), ("gemm", 1100, 1130), ("copy", 1130, 1135),
                       ("Memcpy DtoH", 1110, 1130), ("flash_bwd", 1200, 1300), ("gemm", 1300, 1330),
                       ("gemm", 1330, 1390), ("gemm", 1390, 1400), ("unlinked kernel", 1400, 1407)):
        ev.device(name, a, b)
    ev.device("ud.attention", 1000, 1060, annotation=True)  # a gpu_user_annotation: no work of its own

    table = table_mod.region_table(ev.all, 1000e-6, device=True)
    rows, t = table["rows"], table["totals"]
    assert (rows["attention"]["forward"], rows["attention"]["backward"]) == (0.05, 0.1)
    assert (rows["mlp"]["forward"], rows["mlp"]["recompute"], rows["mlp"]["backward"]) == (0.03, 0.03, 0.06)
    assert rows["fsdp gathers / reduces"]["forward"] == 0.005 and rows["offload copies"]["forward"] == 0.02
    assert rows["other (no region)"]["backward"] == 0.01 and table["unmapped_backward"] == {"MmBackward0": 0.01}
    assert rows["attention"]["calls"] == 1 and rows["mlp"]["calls"] == 2
    assert t["work_ms"] == 0.312 and t["attributed_ms"] == 0.305 and t["unlinked_ms"] == 0.007
    assert t["concurrent_ms"] == 0.02  # the copy ran beside the gemm
    assert t["idle_ms"] == pytest.approx(1.0 - 0.292)
    assert table_mod.rows_sum_ms(table) == pytest.approx(t["step_ms"])
    assert table["host_syncs"] == {"cudaStreamSynchronize": {"count": 1, "host_ms": 0.003, "in": {"clip": 1}}}


def test_with_no_time_left_every_piece_is_skipped_and_the_report_still_comes(tmp_path):
    # 61 s of budget: all of it but the 60 s kept for the report, too little for any piece.
    # The user's allocator setting is kept (the kit sets its own only when there is none).
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "GPU_PERF_BUDGET_S": "61",
           "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_perf.sh"), str(tmp_path)], cwd=REPO,
                          env={**env, "GPU_PERF_KEEP": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pieces = _lines(tmp_path / "pieces" / "pieces.jsonl")
    assert {p["piece"] for p in pieces} == set(PIECES)
    assert all(p["skipped"] == "no time left" for p in pieces)
    settings = json.loads((tmp_path / "pieces" / "kit.json").read_text())
    assert settings["budget_s"] == 61 and settings["reserve_s"] == 60
    assert (settings["PYTORCH_CUDA_ALLOC_CONF"], settings["alloc_conf_set_by"]) == (
        "garbage_collection_threshold:0.6", "the user")
    block = (tmp_path / "RESULTS_block.md").read_text()
    assert "### llama: no result" in block and "### qwen: no result" in block
    assert "**env.json is missing** (the piece was skipped: no time left)" in block
    assert "MET" not in block and "n/a (no record says what ran)" not in block
    with tarfile.open(tmp_path / "gpu_perf.tar.gz") as tar:
        assert {"pieces/pieces.jsonl", "pieces/RESULTS_block.md", "pieces/summary.json"} <= set(tar.getnames())


def test_a_variant_that_would_not_finish_in_the_time_left_is_skipped(tmp_path, monkeypatch):
    # The shape piece with its measuring replaced: each layer count "takes" 10 s of a fake clock.
    # auto at [1, 2] takes 20 s of a 35 s deadline; save_attention would take about 25 s (20 s
    # x 1.25): it is skipped, saying so, and the piece goes on.
    import argparse
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "benchmarks"))
    import _gpu_perf_shape
    import bench_train

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(_gpu_perf_shape, "time", SimpleNamespace(monotonic=lambda: clock.now))

    def sweep(a, pmesh, device, report, *, simulate):
        for n in a.layers:
            clock.now += 10.0
            report({"config": {"model": {"n_layers": n}}, "step_time": {"median_ms": 100.0 * n}})
        return True

    monkeypatch.setattr(bench_train, "sweep", sweep)
    sdpa = {"runs": True, "dispatch": ["aten::_scaled_dot_product_flash_attention_for_cpu"]}
    (tmp_path / "env.json").write_text(json.dumps({"auto": "sdpa", "kernels": {"auto": sdpa, "sdpa": sdpa}}))
    args = argparse.Namespace(shape="llama", out=tmp_path, tiny=True, deadline_s=35.0)
    assert _gpu_perf_shape.piece_shape(args) == 0
    plan, *recs = _lines(tmp_path / "shape_llama.jsonl")
    assert plan["plan"]["variants"] == ["auto (sdpa) / full AC", "auto (sdpa) / save_attention"]
    assert [r["config"]["model"]["n_layers"] for r in recs[:2]] == [1, 2]
    (skip,) = recs[2:]
    assert skip["kit"]["variant"] == "auto (sdpa) / save_attention"
    assert skip["skipped"] == "not enough time left in this piece (15 s; this variant at [1, 2] layers: about 25 s)"
