"""Training-step throughput, MFU and peak memory vs sequence length.

One JSON object per configuration (flavor, mesh, sequence length, ...) on
stdout. A step is the trainer's own step (``trainer.step.train_step``):
forward with labels (this rank's loss share), backward (FSDP2 reduce-scatter),
``clip_grad_norm_``, AdamW step, zero grad, of the model as
``parallelize_llama`` builds it.

Two modes:

``--mode real``
    Real ranks run real steps: for every sp in ``--sp`` the script spawns
    ``--world`` ranks (default: sp; gloo on CPU, nccl on CUDA, one GPU per
    rank), or runs as one rank under ``torchrun``. Figures are measured:
    median step time after warm-up (per iteration the slowest rank), tokens/s
    global and per device, MFU, peak memory, and the bytes each rank sent
    through the Ulysses all-to-all in one step (counted with
    ``CollectiveCounter`` on an eager step and checked against
    ``n_layers x exchange_bytes_per_rank``, the forward exchange counted twice
    for recomputed blocks).

``--mode simulate --world N --sp P``
    ONE process stands in for rank 0 of a world of N: a fake process group
    (collectives are skipped; their outputs are given what this rank would
    receive if every rank held its data, ``_simulated_collectives.py``), real
    compute, real allocations: the per-rank
    step of a large job on one device. The skipped communication is added
    back from the bytes counted on the step and a stated bandwidth
    (``--link-gbps``; FSDP all-gather / reduce-scatter from their counted
    bytes with ``--fsdp-gbps``): every such figure sits in a block labelled
    ``"modelled": true`` with the bandwidths used. The measured
    communication-free step is reported beside it (``compute_only``).

Examples::

    python benchmarks/bench_train.py --mode real --flavor debug --sp 1 2 4 --seq 256 1024 2048
    python benchmarks/bench_train.py --mode simulate --flavor llama3_8b --world 8 --sp 8 \\
        --local-seq 32K 128K --ac full --tiled-loss --tiled-mlp --compile
    torchrun --nproc_per_node=8 benchmarks/bench_train.py --mode real --flavor llama3_8b --seq 64K
    python benchmarks/bench_train.py --mode real --sp 2 4 --world 4 --seq 2048 --compare

Real mode also times the Ulysses all-to-alls of each timed step (CUDA events,
or wall clock on CPU; eager only) and reports their share of the step
(``exchange``). ``--compare`` adds one JSON object with every configuration's
tokens/s, peak memory and exchange share side by side (SP on and off, or two
sp degrees, on the same model and sequence length).

See benchmarks/README.md for every field.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from _exchange import compare_record, exchange_record  # noqa: E402
from _fsdp_traffic import FsdpTraffic  # noqa: E402
from _simulated_collectives import DefinedCollectives  # noqa: E402
from _train_record import DTYPES, extrapolate, make_record, model_args  # noqa: E402

from ulysses_dtensor.models.llama import Llama, llama_args  # noqa: E402
from ulysses_dtensor.models.llama_parallelize import parallelize_llama  # noqa: E402
from ulysses_dtensor.parallel.batch import shard_batch  # noqa: E402
from ulysses_dtensor.precision.float8 import RECIPES, Float8Options  # noqa: E402
from ulysses_dtensor.parallel.comm_stats import CollectiveCounter  # noqa: E402
from ulysses_dtensor.parallel.comm_timing import ExchangeTimer  # noqa: E402
from ulysses_dtensor.parallel.loss import count_valid_tokens  # noqa: E402
from ulysses_dtensor.parallel.mesh import ParallelDims  # noqa: E402
from ulysses_dtensor.runtime.process_group import finish_together  # noqa: E402
from ulysses_dtensor.trainer.step import train_step  # noqa: E402

QUICK_REAL = {"flavor": "debug", "sp": [1, 2], "seq": [128], "warmup": 1, "iters": 2, "threads": 1}
QUICK_SIM = {"flavor": "debug", "sp": [4], "world": 4, "seq": [256], "warmup": 1, "iters": 2, "threads": 1}
DEFAULT_LINK_GBPS = 400.0


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #


def parse_size(text: str) -> int:
    """``4096``, ``32K`` (= 32768), ``1M`` (= 1048576)."""
    t = str(text).strip().upper()
    mult = 1
    if t.endswith("K"):
        mult, t = 1024, t[:-1]
    elif t.endswith("M"):
        mult, t = 1024 * 1024, t[:-1]
    try:
        value = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 32K, 1M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--override {text!r}: expected FIELD=VALUE (e.g. n_layers=4)")
    key, value = text.split("=", 1)
    for cast in (int, float):
        try:
            return key.strip(), cast(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return key.strip(), value.lower() == "true"
    return key.strip(), value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["real", "simulate"], default="real")
    p.add_argument("--flavor", help="model flavor (models.llama.FLAVORS); default debug")
    p.add_argument("--override", type=parse_override, action="append", default=[], metavar="FIELD=VALUE",
                   help="replace a LlamaArgs field, e.g. --override n_layers=4 (repeatable)")
    p.add_argument("--sp", type=int, nargs="+", help="sp degrees (default: real 1 2 4; simulate 8)")
    p.add_argument("--world", type=int,
                   help="world size (real: ranks spawned, default = sp; simulate: the world rank 0 "
                        "stands in for, default = sp); dp_shard = world / (dp_replicate * sp)")
    p.add_argument("--dp-replicate", type=int, default=1)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seq", type=parse_size, nargs="+", help="total sequence lengths (e.g. 2048 32K)")
    g.add_argument("--local-seq", type=parse_size, nargs="+",
                   help="per-rank sequence slices instead: seq = local_seq * sp")
    p.add_argument("--layers", type=int, nargs="+",
                   help="sweep n_layers over these values (overrides the flavor's and --override's)")
    p.add_argument("--extrapolate-layers", type=int, metavar="N",
                   help="with >= 2 --layers values: also emit a record for n_layers=N from a linear fit "
                        "(labelled modelled/extrapolated), for shapes too slow to run in full")
    p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel group per step")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none", help="activation checkpointing")
    p.add_argument("--selective-ac", default="op", help="with --ac selective: 'op' or k (every k-th block)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (fullgraph)")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="compute (FSDP param) dtype; auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--reduce-dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--pack-qkv", action="store_true")
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--mlp-tiles", type=int)
    p.add_argument("--tiled-loss", action="store_true")
    p.add_argument("--loss-chunks", type=int)
    p.add_argument("--offload-activations", action="store_true", help="needs --ac full")
    p.add_argument("--offload-dir", metavar="DIR", help="with --offload-activations: the disk tier, the offloaded "
                   "layer inputs in a file in DIR through a pinned staging area (parallelize_llama(offload_dir=))")
    p.add_argument("--save-attention", action="store_true",
                   help="with --ac full: keep the attention kernel's output and log-sum-exp instead of "
                        "recomputing them (parallelize_llama(save_attention=True))")
    p.add_argument("--head-chunks", type=int, metavar="N",
                   help="the exchange and attention over N chunks of a rank's heads (1: none; default: the "
                        "count from the shapes, parallelize_llama(head_chunks=None))")
    p.add_argument("--offload-params", action="store_true",
                   help="parameter shards, gradients and AdamW state in host memory (FSDP2 CPU offload)")
    p.add_argument("--float8", choices=RECIPES, help="FP8 linear layers with this torchao recipe (the 'float8' "
                   "extra; an FP8 GPU, or --float8-emulate)")
    p.add_argument("--float8-emulate", action="store_true", help="with --float8: emulate the FP8 matmuls (CPU "
                   "smoke runs)")
    p.add_argument("--attn-backend", help="LlamaArgs.attn_backend (default: auto = sdpa on CPU, "
                   "flash_attn or varlen on CUDA in 16-bit)")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--warmup", type=int,
                   help="untimed steps (the first one also counts collectives, eager); default 2")
    p.add_argument("--iters", type=int, help="timed steps (median reported); default 5")
    p.add_argument("--cpu-clock", action="store_true",
                   help="CPU only: time each step in this process's CPU seconds (time.process_time), which "
                        "other processes on a shared machine inflate less than wall time (the GPU kit's smoke run)")
    p.add_argument("--threads", type=int, help="torch threads per process (default: real cores // ranks, simulate all cores; use 1 on a shared CPU box)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s per device for MFU (default: table by GPU name)")
    p.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                   help="simulate: all-to-all bandwidth per rank per direction, GB/s (1e9 B/s); default 400")
    p.add_argument("--fsdp-gbps", type=float, help="simulate: FSDP collective bandwidth, GB/s (default = --link-gbps)")
    p.add_argument("--latency-us", type=float, default=0.0, help="simulate: added per modelled collective call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true",
                   help="real mode: after the records, one JSON object comparing the configurations "
                        "(tokens/s, peak memory, all-to-all share of step time)")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny smoke run: real {QUICK_REAL}; simulate {QUICK_SIM}")
    a = p.parse_args(argv)
    a.sp_given = a.sp is not None
    if a.quick:
        base = dict(QUICK_SIM if a.mode == "simulate" else QUICK_REAL)
    else:
        base = {"flavor": "debug", "sp": [8] if a.mode == "simulate" else [1, 2, 4],
                "seq": [1024], "warmup": 2, "iters": 5}
    for key, value in base.items():
        if key == "seq" and a.local_seq is not None:
            continue
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.dtype == "auto":
        a.dtype = "bfloat16" if a.device == "cuda" else "float32"
    if a.fsdp_gbps is None:
        a.fsdp_gbps = a.link_gbps
    if a.cpu_clock and a.device != "cpu":
        p.error("--cpu-clock times CPU seconds: it needs --device cpu")
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first untimed step counts the collectives)")
    if a.iters < 1:
        p.error("--iters must be >= 1")
    if a.offload_activations and a.ac != "full":
        p.error("--offload-activations needs --ac full")
    if a.offload_dir and not a.offload_activations:
        p.error("--offload-dir needs --offload-activations")
    if a.save_attention and a.ac != "full":
        p.error("--save-attention needs --ac full")
    if a.mode == "simulate" and a.world is None and len(a.sp) > 1:
        a.world = max(a.sp)
    if a.extrapolate_layers and len(set(a.layers or [])) < 2:
        p.error("--extrapolate-layers needs --layers with at least two distinct values")
    if a.attn_backend:
        a.override.append(("attn_backend", a.attn_backend))
    llama_args(a.flavor, **dict(a.override))  # unknown flavor / field: clear error now
    return a


# --------------------------------------------------------------------------- #
# One configuration
# --------------------------------------------------------------------------- #


def build(a, args, pmesh, device: torch.device):
    with torch.device("meta"):
        model = Llama(args)
    selective = a.selective_ac if a.selective_ac == "op" else int(a.selective_ac)
    model = parallelize_llama(
        model, pmesh,
        ac_mode=a.ac, selective_ac=selective,
        compile=a.compile, compile_backend=a.compile_backend,
        param_dtype=DTYPES[a.dtype], reduce_dtype=DTYPES[a.reduce_dtype],
        pack_qkv=a.pack_qkv,
        tiled_mlp=a.tiled_mlp, mlp_tiles=a.mlp_tiles,
        tiled_loss=a.tiled_loss, loss_chunks=a.loss_chunks,
        offload_activations=a.offload_activations,
        offload_dir=a.offload_dir or None,
        offload_params=a.offload_params,
        save_attention=a.save_attention,
        head_chunks=a.head_chunks,
        float8=Float8Options(enable=True, recipe_name=a.float8, emulate=a.float8_emulate) if a.float8 else None,
    )
    model.to_empty(device="cpu" if a.offload_params else device)
    model.init_weights(seed=a.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optimizer


def make_batch(a, pmesh, seq: int, vocab: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(a.seed * 1000 + pmesh.dp_rank)
    ids = torch.randint(0, vocab, (a.batch, seq), generator=gen)
    local = shard_batch({"input_ids": ids}, pmesh.sp)
    return {k: (v.to(device) if v is not None else None) for k, v in local.items()}


def resident_bytes(model, optimizer, device: torch.device) -> int:
    """Bytes of this rank's parameter shards and optimizer state on ``device`` (before a
    step: no grads). Host-offloaded shards (--offload-params on CUDA) do not count."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.device.type != device.type:
                return
            key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
            if key not in seen:
                seen.add(key)
                total += local.numel() * local.element_size()

    for p in model.parameters():
        add(p)
    for state in optimizer.state.values():
        for v in state.values():
            add(v)
    return total


