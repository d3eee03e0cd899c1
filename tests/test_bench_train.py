"""The training-step benchmark in its quick modes: JSON fields, exact bytes, labels.

Runs ``benchmarks/bench_train.py --quick`` as subprocesses:

* ``--mode real`` spawns gloo ranks (sp 1 and 2, full activation
  checkpointing, so the recomputed forward exchange is in the count);
* ``--mode simulate`` runs one process as rank 0 of a fake world of 4
  (sp 4), where communication is skipped and modelled, at 2 and 3 layers,
  plus the record extrapolated from them to 6 layers.

Checks: one JSON object per configuration with the documented fields; the
all-to-all bytes counted on a real step equal ``n_layers x
exchange_bytes_per_rank`` plus one more forward exchange per recomputed
block; modelled figures labelled with the bandwidths used and equal to the
measured compute time plus bytes / bandwidth; tokens/s equal to tokens per
step over the median step time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ulysses_dtensor.models.llama import Llama, llama_args
from ulysses_dtensor.parallel.ulysses import exchange_bytes_per_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_train.py")

# The real mode also exercises host-offloaded parameters (FSDP2 CPU offload).
REAL_ARGS = ("--mode", "real", "--ac", "full", "--offload-params")
SIM_ARGS = ("--mode", "simulate", "--link-gbps", "100", "--latency-us", "5",
            "--layers", "2", "3", "--extrapolate-layers", "6")


def _run(args: tuple[str, ...], timeout: float = 120) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # stdout is JSON lines only


@pytest.fixture(scope="module")
def records() -> dict[str, list[dict]]:
    # Both modes at once: the real ranks and the simulating process overlap.
    with ThreadPoolExecutor(2) as pool:
        real = pool.submit(_run, REAL_ARGS)
        sim = pool.submit(_run, SIM_ARGS)
        return {"real": real.result(), "simulate": sim.result()}


def _expected_a2a(cfg: dict, full_ac: bool) -> int:
    m, sp = cfg["model"], cfg["mesh"]["sp"]
    shape = (cfg["batch"], cfg["seq"], m["n_heads"], m["n_kv_heads"], m["head_dim"], sp, 4)
    per_layer = exchange_bytes_per_rank(*shape)
    forward = exchange_bytes_per_rank(*shape, backward=False)
    assert per_layer == 2 * forward
    # full AC recomputes every block's forward in backward, all-to-alls included
    return m["n_layers"] * (per_layer + (forward if full_ac else 0))


def _check_timed_steps(rec: dict) -> None:
    """Each timed step's loss share and gradient norm, finite."""
    ts = rec["timed_steps"]
    assert len(ts["loss"]) == len(ts["grad_norm"]) == rec["config"]["iters"]
    assert ts["finite"] is True and all(x > 0 for x in ts["loss"] + ts["grad_norm"])


