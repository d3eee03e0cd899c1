"""The memory planner: planned peaks against real CPU steps, feature savings, the CLI.

Accuracy: the same configs run for real on gloo ranks (real tensors, the
trainer's build_model / AdamW / train_step). Rank 0's peak is measured twice:
by the allocator itself (the PyTorch profiler's alloc/free events, a running
sum from before the model exists; independent of the planner's dispatch-mode
tracker) and by FSDPMemTracker on the real tensors. The planner (fake process
group, fake tensors) must land within 10% of the allocator's figure.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distributed import release_task_state, run_ranks
from script_module import load_script

from ulysses_dtensor.estimate import GIB, find_max_seq_len, plan_memory
from ulysses_dtensor.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]

# name -> (world, config overrides, seq_len). Debug flavor, widened a little so
# activations and parameters are both well above the allocator's noise.
BASE = [
    "--model.flavor", "debug", "--model.dim", "128", "--model.ffn_dim", "384",
    "--model.vocab_size", "1024", "--model.n_layers", "2",
    "--training.global_batch_size", "1", "--data.max_corpus_mb", "0.1",
]
ACCURACY_CASES = {
    "w1_noac": (1, ["--parallelism.sp", "1"], 1024),
    "w2_sp2_noac": (2, ["--parallelism.sp", "2"], 2048),
    "w2_sp2_fullac": (2, ["--parallelism.sp", "2", "--activation_checkpoint.mode", "full"], 2048),
    "w2_sp2_all": (2, ["--parallelism.sp", "2", "--activation_checkpoint.mode", "full",
                       "--memory.tiled_mlp", "true", "--memory.mlp_tiles", "8",
                       "--memory.tiled_loss", "true", "--memory.loss_chunks", "4",
                       "--memory.offload_activations", "true"], 2048),
    "w2_sp2_offload_params": (2, ["--parallelism.sp", "2", "--memory.offload_params", "true"], 2048),
    "w2_sp2_save_attention": (2, ["--parallelism.sp", "2", "--activation_checkpoint.mode", "full",
                                  "--activation_checkpoint.save_attention", "true"], 2048),
    # Head chunks: the exchange and the kernel a query head at a time (8 heads, 4 kv heads: 4 and 2
    # per rank, a kv head's k/v exchanged once for its two chunks).
    "w2_sp2_head_chunks": (2, ["--parallelism.sp", "2", "--activation_checkpoint.mode", "full",
                               "--memory.head_chunks", "4"], 2048),
    # FP8 linear layers (torchao, emulated on CPU: the step's casts, scales and FP8 copies are traced
    # as they run; tests/test_estimate_float8.py plans the GPU's own FP8 matmuls).
    "w2_sp2_float8": (2, ["--parallelism.sp", "2", "--activation_checkpoint.mode", "full",
                          "--float8.enable", "true", "--float8.emulate", "true"], 2048),
    "w2_dp2_bf16": (2, ["--parallelism.sp", "1", "--parallelism.dp_shard", "2",
                        "--training.global_batch_size", "2",
                        "--training.mixed_precision_param", "bfloat16"], 1024),
}


def _cfg(extra: list[str], seq_len: int):
    return load_config(BASE + extra + ["--training.seq_len", str(seq_len)])


# --------------------------------------------------------------------------- #
# Real steps
# --------------------------------------------------------------------------- #


class _AllocatorLog:
    """Live bytes of the CPU allocator over time, from the profiler's alloc/free events.

    ``profile_memory=True`` records every allocation and free (with its size)
    made by torch's CPU allocator, including those made inside kernels, which
    no dispatch mode sees. Live bytes = blocks allocated by the thread that
    runs the step and not yet freed (by any thread); one profiling session
    spans every measured step so that every free is paired with its
    allocation. Blocks that gloo's worker threads allocate are left out: their
    scratch buffers are an artifact of running collectives on CPU (NCCL keeps
    its own, non-torch buffers). Marker tensors of odd sizes delimit regions.
    """

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._next = 7_777_001

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)

    def mark(self) -> int:
        size, self._next = self._next, self._next + 2
        torch.empty(size, dtype=torch.uint8)  # allocated and freed at once
        return size

    def levels(self) -> list[tuple[int, int]]:
        """(event size, live bytes after it) on the step's thread, in order."""
        alloc = torch._C._profiler._EventType.Allocation
        events, stack = [], list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == alloc and node.extra_fields.device.type == "cpu":
                f = node.extra_fields
                # Same timestamp: an allocation before the free of the same block.
                events.append((node.start_time_ns, f.allocation_id, f.alloc_size < 0,
                               f.alloc_size, f.ptr, node.start_tid))
        events.sort()
        main = next(e[5] for e in events if e[3] == 7_777_001)
        live: dict[int, int] = {}
        level, out = 0, []
        for _, _, _, size, ptr, tid in events:
            # Blocks the step's thread allocated, wherever they are freed (a
            # collective's buffers can be released by a gloo thread).
            if size > 0 and tid == main:
                live[ptr] = size
                level += size
            elif size < 0 and ptr in live:
                level -= live.pop(ptr)
            else:
                continue
            out.append((size, level))
        return out

    @staticmethod
    def level_after(levels, marker: int) -> int:
        """Live bytes right after ``marker`` was freed."""
        for size, level in levels:
            if size == -marker:
                return level
        raise AssertionError(f"marker {marker} not in the profile")

    @staticmethod
    def peak_between(levels, start: int, end: int) -> int:
        peak, inside = None, False
        for size, level in levels:
            if size == -start:
                inside, peak = True, level
            elif inside and size == end:
                return peak
            elif inside:
                peak = max(peak, level)
        raise AssertionError("markers not in the profile")


