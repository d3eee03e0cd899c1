"""The GPU kit's report on synthetic records: it cannot claim a target it did not measure.

Pure Python (no torch, no process): each test writes what the kit's pieces would leave in
OUT -- env.json, pieces.jsonl, shape_qwen.jsonl -- and reads the report's RESULTS block and
summary.json. A Qwen3-8B-shaped variant measured at one layer count, in a killed piece,
with MFU over 100 %, with a non-finite loss, or with env.json missing gives "not measured"
or an error, never MET; the same records well formed at two layer counts give a figure
and MET, so that these tests can fail. Also: the variants the shape pieces plan from the
env piece's dispatched kernels, and the cost model that decides what still fits.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _gpu_perf_figures import fit  # noqa: E402
from _gpu_perf_report import report  # noqa: E402
from _gpu_perf_shape import CostModel, Variant, plan_variants  # noqa: E402

QWEN = {"dim": 4096, "n_layers": 1, "n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "ffn_dim": 12288,
        "vocab_size": 151936}
AUTO, SAVED, VARLEN = "auto (cudnn) / full AC", "auto (cudnn) / save_attention", "varlen / full AC"
ENV = {"device": "NVIDIA H200", "device_type": "cuda", "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91900,
       "tiny": False, "complete": True, "auto": "cudnn", "runs_here": ["auto", "sdpa", "varlen", "cudnn"],
       "kernels": {}, "allocator": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "set_by": "the kit"}}


def _record(layers: int, step_ms: float, variant: str = AUTO, *, loss: float = 11.9, peak_flops=989e12) -> dict:
    """One measured layer count of the Qwen3-8B shape, as bench_train.py writes it under the kit."""
    kernel, ac = variant.split(" ")[0], "save_attention" if "save_attention" in variant else "full"
    return {
        "kit": {"shape": "qwen", "title": "Qwen3-8B-shaped, 1M tokens on 8 GPUs (128K per GPU)", "variant": variant,
                "kernel": kernel, "auto_is": "cudnn", "ac": ac, "full_layers": 36, "layers": [1, 2], "tiny": False},
        "bench": "train", "mode": "simulate", "device": "NVIDIA H200", "torch": "2.11.0+cu130", "date": "2026-12-01",
        "config": {"model": {**QWEN, "n_layers": layers}, "seq": 1 << 20, "tokens_per_rank": 1 << 17, "ac": "full",
                   "save_attention": ac == "save_attention", "tiled_mlp": True, "tiled_loss": True},
        "step_time": {"median_ms": step_ms},
        "memory": {"peak_bytes": (20 + 1.5 * layers) * 2**30, "max_reserved_bytes": (22 + 1.6 * layers) * 2**30},
        "all_to_all": {"sent_bytes_per_rank": 2_000_000_000 * layers},
        "fsdp": {"sent_bytes_per_rank": {"all_gather": 400_000_000 * layers, "reduce_scatter": 800_000_000 * layers}},
        "peak_flops": peak_flops,
        "timed_steps": {"loss": [loss], "grad_norm": [1.7], "finite": math.isfinite(loss)},
        "collectives": {"outputs": "defined", "written": {"_c10d_functional::all_to_all_single": 8}, "unknown": {}},
    }


def _plan(*variants: str) -> dict:
    return {"plan": {"shape": "qwen", "title": "Qwen3-8B-shaped, 1M tokens on 8 GPUs (128K per GPU)", "tiny": False,
                     "auto_is": "cudnn", "full_layers": 36, "variants": list(variants),
                     "layers": {v: [1, 2] for v in variants}, "left_out": {}}}


def _report(tmp_path: Path, records: list[dict], *, env: dict | None = ENV, qwen_piece: dict | None = None):
    """Run the report on an OUT folder holding these records; (block text, summary, qwen rows)."""
    if env is not None:
        (tmp_path / "env.json").write_text(json.dumps(env))
    pieces = [{"piece": "env", "rc": 0 if env else 124, "seconds": 30, "limit": 30},
              qwen_piece or {"piece": "shape_qwen", "rc": 0, "seconds": 100, "limit": 135}]
    (tmp_path / "pieces.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pieces))
    (tmp_path / "shape_qwen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report(tmp_path) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = [r for r in summary["targets"] if r["target"] == "step time at 1M tokens on 8"]
    return (tmp_path / "RESULTS_block.md").read_text(), summary, rows


def test_two_layer_counts_give_a_figure_and_a_verdict(tmp_path):
    # The well-formed case: 3,000 ms + 7,000 ms per layer -> 255 s at 36 layers, MET (<= 270 s).
    block, summary, rows = _report(tmp_path, [_plan(AUTO), _record(1, 10_000), _record(2, 17_000)])
    v = summary["shapes"]["qwen"]["variants"][AUTO]
    assert v["error"] is None and v["not_measured"] is None
    f = v["figures"]
    assert f["line"]["intercept_ms"] == pytest.approx(3000) and f["line"]["ms_per_layer"] == pytest.approx(7000)
    assert f["compute_only"]["step_s"] == pytest.approx(255.0)
    assert f["peak_gib"] == pytest.approx(20 + 1.5 * 36) and f["reserved_gib"] == pytest.approx(22 + 1.6 * 36)
    assert 0 < f["mfu_compute"] < 1 and f["modelled_400"]["step_s"] > 255.0
    assert [r["verdict"] for r in rows] == ["MET"]
    assert "| auto (cudnn) / full AC | 1: 10000, 2: 17000 | 3000.0 + 7000.0 x L |" in block
    assert "TINY" not in block


def test_one_layer_count_is_not_measured(tmp_path):
    # The record that once read as an 11.0 s step, MFU 1172 % and MET: one point, no line.
    block, summary, rows = _report(tmp_path, [_plan(AUTO), _record(1, 11_000)])
    v = summary["shapes"]["qwen"]["variants"][AUTO]
    assert v["figures"] is None
    assert v["not_measured"] == "one layer count only (1); a line to full depth needs two"
    assert [r["verdict"] for r in rows] == ["not measured: one layer count only (1); a line to full depth needs two"]
    assert "MET" not in block and "No variant gave a figure at this shape" in block


def test_a_killed_piece_leaves_its_variants_not_measured(tmp_path):
    killed = {"piece": "shape_qwen", "rc": 124, "seconds": 135, "limit": 135}
    _, summary, rows = _report(tmp_path, [_plan(AUTO, SAVED, VARLEN), _record(1, 10_000)], qwen_piece=killed)
    verdicts = {r["variant"]: r["verdict"] for r in rows}
    assert verdicts == {
        AUTO: "not measured: one layer count only (1); a line to full depth needs two: the piece was killed at its "
              "time limit (135 s)",
        SAVED: "not measured: not reached: the piece was killed at its time limit (135 s)",
        VARLEN: "not measured: not reached: the piece was killed at its time limit (135 s)",
    }


def test_mfu_over_100_percent_is_an_error(tmp_path):
    # 100 ms per layer at 128K tokens per GPU: 5.6 s at 36 layers, far past the GPU's peak.
    block, summary, rows = _report(tmp_path, [_plan(AUTO), _record(1, 2_000), _record(2, 2_100)])
    assert summary["shapes"]["qwen"]["variants"][AUTO]["figures"] is None
    (row,) = rows
    assert row["verdict"].startswith("error: MFU ") and "is over 100 %: impossible" in row["verdict"]
    assert "MET" not in block


def test_a_non_finite_loss_is_an_error(tmp_path):
    block, _, rows = _report(tmp_path, [_plan(AUTO), _record(1, 10_000), _record(2, 17_000, loss=float("nan"))])
    (row,) = rows
    assert row["verdict"] == ("error: non-finite loss or gradient norm in a timed step at 2 layers "
                              "(loss nan, gradient norm 1.7)")
    assert "MET" not in block


def test_a_missing_env_json_gives_no_verdict_and_no_cpu_label(tmp_path):
    # The env piece killed: the shape records still say a GPU ran (no "tiny" default); the
    # figure is shown, the verdict is an error.
    block, summary, rows = _report(tmp_path, [_plan(AUTO), _record(1, 10_000), _record(2, 17_000)], env=None)
    assert summary["tiny"] is False and "TINY" not in block
    assert block.startswith("## NVIDIA H200, GPU perf kit (`bash scripts/gpu_perf.sh`), 2026-12-01\n")
    assert "**env.json is missing** (the piece was killed at its time limit (30 s))" in block
    (row,) = rows
    assert row["shown"] == "255.3" and row["verdict"].startswith("error: env.json is missing")
    assert "MET" not in block


def test_when_auto_fails_another_kernel_carries_the_shape(tmp_path):
    records = [_plan(AUTO, VARLEN), {"kit": _record(1, 0)["kit"], "error": "RuntimeError: cuDNN error"},
               _record(1, 10_000, VARLEN), _record(2, 16_800, VARLEN)]
    block, summary, rows = _report(tmp_path, records)
    assert summary["shapes"]["qwen"]["carrier"] == VARLEN
    assert f"**`{AUTO}` gave no figure (RuntimeError: cuDNN error); this shape's figures come from `{VARLEN}`.**" \
        in block
    assert {r["variant"]: r["verdict"] for r in rows} == {AUTO: "error: RuntimeError: cuDNN error", VARLEN: "MET"}


def test_save_attention_gets_its_own_memory_slope(tmp_path):
    kept = [_record(n, 9_000 + 6_500 * (n - 1), SAVED) for n in (1, 2)]
    for r in kept:  # its kept attention output and log-sum-exp: 1 GiB more per layer
        r["memory"]["peak_bytes"] += r["config"]["model"]["n_layers"] * 2**30
    _, summary, _ = _report(tmp_path, [_plan(AUTO, SAVED), _record(1, 10_000), _record(2, 17_000), *kept])
    variants = summary["shapes"]["qwen"]["variants"]
    assert variants[AUTO]["figures"]["mem_per_layer_gib"] == pytest.approx(1.5)
    assert variants[SAVED]["figures"]["mem_per_layer_gib"] == pytest.approx(2.5)
    assert variants[SAVED]["figures"]["peak_gib"] == pytest.approx(20 + 2.5 * 36)


def test_fit_makes_no_line_from_one_point():
    assert fit([1], [11_000.0]) is None and fit([2, 2], [5.0, 6.0]) is None
    line = fit([1, 2, 4], [10.0, 17.0, 31.0])
    assert line.slope == pytest.approx(7.0) and line.at(36) == pytest.approx(255.0)
    assert line.max_residual == pytest.approx(0.0, abs=1e-9) and fit([1, 2], [1.0, 2.0]).max_residual is None


HOPPER_ENV = {
    "auto": "cudnn", "backends": ["auto", "sdpa", "flex", "varlen", "flash_attn", "cudnn", "fa4"],
    "kernels": {
        "auto": {"runs": True, "dispatch": ["aten::_scaled_dot_product_cudnn_attention"]},
        "sdpa": {"runs": True, "dispatch": ["aten::_scaled_dot_product_cudnn_attention"]},
        "flex": {"runs": None, "not_tried": "compiles cold"},
        "varlen": {"runs": True, "dispatch": ["torch_attn::_varlen_attn"]},
        "flash_attn": {"runs": False, "error": "ImportError: needs the flash-attn package"},
        "cudnn": {"runs": True, "dispatch": ["aten::_scaled_dot_product_cudnn_attention"]},
        "fa4": {"runs": False, "error": "ValueError: no flash-attn-4"},
    },
}


def test_variants_follow_auto_then_varlen_then_flex_and_skip_a_kernel_measured_already(monkeypatch):
    variants, left_out = plan_variants(HOPPER_ENV, "cuda")
    assert [v.name("cudnn") for v in variants] == [AUTO, SAVED, VARLEN, f"{AUTO} / no head chunks",
                                                   f"{AUTO} / FP8 rowwise", f"{AUTO} / host offload",
                                                   f"{AUTO} / disk tier", "flex / full AC"]
    assert left_out["sdpa"] == ("dispatches to the same kernel as auto (cudnn) "
                                "(aten::_scaled_dot_product_cudnn_attention): not measured twice")
    assert left_out["cudnn"].startswith("what `auto` runs here")
    assert left_out["flash_attn"] == "does not run here: ImportError: needs the flash-attn package"
    # Without the env piece's trials: auto's variants only (with and without head chunks), and the reason.
    variants, left_out = plan_variants({}, "cuda")
    assert [v.name() for v in variants] == ["auto / full AC", "auto / save_attention", "auto / full AC / no head chunks",
                                            "auto / full AC / FP8 rowwise", "auto / full AC / host offload",
                                            "auto / full AC / disk tier"]
    assert "which kernels run here is unknown" in left_out["other kernels"]
    # No torchao on the machine: the FP8 variant is left out with the reason, not failed.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    variants, left_out = plan_variants({}, "cuda")
    assert "FP8 rowwise" not in [v.label for v in variants] and "torchao is not installed" in left_out["FP8 rowwise"]


def test_an_extra_variant_goes_before_the_compiling_kernels(monkeypatch):
    import _gpu_perf_shape

    chunked = Variant("auto", argv=("--head-chunks", "4"), label="head chunks 4")
    monkeypatch.setattr(_gpu_perf_shape, "EXTRA_VARIANTS", (chunked,))
    variants, _ = plan_variants(HOPPER_ENV, "cuda")
    assert [v.name("cudnn") for v in variants][-2:] == ["auto (cudnn) / full AC / head chunks 4", "flex / full AC"]


def test_the_kit_prices_head_chunks_where_auto_runs_them():
    # At both GPU shapes `auto` resolves to one query head per chunk, so the kit's
    # "no head chunks" variant (the same kernel, --head-chunks 1) is the comparison that prices them.
    # On the CPU smoke run's tiny shapes it runs none, so the variant would repeat auto: left out.
    from _gpu_perf_common import SHAPES, TINY_SHAPES
    from _gpu_perf_shape import EXTRA_VARIANTS, auto_head_chunks

    assert [(v.kernel, v.argv) for v in EXTRA_VARIANTS] == [
        ("auto", ("--head-chunks", "1")), ("auto", ("--float8", "rowwise")), ("auto", ("--offload-activations",)),
        ("auto", ("--offload-activations", "--offload-dir", "{offload_dir}"))]
    assert {name: auto_head_chunks(shape) for name, shape in SHAPES.items()} == {"llama": 4, "qwen": 4}
    assert {name: auto_head_chunks(shape) for name, shape in TINY_SHAPES.items()} == {"llama": 1, "qwen": 1}
    variants, left_out = plan_variants(HOPPER_ENV, "cuda", auto_chunks=1)
    assert [v.name("cudnn") for v in variants] == [AUTO, SAVED, VARLEN, f"{AUTO} / FP8 rowwise",
                                                   f"{AUTO} / host offload", f"{AUTO} / disk tier", "flex / full AC"]
    assert left_out["no head chunks"].startswith("auto runs no head chunks at this shape")


def test_cost_model_scales_the_first_variant_by_layer_count():
    cost = CostModel()
    assert cost.estimate([1, 2]) is None
    cost.add(1, 20.0)
    assert cost.estimate([1, 2]) == pytest.approx(10.0 * 2 + 10.0 * 3)  # fixed part counted as one layer
    cost.add(2, 30.0)
    cost.add(4, 50.0)
    assert cost.estimate([1, 2]) == pytest.approx(50.0)


def test_malformed_records_do_not_stop_the_report(tmp_path):
    block, summary, rows = _report(tmp_path, [_plan(AUTO), {"kit": {"variant": AUTO}, "step_time": {}}])
    assert summary["shapes"]["qwen"]["no_result"].startswith("its records could not be read (KeyError")
    assert [r["verdict"][:41] for r in rows] == ["not measured: its records could not be re"]
    assert "### Targets" in block and "MET" not in block


def test_the_fp8_variant_reports_its_speedup_against_bf16_only_from_figures():
    from _gpu_perf_report import _fp8_speedup_lines

    def fig(step_s):
        return {"figures": {"compute_only": {"step_s": step_s}}, "error": None, "not_measured": None}

    shape = {"variants": {f"{AUTO}": fig(30.0), f"{AUTO} / FP8 rowwise": fig(20.0)}}
    assert _fp8_speedup_lines(shape) == [
        f"FP8: `{AUTO} / FP8 rowwise` runs a full-depth step 1.50x as fast as `{AUTO}` (bf16), compute only", ""]
    shape["variants"][f"{AUTO} / FP8 rowwise"] = {"figures": None, "error": None, "not_measured": "one layer count"}
    assert "not measured (each needs a figure from two layer counts)" in _fp8_speedup_lines(shape)[0]
    assert _fp8_speedup_lines({"variants": {AUTO: fig(30.0)}}) == []


def test_the_disk_tier_variant_runs_in_the_kits_disk_directory_and_is_priced_against_host_offload(monkeypatch):
    from _gpu_perf_report import _disk_lines, _disk_step_lines
    from _gpu_perf_shape import DISK_TIER, bench_argv

    monkeypatch.setenv("GPU_PERF_DISK_DIR", "/local/nvme/kit")
    shape = {"flavor": "debug", "local_seq": "64", "warmup": 1, "iters": 1, "overrides": [], "layers": 2}
    import torch

    argv = bench_argv(shape, torch.device("cuda"), "auto", [1, 2], save_attention=False, extra=DISK_TIER.argv)
    assert argv[argv.index("--offload-dir") + 1] == "/local/nvme/kit" and "--offload-activations" in argv

    def fig(step_s, peak):
        return {"figures": {"compute_only": {"step_s": step_s}, "peak_gib": peak}, "error": None, "not_measured": None}

    host, disk = f"{AUTO} / host offload", f"{AUTO} / disk tier"
    shape = {"variants": {AUTO: fig(10.0, 40.0), host: fig(20.0, 30.0), disk: fig(21.0, 30.5)}}
    assert _disk_step_lines(shape)[0] == (f"Disk tier: a full-depth step of `{disk}` takes 1.05x the time of `{host}` "
                                          "(the offloaded layer inputs in a file instead of host memory), compute "
                                          "only; peak 30.5 against 30.0 GiB")
    shape["variants"][disk] = {"figures": None, "error": None, "not_measured": "no time left"}
    assert "not measured (each needs a figure from two layer counts)" in _disk_step_lines(shape)[0]
    assert _disk_step_lines({"variants": {AUTO: fig(1.0, 1.0)}}) == []
    rec = {"bytes": 8 << 30, "layers": 16, "layer_bytes": 512 << 20, "device": "NVIDIA H100", "staging_bytes": 1 << 30,
           "directory": "/local/nvme/kit", "filesystem": "xfs", "free_bytes": 3 << 40, "write_gbps": 9.5,
           "write_sync_gbps": 2.9, "read_gbps": 3.1, "read_back_equal": True}
    lines = _disk_lines(rec, {"piece": "disk", "rc": 0})
    assert "8.00 GiB in 16 layers of 512 MiB from NVIDIA H100 through a 1024 MiB staging area" in lines[2]
    assert lines[-2] == "| 9.50 GB/s | 2.90 GB/s | 3.10 GB/s | yes |"
    assert "No result: " in _disk_lines(None, {"piece": "disk", "rc": 124, "seconds": 20, "limit": 20})[2]