def _check_common(rec: dict, mode: str) -> None:
    for key in ("device", "device_type", "torch", "date", "config", "step_time", "figures",
                "memory", "all_to_all", "fsdp", "flops_per_token"):
        assert key in rec, key
    assert rec["bench"] == "train" and rec["mode"] == mode
    cfg = rec["config"]
    assert cfg["flavor"] == "debug" and cfg["dtype"] == "float32"
    assert cfg["tokens_per_step"] == cfg["batch"] * cfg["seq"] * cfg["mesh"]["dp_replicate"] * cfg["mesh"]["dp_shard"]
    assert cfg["tokens_per_rank"] == cfg["batch"] * cfg["seq"] // cfg["mesh"]["sp"]
    st = rec["step_time"]
    assert st["n"] == cfg["iters"] == len(st["times_ms"]) and st["median_ms"] > 0
    # FLOPs per token: the model's own formula at the full sequence length
    with torch.device("meta"):
        model = Llama(llama_args("debug", n_layers=cfg["model"]["n_layers"]))
    assert rec["flops_per_token"] == model.flops_per_token(cfg["seq"])
    assert rec["peak_flops"] is None and rec["figures"]["mfu"] is None  # CPU: no peak
    _check_timed_steps(rec)
    mem = rec["memory"]
    assert mem["resident_bytes"] > 0 and mem["step_peak_bytes"] > 0
    assert mem["peak_bytes"] == mem["resident_bytes"] + mem["step_peak_bytes"]
    # counted all-to-all bytes == formula, AC recompute included
    a2a = rec["all_to_all"]
    expected = _expected_a2a(cfg, cfg["ac"] == "full")
    assert a2a["expected_sent_bytes_per_rank"] == expected
    assert a2a["sent_bytes_per_rank"] == expected and a2a["bytes_match"] is True
    if cfg["mesh"]["sp"] > 1:
        # 4 exchanges (q, k, v, out) forward + 4 backward per layer, +4 per recomputed layer
        n_layers = cfg["model"]["n_layers"]
        assert a2a["calls"] == 4 * (2 * n_layers + (n_layers if cfg["ac"] == "full" else 0))
        assert a2a["ac_factor"] == (1.5 if cfg["ac"] == "full" else 1.0)
        # FSDP2 traffic counted: parameters gathered, gradients reduce-scattered
        assert rec["fsdp"]["calls"]["all_gather"] > 0 and rec["fsdp"]["calls"]["reduce_scatter"] > 0
    else:
        assert a2a["calls"] == 0 and expected == 0


def _check_throughput(fig: dict, cfg: dict, step_ms: float) -> None:
    seconds = step_ms / 1e3
    assert fig["step_ms"] == pytest.approx(step_ms, rel=1e-4)
    assert fig["tokens_per_s"] == pytest.approx(cfg["tokens_per_step"] / seconds, rel=1e-4)
    assert fig["tokens_per_s_per_device"] == pytest.approx(cfg["tokens_per_rank"] / seconds, rel=1e-4)
    world = cfg["mesh"]["dp_replicate"] * cfg["mesh"]["dp_shard"] * cfg["mesh"]["sp"]
    assert fig["tokens_per_s"] == pytest.approx(fig["tokens_per_s_per_device"] * world, rel=1e-4)


def test_real_mode(records):
    recs = records["real"]
    assert [r["config"]["mesh"]["sp"] for r in recs] == [1, 2]
    for rec in recs:
        _check_common(rec, "real")
        assert rec["config"]["ac"] == "full" and rec["config"]["offload_params"] is True
        assert rec["world_size"] == rec["processes"] == rec["config"]["mesh"]["sp"]
        assert rec["communication"] == "real (gloo)"
        fig = rec["figures"]
        assert fig["modelled"] is False
        _check_throughput(fig, rec["config"], rec["step_time"]["median_ms"])
        if rec["world_size"] > 1:
            assert rec["memory"]["max_over_ranks_peak_bytes"] >= rec["memory"]["peak_bytes"]
        # all-to-all time per timed step and its share of the step (none at sp 1)
        ex = rec["exchange"]
        assert ex["measured"] is True and len(ex["shares"]) == rec["config"]["iters"]
        if rec["config"]["mesh"]["sp"] == 1:
            assert ex["calls_per_step"] == 0 and ex["share_of_step"] == 0.0
        else:
            assert ex["calls_per_step"] == rec["all_to_all"]["calls"]
            assert 0.0 < ex["share_of_step"] < 1.0 and ex["median_ms"] > 0