def measure_real_steps(cases: list, world: int, allocator: bool = True, tracker: bool = True) -> list[dict]:
    """Rank-local peak of a steady-state training step for each (cfg) on real CPU tensors.

    Runs in a process with a gloo group of ``world`` ranks. For each config:
    the allocator's peak over the second step (relative to the live bytes
    before the model was built) and FSDPMemTracker's peak over a third step.
    Each figure costs a profiled or tracked step: ask only for those you use.
    """
    import gc

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from ulysses_dtensor.parallel.loss import count_valid_tokens
    from ulysses_dtensor.trainer.build import build_model
    from ulysses_dtensor.trainer.config import validate_config
    from ulysses_dtensor.trainer.step import build_optimizer, train_step

    log = _AllocatorLog() if allocator else contextlib.nullcontext()
    marks, trackers = [], []
    with log:
        for cfg in cases:
            dims = validate_config(cfg, world)
            torch.manual_seed(0)
            pmesh = dims.build_mesh("cpu")
            s_local = cfg.training.seq_len // dims.sp
            rows = cfg.training.global_batch_size // dims.dp
            vocab = cfg.model.vocab_size
            gc.collect()
            base = log.mark() if allocator else None
            model = build_model(cfg, pmesh, vocab, torch.device("cpu"))
            optimizer = build_optimizer(cfg, model, foreach=False)
            g = torch.Generator().manual_seed(1 + pmesh.dp_rank)
            batch = {
                "input_ids": torch.randint(0, vocab, (rows, s_local), generator=g),
                "labels": torch.randint(0, vocab, (rows, s_local), generator=g),
                "position_ids": (torch.arange(s_local) + pmesh.sp_rank * s_local).repeat(rows, 1),
                "document_ids": None,
            }
            n_valid = count_valid_tokens(batch["labels"], pmesh.loss)

            def step():
                train_step(model, optimizer, batch, n_valid, max_norm=1.0, lr=1e-3)

            step()  # creates the optimizer state
            if allocator:
                gc.collect()  # what reference cycles of the first step hold is not the step's
                start = log.mark()
                step()
                marks.append((base, start, log.mark()))
            if tracker:
                mem = FSDPMemTracker(model, optimizer)
                mem.track_inputs((batch["input_ids"], batch["labels"], batch["position_ids"]))
                with mem:
                    step()
                trackers.append(mem.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
                del mem
            del model, optimizer, batch, step
    out = [{} for _ in cases]
    if allocator:
        events = log.levels()
        for r, (base, start, end) in zip(out, marks):
            r["allocator"] = log.peak_between(events, start, end) - log.level_after(events, base)
    for r, tracked in zip(out, trackers):
        r["tracker"] = tracked
    return out


def _real_worker(rank, world, names, out_path):
    torch.set_num_threads(1)
    cases = []
    for name in names:
        w, extra, seq = ACCURACY_CASES[name]
        assert w == world
        cases.append(_cfg(extra, seq))
    results = dict(zip(names, measure_real_steps(cases, world, allocator=False)))
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def _in_process_gloo_world_of_one(fn, *args) -> None:
    """``fn(0, 1, *args)`` in this process on a gloo group of one rank.

    Spawning a pool of one costs an interpreter and its imports (seconds on 2
    cores) for what this process can run itself; what torch keeps of it after
    the group is gone is dropped as the pool does between tasks.
    """
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    threads = torch.get_num_threads()
    try:
        fn(0, 1, *args)
    finally:
        dist.destroy_process_group()
        release_task_state()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def real_peaks():
    """Measured peaks of every accuracy case.

    ``gloo``: the real step on gloo ranks (the pooled ranks; a world of one
    in this process): the FSDPMemTracker figure on real tensors. ``alloc``: the
    allocator's figure for the same step on real tensors in this process, with
    the ``fake`` process group standing in for the other ranks (collectives
    then move no data but allocate their outputs as usual). The allocator is
    not read on gloo: a block the step allocates but a gloo thread frees is
    invisible to the profiler, so it would look alive.
    """
    import ulysses_dtensor.estimate.trace as est

    out = {name: {} for name in ACCURACY_CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({w for w, _, _ in ACCURACY_CASES.values()}):
            names = [n for n, (w, _, _) in ACCURACY_CASES.items() if w == world]
            path = os.path.join(tmp, f"w{world}.json")
            if world == 1:
                _in_process_gloo_world_of_one(_real_worker, names, path)
            else:
                run_ranks(world, _real_worker, names, path)
            for name, r in json.loads(Path(path).read_text()).items():
                out[name]["gloo"] = r
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (world, extra, seq) in ACCURACY_CASES.items():
            with est._fake_world(world):
                out[name]["alloc"] = measure_real_steps([_cfg(extra, seq)], world, tracker=False)[0]
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("name", list(ACCURACY_CASES))
def test_planned_peak_matches_a_real_step(name, real_peaks):
    world, extra, seq = ACCURACY_CASES[name]
    plan = plan_memory(_cfg(extra, seq), world, device="cpu")
    m = real_peaks[name]
    mib = 2**20
    print(
        f"{name}: planned {plan.peak_bytes / mib:.2f} MiB | allocator, real tensors "
        f"{m['alloc']['allocator'] / mib:.2f} | gloo step: tracker on real tensors "
        f"{m['gloo']['tracker'] / mib:.2f}"
    )
    assert 0.9 <= plan.peak_bytes / m["alloc"]["allocator"] <= 1.1, (name, plan.peak_bytes, m)
    assert 0.9 <= plan.peak_bytes / m["gloo"]["tracker"] <= 1.1, (name, plan.peak_bytes, m)


# --------------------------------------------------------------------------- #
# Each memory feature removes what it is meant to remove
# --------------------------------------------------------------------------- #

FEAT_LAYERS = 2  # every saving below is per block: two show it at half the tracing of four
FEAT = [
    "--model.flavor", "debug", "--model.dim", "64", "--model.ffn_dim", "256",
    "--model.vocab_size", "2048", "--model.n_layers", str(FEAT_LAYERS),
    "--training.global_batch_size", "1", "--parallelism.sp", "2",
]
FEAT_SEQ = 4096


@functools.cache  # the tests below share their baselines (a plan is seconds of tracing)
def _plan(*extra: str, world: int = 2, device: str = "cpu"):
    return plan_memory(load_config(FEAT + list(extra)), world, FEAT_SEQ, device=device)


def test_tiled_mlp_removes_the_ffn_intermediates():
    off = _plan()  # tiled_mlp off by default
    on = _plan("--memory.tiled_mlp", "true", "--memory.mlp_tiles", "8")
    tokens, ffn, layers = FEAT_SEQ // 2, 256, FEAT_LAYERS
    unit = layers * tokens * ffn * 4  # one (tokens, ffn_dim) fp32 tensor per block
    saved = off.saved_activation_bytes - on.saved_activation_bytes
    # SwiGLU w2(silu(w1 x) * w3 x) keeps w1 x, silu(w1 x), w3 x and their
    # product for backward: 4 per block; tiled, one tile's worth (1/8) is
    # recomputed at a time and nothing of it is kept.
    assert 3.5 <= saved / unit <= 4.0, saved / unit
    assert on.peak_bytes < off.peak_bytes


def test_tiled_loss_removes_the_logits():
    off = _plan()  # tiled_loss off by default
    on = _plan("--memory.tiled_loss", "true", "--memory.loss_chunks", "8")
    tokens, vocab = FEAT_SEQ // 2, 2048
    unit = tokens * vocab * 4  # the fp32 (tokens, vocab) logits
    # Kept for backward: the log-softmax of the logits (1 unit); at the peak,
    # the logits' gradient and the log-softmax's are alive as well.
    saved = off.saved_activation_bytes - on.saved_activation_bytes
    assert 0.85 <= saved / unit <= 1.1, saved / unit
    drop = off.peak_bytes - on.peak_bytes
    assert 1.7 <= drop / unit <= 3.1, drop / unit
    assert off.kinds.get("logits", 0) >= 1.7 * unit


def test_offload_moves_the_block_inputs_to_the_host():
    # Planned for CUDA: on a CPU-only trainer "host" and device memory are one.
    off = _plan("--activation_checkpoint.mode", "full", device="cuda")
    on = _plan("--activation_checkpoint.mode", "full", "--memory.offload_activations", "true", device="cuda")
    tokens, dim, layers = FEAT_SEQ // 2, 64, FEAT_LAYERS
    block_input = tokens * dim * 4
    saved = off.saved_activation_bytes - on.saved_activation_bytes
    # Full AC keeps each block's input; offload keeps them on the host.
    assert 0.95 <= saved / (layers * block_input) <= 1.05, saved / (layers * block_input)
    assert on.host_bytes == layers * block_input
    assert off.host_bytes == 0


FULL = ("--activation_checkpoint.mode", "full")
SAVE = (*FULL, "--activation_checkpoint.save_attention", "true")


def test_save_attention_plans_between_full_and_selective_ac():
    full, save, selective = _plan(*FULL), _plan(*SAVE), _plan("--activation_checkpoint.mode", "selective")
    assert full.features["save_attention"] is False and save.features["save_attention"] is True
    # Each layer keeps its attention kernel's output (1, heads/sp, S, head_dim) and log-sum-exp
    # (1, heads/sp, S), fp32 (debug: 8 heads of 8 at dim 64): all of them alive when backward starts.
    heads, head_dim, layers = 8 // 2, 64 // 8, FEAT_LAYERS
    kept = layers * heads * FEAT_SEQ * (head_dim + 1) * 4
    assert save.kinds["attention"] == kept and "attention" not in full.kinds
    assert save.peak_bytes - full.peak_bytes == kept
    # Selective op AC keeps the same kernel outputs, the exchanged tensors and half the matmuls.
    assert full.peak_bytes < save.peak_bytes < selective.peak_bytes
    # Offloaded (planned for CUDA), the kept outputs go to the host with the layer inputs.
    off = _plan(*FULL, "--memory.offload_activations", "true", device="cuda")
    save_off = _plan(*SAVE, "--memory.offload_activations", "true", device="cuda")
    assert save_off.peak_bytes == off.peak_bytes
    assert save_off.host_bytes - off.host_bytes == kept


# A model whose attention working set is large beside the rest (8 heads of 32, 2 kv heads).
ATTN_HEAVY = [
    "--model.flavor", "debug", "--model.dim", "256", "--model.ffn_dim", "256", "--model.n_heads", "8",
    "--model.n_kv_heads", "2", "--model.vocab_size", "512", "--model.n_layers", "2",
    "--training.mixed_precision_param", "bfloat16", "--training.global_batch_size", "1", "--parallelism.sp", "2",
    *FULL, "--memory.tiled_mlp", "true", "--memory.tiled_loss", "true", "--memory.offload_activations", "true",
]


def test_head_chunks_are_planned_and_chosen_where_they_pay():
    """The planner traces what the trainer runs: with no count named (0) it plans the chunks the
    trainer chooses -- here one query head per chunk, as one layer's exchanged attention tensors
    exceed 1 GiB per rank (1,280 bytes a token, 1M tokens) -- and they lower the planned peak of
    this attention-bound step (below the bound the count is 1: tests/test_head_chunks.py)."""
    def plan(chunks: str):
        return plan_memory(load_config(ATTN_HEAVY + ["--memory.head_chunks", chunks]), 2, 1048576, device="cuda")

    one, auto = plan("1"), plan("0")
    assert auto.peak_bytes < one.peak_bytes
    # Each chunk calls the kernel the target GPU runs (cuDNN on an H100) for its heads: 4 chunks per
    # layer and forward (the forward and its recompute, two layers), against one call unchunked.
    assert [(a["kernel"], a["calls"]) for a in auto.attention] == [("cudnn", 4 * 2 * 2)]
    assert [(a["kernel"], a["calls"]) for a in one.attention] == [("cudnn", 2 * 2)]


def test_offload_params_moves_the_parameter_state_to_the_host():
    # Planned for CUDA (on a CPU trainer host and device memory are one).
    bf16 = ("--training.mixed_precision_param", "bfloat16")
    off = _plan(*bf16, device="cuda")
    on = _plan(*bf16, "--memory.offload_params", "true", device="cuda")
    state = ("Sharded Param", "Sharded Grad", "OptState")
    assert not any(c in on.breakdown for c in state), on.breakdown
    shards = off.breakdown["Sharded Param"]  # fp32 masters, this rank's shard
    # AdamW keeps two fp32 moments per parameter; the gradients are as large.
    assert on.host_bytes >= 4 * shards
    # The device keeps neither the shards nor the moments, but gains the
    # staging copy of the largest group: final norm + output head, halved by sp 2.
    staging = on.breakdown["offload_staging"]
    assert staging == (64 + 2048 * 64) * 4 // 2
    assert on.peak_bytes <= off.peak_bytes - shards - off.breakdown["OptState"] + staging
    assert on.peak_bytes >= off.peak_bytes - off.state_bytes
    # Clipping and the AdamW step run on the host: no device peak of their own.
    assert on.phase_peaks["optimizer"] <= on.phase_peaks["backward"]
    assert sum(on.breakdown.values()) == on.peak_bytes


def test_extrapolated_plan_equals_the_full_trace():
    cfg = load_config(FEAT + ["--model.n_layers", "9", "--activation_checkpoint.mode", "full"])
    full = plan_memory(cfg, 2, FEAT_SEQ, device="cpu", layers="full")
    ext = plan_memory(cfg, 2, FEAT_SEQ, device="cpu", layers="extrapolate")
    assert ext.trace["extrapolated"] and ext.trace["layers_traced"] == [4, 5, 6]
    assert abs(ext.peak_bytes - full.peak_bytes) <= 1e-3 * full.peak_bytes
    assert ext.peak_phase == full.peak_phase


def test_foreach_adamw_over_sharded_params_costs_one_state_copy():
    # Regression for the fake-mode artifact: DTensor's shape propagation once
    # counted global-shape tensors, giving foreach several times the real state.
    # Four blocks: the per-parameter loop's one-parameter peak must stay small next to all of them.
    small = FEAT + ["--training.seq_len", "64", "--model.n_layers", "4"]
    cfg = load_config(small)
    f = plan_memory(cfg, 4, 64, rows=1, device="cpu", foreach=True)
    nf = plan_memory(cfg, 4, 64, rows=1, device="cpu", foreach=False)
    params = f.breakdown["Sharded Param"]  # fp32 local shards
    # Temporaries of the step above what lives on after it (params, grads, state).
    extra_f = f.phase_peaks["optimizer"] - f.phase_peaks["zero_grad"]
    extra_nf = nf.phase_peaks["optimizer"] - nf.phase_peaks["zero_grad"]
    # foreach: sqrt(exp_avg_sq) of all local params at once, one fp32 copy of
    # the LOCAL shards (the artifact gave world-size times more); the
    # per-parameter loop holds one parameter's worth at a time.
    assert 0.95 <= extra_f / params <= 1.05, extra_f / params
    assert extra_nf < 0.6 * params


@pytest.mark.parametrize("private", [True, False])
def test_dtensor_shape_propagation_is_not_counted(private):
    # Why estimate/trace.py gives DTensor's shape propagation its own fake mode: in
    # the planner's fake mode, DTensor runs each op once more on fake tensors
    # of the GLOBAL shape to learn the output's metadata, and the tracker
    # counted those as allocations (AdamW foreach over FSDP shards "peaked" at
    # several times the real state). Fresh shapes, so DTensor's cache misses.
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ulysses_dtensor.estimate.trace as est

    world, rows = 4, 1237 + (0 if private else 1)
    with est._fake_world(world):
        mesh = init_device_mesh("cpu", (world,))
        isolate = est._private_sharding_prop_fake_mode() if private else contextlib.nullcontext()
        with FakeTensorMode(allow_non_fake_inputs=True), isolate:
            local = torch.empty(rows, 64)
            d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            tracker = MemTracker()
            tracker.track_external(local)
            with tracker:
                out = torch._foreach_sqrt([d, d])
            del out
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    local_bytes = rows * 64 * 4
    if private:
        assert peak == 3 * local_bytes  # the input and two local outputs
    else:
        assert peak >= 3 * local_bytes + 2 * world * local_bytes  # + global-shape fakes


def test_plan_reports_categories_that_sum_to_the_peak():
    plan = _plan("--activation_checkpoint.mode", "full", device="cuda")
    assert sum(plan.breakdown.values()) == plan.peak_bytes
    for key in ("Sharded Param", "OptState"):
        assert plan.breakdown.get(key, 0) > 0
    assert plan.peak_phase in plan.phase_peaks


# --------------------------------------------------------------------------- #
# CLI and search
# --------------------------------------------------------------------------- #


def _cli(capsys, *args: str):
    """``python -m ulysses_dtensor.estimate ARGS`` in this process: (exit code, stdout, stderr)."""
    from ulysses_dtensor.estimate.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_the_breakdown(capsys):
    code, out, err = _cli(capsys, "--config", str(ROOT / "train_configs/debug_model.toml"), "--world-size", "4")
    assert code == 0, err
    assert "PLANNED per-rank peak memory" in out
    for label in ("optimizer state", "parameters, sharded", "activations", "peak by phase"):
        assert label in out, out
    assert "max_memory_allocated" in out


def test_cli_reports_a_bad_config_clearly(capsys):
    code, _, err = _cli(capsys, "--config", str(ROOT / "train_configs/debug_model.toml"), "--world-size", "3",
                        "--parallelism.sp", "2")
    assert code == 2
    assert "error:" in err and "world_size=3 is not divisible by dp_replicate*sp=1*2=2" in err


def test_search_api_agrees_with_plans():
    cfg = load_config(FEAT + ["--activation_checkpoint.mode", "full"])
    res = find_max_seq_len(cfg, 2, budget_gib=0.05, headroom_gib=0.0, granularity=128, device="cpu")
    assert res.best is not None and res.next_up is not None and res.confirmed
    assert res.best.peak_bytes <= 0.05 * GIB < res.next_up.peak_bytes
    assert res.next_up.seq_len == res.max_seq_len + res.unit
    # A guessed bracket seeds the search: a right one is all it plans, one a unit
    # low (both fit) costs a point but not the answer.
    m, u = res.max_seq_len, res.unit
    for guess, planned in (((m, m + u), [m, m + u]), ((m - u, m), [m - u, m, m + u])):
        again = find_max_seq_len(cfg, 2, budget_gib=0.05, headroom_gib=0.0, granularity=128,
                                 device="cpu", confirm=False, guess=guess)
        assert again.max_seq_len == m, (guess, again.max_seq_len, m)
        assert planned is None or [p[0] for p in again.plans] == planned


def test_cli_max_seq_len_fits_and_the_next_step_does_not(capsys):
    """``--max-seq-len --granularity``: the answer is a multiple of granularity x sp that fits,
    planned again here, and the next one up does not. Planned with save_attention: the search
    plans the variant the config asks for (its report says so), and full AC needs less there."""
    from ulysses_dtensor.estimate import MemoryPlan

    budget, gran = 0.02, 128
    code, out, err = _cli(capsys, *FEAT, *SAVE, "--max-seq-len", "--budget-gib", str(budget), "--headroom-gib", "0",
                          "--granularity", str(gran), "--device", "cpu", "--json")
    assert code == 0, err
    res = json.loads(out)
    best, next_up = res["best"], res["next_up"]
    assert res["max_seq_len"] > 0 and res["max_seq_len"] % (gran * 2) == 0 and res["unit"] == gran * 2
    assert best["features"]["save_attention"] is True and next_up["seq_len"] == res["max_seq_len"] + res["unit"]
    assert best["peak_bytes"] <= budget * GIB < next_up["peak_bytes"]
    cfg = load_config(FEAT + list(SAVE))
    fits, over = (plan_memory(cfg, 2, s, rows=1, device="cpu") for s in (best["seq_len"], next_up["seq_len"]))
    assert fits.peak_bytes <= budget * GIB < over.peak_bytes
    full = plan_memory(load_config(FEAT + list(FULL)), 2, next_up["seq_len"], rows=1, device="cpu")
    assert full.peak_bytes < next_up["peak_bytes"]
    text = MemoryPlan(**{k: v for k, v in best.items() if k != "peak_gib"}).format()  # what the text report prints
    assert "ac=full, save_attention=True" in text, text


def test_max_seq_len_benchmark_smoke_run():
    # Its main() in this process (it plans on a fake process group of its own,
    # as the other tests here do): a fresh interpreter would cost seconds of imports.
    import io

    bench = load_script(ROOT / "benchmarks" / "max_seq_len.py")
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = bench.main(["--quick", "--features", "all"])  # the search itself: tests above
    finally:
        torch.set_num_threads(threads)
    r = SimpleNamespace(stdout=out.getvalue(), stderr=err.getvalue())
    assert code == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(recs) == 1 and all(x["bench"] == "max_seq_len" for x in recs)
    assert {x["features"] for x in recs} == {"all"}
    for x in recs:
        assert x["planned_max_seq_len"] > 0
        limit = (x["budget_gib"] - x["headroom_gib"]) * GIB
        assert x["best"]["peak_bytes"] <= limit < x["next_up"]["peak_bytes"]
    assert "PLANNED max trainable sequence" in r.stderr