def measure(a, args, pmesh, device: torch.device, seq: int, *, simulate: bool,
            define_collectives: bool = True) -> dict:
    """Build the parallelized model and run its steps: counted, warm-up, memory, timed.

    Simulated (fake process group), every collective's output gets a defined value
    (:class:`DefinedCollectives`; ``define_collectives=False`` leaves them as the
    fake group does, for tests), except in compiled steps, which a dispatch mode would
    run eagerly. Each timed step's loss share and gradient norm are returned."""
    defined = DefinedCollectives() if simulate and define_collectives and not a.compile else None
    with defined if defined is not None else contextlib.nullcontext():
        raw = _measure(a, args, pmesh, device, seq, simulate=simulate)
    if simulate:
        raw["collectives"] = (
            {"outputs": "defined", "written": dict(defined.counts), "unknown": dict(defined.unknown)}
            if defined is not None else
            {"outputs": "as the fake process group leaves them"
                        + (" (compiled steps: a dispatch mode would run them eagerly)" if a.compile else "")})
    return raw


def _measure(a, args, pmesh, device: torch.device, seq: int, *, simulate: bool) -> dict:
    dims = pmesh.dims
    sp, world = dims.sp, dims.world_size
    if seq % sp:
        raise ValueError(f"seq={seq} must be divisible by sp={sp} (tokens are split evenly)")
    torch.manual_seed(a.seed)
    model, optimizer = build(a, args, pmesh, device)
    batch = make_batch(a, pmesh, seq, args.vocab_size, device)
    if simulate:  # a fake all-reduce would not sum: the global count, directly
        n_valid = torch.tensor(dims.dp * a.batch * (seq - 1), device=device)
    else:  # constant across steps: counted once, outside the timed step
        n_valid = count_valid_tokens(batch["labels"], pmesh.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    results = []  # the timed steps' loss shares and gradient norms, read after the timing

    def step():
        return train_step(model, optimizer, batch, n_valid, max_norm=a.max_norm, params=params)

    # 1) first warm-up step, eager, counting every collective
    a2a, fsdp = CollectiveCounter(), FsdpTraffic()
    stance = torch.compiler.set_stance("force_eager") if a.compile else contextlib.nullcontext()
    with stance, a2a, fsdp:
        step()
    C.sync(device)
    # 2) the other warm-up steps (compiles with --compile)
    for _ in range(a.warmup - 1):
        step()
    C.sync(device)
    state = resident_bytes(model, optimizer, device)
    # 3) memory: CPU has no peak counter -> a separate profiled (untimed) step
    mem = {"resident_bytes": state}
    if device.type != "cuda":
        with C.PeakMemory(device) as pm:
            step()
        mem["step_peak_bytes"] = pm.peak_bytes
        mem["method"] = ("CPU: PyTorch profiler allocation events over one step (untimed pass), "
                         "plus resident parameter shards and optimizer state")
    else:
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    # 4) timed steps; in real eager runs each with its own all-to-all timer
    timers: list[ExchangeTimer] = []
    timed = not simulate and not a.compile

    def timed_step():
        if not timed:
            results.append(step())
            return
        timers.append(ExchangeTimer(device))
        with timers[-1].active():
            results.append(step())

    barrier = None if simulate or world == 1 else dist.barrier
    clock = time.process_time if a.cpu_clock else time.perf_counter
    times = C.timed_interleaved({"step": timed_step}, warmup=0, iters=a.iters, device=device, barrier=barrier,
                                clock=clock)
    exchange = exchange_record(timers, times["step"], device) if not simulate else None
    if not simulate:
        times = C.max_over_ranks(times, device)
    if device.type == "cuda":
        mem["step_peak_bytes"] = torch.cuda.max_memory_allocated(device) - start
        mem["max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        mem["max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        mem["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")  # None: the allocator's defaults
        mem["method"] = ("CUDA: max_memory_allocated over the timed steps (relative to their start, and "
                         "absolute); max_memory_reserved beside it (what the caching allocator held)")
    mem["peak_bytes"] = state + mem["step_peak_bytes"]
    if not simulate and world > 1:  # the largest rank
        t = torch.tensor([mem["peak_bytes"]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        mem["max_over_ranks_peak_bytes"] = int(t[0].item())
    mem["peak_gib"] = round(mem["peak_bytes"] / 2**30, 4)

    raw = {
        "times": times["step"],
        "a2a_bytes": a2a.sent_bytes("all_to_all_single"),
        "a2a_calls": a2a.counts().get("all_to_all_single", 0),
        "a2a_other": {k: v for k, v in a2a.counts().items() if k != "all_to_all_single"},
        "fsdp_calls": dict(fsdp.calls),
        "fsdp_sent": dict(fsdp.sent),
        "memory": mem,
        "backend": dist.get_backend(),
        "exchange": exchange,
        # this rank's loss share and the gradient norm of each timed step (simulated: the
        # norm over what the fake all-reduce leaves, i.e. this rank's shards)
        "timed_steps": {"loss": [float(r.loss_sum) for r in results],
                        "grad_norm": [float(r.grad_norm) for r in results]},
    }
    del model, optimizer, params, batch, step, timed_step, results
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return raw


def sweep(a, pmesh, device, report, *, simulate: bool) -> bool:
    """Every (seq, n_layers) of the sweep for one mesh; extrapolated records after each seq."""
    ok = True
    dims = pmesh.dims
    for seq in seq_list(a, dims.sp):
        runs = {}
        for n_layers in a.layers or [None]:
            args = model_args(a, n_layers)
            try:
                raw = measure(a, args, pmesh, device, seq, simulate=simulate)
            except torch.OutOfMemoryError as e:
                if not simulate:
                    raise
                gc.collect()  # one process: report and go on
                torch.cuda.empty_cache()
                report({"bench": "train", "mode": "simulate", **C.env_info(device),
                        "world_size": dims.world_size,
                        "config": {"flavor": a.flavor, "overrides": dict(a.override), "n_layers": args.n_layers,
                                   "seq": seq, "batch": a.batch,
                                   "mesh": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                                            "sp": dims.sp}},
                        "oom": True, "error": str(e).splitlines()[0]})
                ok = False
                continue
            rec = make_record(a, args, dims, device, seq, raw, simulate=simulate)
            if not rec["all_to_all"]["bytes_match"]:
                msg = f"all-to-all bytes differ from the formula: {rec['all_to_all']}"
                if not simulate:
                    raise AssertionError(msg)
                print(msg, file=sys.stderr)
                ok = False
            report(rec)
            runs[args.n_layers] = raw
        if a.extrapolate_layers and len(runs) >= 2:
            report(extrapolate(a, dims, device, seq, runs, simulate=simulate))
    return ok


# --------------------------------------------------------------------------- #
# Modes
# --------------------------------------------------------------------------- #


def seq_list(a, sp: int) -> list[int]:
    return list(a.seq) if a.local_seq is None else [s * sp for s in a.local_seq]


def real_worker(rank, world, device, report, a, sp):
    dims = ParallelDims(dp_replicate=a.dp_replicate, dp_shard=-1, sp=sp, world_size=world)
    pmesh = dims.build_mesh(device.type)
    sweep(a, pmesh, device, report, simulate=False)


def main_real(a) -> int:
    records: list[dict] = []

    def keep(record: dict) -> None:
        records.append(record)
        C.emit(record, out)

    env = C.torchrun_env()
    if env is not None:  # one rank of torchrun: sp values that divide the world
        rank, world, local_rank = env
        out = C.stdout_for_records() if rank == 0 else None
        if a.threads:
            torch.set_num_threads(a.threads)
        device = C.init_distributed(a.device, rank, world, local_rank, None, a.offload_params)
        report = keep if rank == 0 else (lambda r: None)
        with finish_together():
            for sp in (a.sp if a.sp_given else [world // a.dp_replicate]):
                real_worker(rank, world, device, report, a, sp)
        if a.compare and rank == 0:
            C.emit(compare_record(records), out)
        return 0
    ok = True
    out = None  # C.emit's default: stdout
    for sp in a.sp:
        world = a.world or sp * a.dp_replicate
        threads = a.threads or max(1, C.usable_cores() // world)
        ok &= C.launch_ranks(world, real_worker, (a, sp), device_type=a.device, threads=threads,
                             cpu_collectives=a.offload_params, on_record=keep)
    if a.compare:
        C.emit(compare_record(records))
    return 0 if ok else 1


def main_simulate(a) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = C.stdout_for_records()
    torch.set_num_threads(a.threads or C.usable_cores())
    if a.device == "cpu":
        torch.set_flush_denormal(True)  # denormals are slow on CPUs and matter to no figure here
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ok = True
    for sp in a.sp:
        world = a.world or sp * a.dp_replicate
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            dims = ParallelDims(dp_replicate=a.dp_replicate, dp_shard=-1, sp=sp, world_size=world)
            ok &= sweep(a, dims.build_mesh(device.type), device, lambda r: C.emit(r, out), simulate=True)
        finally:
            dist.destroy_process_group()
    return 0 if ok else 1


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    rc = main_simulate(a) if a.mode == "simulate" else main_real(a)
    print(f"bench_train: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