def _check_modelled(rec: dict) -> None:
    """Modelled figures: labelled, and compute + bytes / bandwidth + calls x latency."""
    fig = rec["figures"]
    assert fig["modelled"] is True
    assert fig["link_gbps"] == 100.0 and fig["fsdp_gbps"] == 100.0 and fig["latency_us"] == 5.0
    assert any("all-to-all" in s for s in fig["assumptions"])
    assert any("FSDP" in s for s in fig["assumptions"])
    a2a, fsdp = rec["all_to_all"], rec["fsdp"]
    a2a_ms = (a2a["sent_bytes_per_rank"] / 100e9 + a2a["calls"] * 5e-6) * 1e3
    fsdp_ms = (sum(fsdp["sent_bytes_per_rank"].values()) / 100e9 + sum(fsdp["calls"].values()) * 5e-6) * 1e3
    assert a2a_ms > 0 and fsdp_ms > 0
    assert fig["all_to_all_ms"] == pytest.approx(a2a_ms, abs=1e-4)
    assert fig["fsdp_ms"] == pytest.approx(fsdp_ms, abs=1e-4)
    assert fig["compute_ms"] == pytest.approx(rec["step_time"]["median_ms"], abs=1e-4)
    modelled_ms = fig["compute_ms"] + fig["all_to_all_ms"] + fig["fsdp_ms"]
    _check_throughput(fig, rec["config"], modelled_ms)
    assert fig["step_ms_fsdp_overlapped"] == pytest.approx(fig["compute_ms"] + fig["all_to_all_ms"], abs=1e-3)
    assert fig["tokens_per_s_per_device"] < rec["compute_only"]["tokens_per_s_per_device"]


def test_simulate_mode(records):
    recs = records["simulate"]
    measured = [r for r in recs if "extrapolated" not in r]
    assert [r["config"]["model"]["n_layers"] for r in measured] == [2, 3]
    for rec in measured:
        _check_common(rec, "simulate")
        # Every collective of the step had its output written (none the table does not know):
        # the Ulysses all-to-alls (4 forward + 4 backward per layer), FSDP's gathers and reduces.
        coll = rec["collectives"]
        assert coll["outputs"] == "defined" and coll["unknown"] == {}
        steps = rec["config"]["warmup"] + rec["config"]["iters"] + 1  # + the CPU's profiled memory step
        assert coll["written"]["_c10d_functional::all_to_all_single"] == steps * rec["all_to_all"]["calls"]
        assert coll["written"]["c10d::_allgather_base_"] > 0 and coll["written"]["c10d::_reduce_scatter_base_"] > 0
        assert rec["world_size"] == 4 and rec["processes"] == 1
        assert rec["config"]["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "sp": 4}
        assert "skipped" in rec["communication"]
        # the measured, communication-free step
        comp = rec["compute_only"]
        assert comp["modelled"] is False
        _check_throughput(comp, rec["config"], rec["step_time"]["median_ms"])
        _check_modelled(rec)


def test_simulate_extrapolated(records):
    recs = records["simulate"]
    measured = {r["config"]["model"]["n_layers"]: r for r in recs if "extrapolated" not in r}
    (rec,) = [r for r in recs if "extrapolated" in r]
    assert recs[-1] is rec  # after the runs it is fitted from
    ex = rec["extrapolated"]
    assert ex["modelled"] is True and ex["n_layers"] == 6 and ex["from_n_layers"] == [2, 3]
    cfg = rec["config"]
    assert cfg["model"]["n_layers"] == 6
    assert rec["compute_only"]["modelled"] is True  # a fit, not a measurement
    # two points: the line through them, at 6 layers
    t2, t3 = (measured[n]["step_time"]["median_ms"] for n in (2, 3))
    assert rec["step_time"]["median_ms"] == pytest.approx(t2 + 4 * (t3 - t2), abs=1e-3)
    fit = ex["fit"]  # the line itself: step = intercept + ms_per_layer x layers; no residual from 2 points
    assert fit["ms_per_layer"] == pytest.approx(t3 - t2, abs=1e-3)
    assert fit["intercept_ms"] + 6 * fit["ms_per_layer"] == pytest.approx(rec["step_time"]["median_ms"], abs=1e-3)
    assert fit["max_residual_ms"] == pytest.approx(0, abs=1e-3)
    # all-to-all bytes: the exact formula at 6 layers; calls: 8 per layer
    assert rec["all_to_all"]["sent_bytes_per_rank"] == _expected_a2a(cfg, False)
    assert rec["all_to_all"]["bytes_match"] is None and rec["all_to_all"]["calls"] == 8 * 6
    with torch.device("meta"):
        model = Llama(llama_args("debug", n_layers=6))
    assert rec["flops_per_token"] == model.flops_per_token(cfg["seq"])
    assert cfg["model"]["params"] == model.num_params()
    _check_modelled(rec)


def test_save_attention_flag_needs_full_ac(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_train

    base = ["--mode", "simulate", "--quick"]
    with pytest.raises(SystemExit):
        bench_train.parse_args([*base, "--save-attention"])
    assert "--save-attention needs --ac full" in capsys.readouterr().err
    assert bench_train.parse_args([*base, "--ac", "full", "--save-attention"]).save_attention


def test_define_output_copies_gathers_and_scatters():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from _simulated_collectives import define_output

    inp = torch.arange(6.0)
    out = torch.full((2, 3), float("nan"))
    define_output(out, inp)  # all-to-all: this rank's own data
    assert out.flatten().tolist() == inp.tolist()
    out = torch.full((18,), float("nan"))
    define_output(out, inp)  # all-gather: the input once per rank
    assert out.tolist() == inp.tolist() * 3
    gathered = torch.full((12,), float("nan"))
    gathered[6:].copy_(inp)
    define_output(gathered, gathered[6:])  # gathered in place (FSDP2): its input is a block of the output
    assert gathered.tolist() == inp.tolist() * 2
    out = torch.full((2,), float("nan"))
    define_output(out, inp)  # reduce-scatter: the first slice (rank 0 of the group)
    assert out.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="neither a copy, a gather nor a scatter"):
        define_output(torch.empty(4), inp)


def test_a_simulated_step_computes_on_defined_collective_outputs():
    # torch 2.11's fake process group leaves all-to-all, all-gather and reduce-scatter outputs
    # as allocated; UndefinedCollectives does that here (NaN) on a torch that copies. Without
    # DefinedCollectives the step's loss and gradient norm turn NaN; with it they are finite.
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_train
    from _simulated_collectives import UndefinedCollectives

    from ulysses_dtensor.parallel.mesh import ParallelDims

    a = bench_train.parse_args(["--mode", "simulate", "--quick", "--warmup", "1", "--iters", "1", "--ac", "full"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        pmesh = ParallelDims(dp_replicate=1, dp_shard=-1, sp=4, world_size=4).build_mesh("cpu")
        args = bench_train.model_args(a, 1)
        cpu = torch.device("cpu")
        with UndefinedCollectives():
            stale = bench_train.measure(a, args, pmesh, cpu, 64, simulate=True, define_collectives=False)
            defined = bench_train.measure(a, args, pmesh, cpu, 64, simulate=True)
    finally:
        dist.destroy_process_group()
    assert not any(math.isfinite(x) for x in stale["timed_steps"]["loss"] + stale["timed_steps"]["grad_norm"])
    assert stale["collectives"]["outputs"].startswith("as the fake process group leaves them")
    assert all(math.isfinite(x) and x > 0 for x in defined["timed_steps"]["loss"] + defined["timed_steps"]["grad_norm"])
    assert defined["collectives"]["outputs"] == "defined" and defined["collectives"]["unknown"] == {}


def test_cpu_clock_times_cpu_seconds_on_the_cpu_only(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_train

    base = ["--mode", "simulate", "--quick"]
    with pytest.raises(SystemExit):
        bench_train.parse_args([*base, "--device", "cuda", "--cpu-clock"])
    assert "--cpu-clock times CPU seconds: it needs --device cpu" in capsys.readouterr().err
    assert bench_train.parse_args([*base, "--device", "cpu", "--cpu-clock"]).cpu_clock
