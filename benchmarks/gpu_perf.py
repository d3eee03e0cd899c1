"""The pieces of the one-call GPU kit (``bash scripts/gpu_perf.sh OUT``); see docs/benchmarks.md.

Each piece is one process under its own time limit (the shell script sets them)
and writes its results into OUT as it goes, so a piece that fails or runs out of
time never loses another's:

    python benchmarks/gpu_perf.py env        --out OUT   # versions, the kernels that run here, auto's choice
    python benchmarks/gpu_perf.py parity     --out OUT   # 1 GPU, real process group: kernels against references
    python benchmarks/gpu_perf.py shape      --out OUT --shape llama   # step time per kernel, AC mode
    python benchmarks/gpu_perf.py profile    --out OUT --shape llama   # one step cut into regions
    python benchmarks/gpu_perf.py plan       --out OUT   # the planner's 1-GPU maximum (CPU only)
    python benchmarks/gpu_perf.py plan_check --out OUT   # one real step at that length
    python benchmarks/gpu_perf.py report     --out OUT   # summary, targets, RESULTS.md block

Shapes are one rank of 8 simulated on the fake process group (``bench_train.py
--mode simulate``: real compute and allocations of rank 0, every collective
skipped with its output given defined values, the all-to-all and FSDP traffic
modelled from counted bytes). Without CUDA (or with ``--tiny``) every piece runs
at tiny sizes on the CPU: what the test suite runs so that the kit cannot rot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_perf_common import (  # noqa: E402
    COMPILES,
    SHAPES,
    device_of,
    dump,
    first_line,
    load_env,
    shapes,
    simulated_rank_device,
    tiny_mode,
)

PROFILE_LAYERS = 2

# The planner check: a 4-layer model of Qwen3-8B's sizes (no q/k norms: the trainer's
# config has no key for them) on ONE GPU, full AC + tiled loss, bf16 parameters.
PLAN_ARGV = ["--model.flavor", "llama3_8b", "--model.n_layers", "4", "--model.ffn_dim", "12288",
             "--model.vocab_size", "151936", "--model.rope_theta", "1000000",
             "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full",
             "--memory.tiled_loss", "true", "--parallelism.sp", "1", "--training.global_batch_size", "1"]
TINY_PLAN_ARGV = ["--model.flavor", "debug", "--model.n_layers", "4", "--activation_checkpoint.mode", "full",
                  "--memory.tiled_loss", "true", "--parallelism.sp", "1", "--training.global_batch_size", "1"]
PLAN_BUDGET_GIB = 80.0  # an H100's 80 GB (capped there on larger GPUs: the same plan on both kinds)
PLAN_HEADROOM_GIB = 6.0
TINY_PLAN_BUDGET_GIB, TINY_PLAN_HEADROOM_GIB, TINY_GRANULARITY = 0.02, 0.0, 128
# Lengths expected to straddle the answer (the answers seen: 217,088 on 80 GB, 2,304 tiny), planned first:
# they save the search its climb; a wrong guess costs only the usual extra plans.
PLAN_GUESS, TINY_PLAN_GUESS = (217_088, 221_184), (2_304, 2_432)


# --------------------------------------------------------------------------- #
# env: versions, the kernels that run here and what each dispatches to, auto's choice
# --------------------------------------------------------------------------- #


def _kernel_trial(name: str, device, dtype) -> dict:
    """A small causal GQA forward + backward through ``local_attention(backend=name)``, and
    the attention kernel(s) its forward dispatched to (an op name from the dispatcher)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ulysses_dtensor.attention import local_attention
    from ulysses_dtensor.memory.saved_attention import is_attention_kernel, op_name

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_attention_kernel(func) and op_name(func) not in self.kernels:
                self.kernels.append(op_name(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    q = torch.randn(1, 512, 4, 128, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 512, 1, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    t0 = time.perf_counter()
    seen = Dispatched()
    try:
        with seen:
            out = local_attention(q, k, v, backend=name)
        out.float().square().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ok = bool(torch.isfinite(out).all() and torch.isfinite(q.grad).all())
        dispatch = list(seen.kernels)
        impl = getattr(torch.nn.attention, "current_flash_attention_impl", None)
        if impl is not None and impl() and any("flash" in k for k in dispatch):
            dispatch.append(f"flash implementation {impl()}")  # torch's FA4 route replaces FA2's kernels
        return {"runs": ok, "seconds": round(time.perf_counter() - t0, 2), "dispatch": dispatch,
                **({} if ok else {"error": "non-finite output or gradient"})}
    except Exception as e:  # noqa: BLE001 -- any failure means: does not run here
        return {"runs": False, "seconds": round(time.perf_counter() - t0, 2), "error": first_line(e)}


def piece_env(args) -> int:
    """Written as it goes: versions first, then each kernel's trial, so that a piece killed
    half-way leaves what it found. No trial compiles (flex's is left to the shape pieces)."""
    import importlib.metadata
    import platform

    import torch

    from ulysses_dtensor.attention import select

    device = device_of(args)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    path = args.out / "env.json"
    info = {"date": time.strftime("%Y-%m-%d"), "tiny": tiny_mode(args), "device_type": device.type,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "dtype": str(dtype).replace("torch.", ""), "complete": False}
    # The caching allocator's settings for this run (gpu_perf.sh sets expandable segments unless the
    # user set PYTORCH_CUDA_ALLOC_CONF), as the pieces' processes inherit them.
    info["allocator"] = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                         "set_by": os.environ.get("GPU_PERF_ALLOC_CONF_BY", "the environment")}
    dump(path, info)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, capability=f"sm{props.major}{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 2), multiprocessors=props.multi_processor_count)
    else:
        info.update(device=f"CPU ({os.cpu_count()} cores)", memory_gib=None)
    packages = {}
    for name in ("transformers", "triton", "flash-attn", "flash-attn-4", "fla-core", "nvidia-cudnn-cu13",
                 "nvidia-cudnn-cu12"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            packages[name] = importlib.metadata.version(name)
    info["packages"] = packages
    # What silently changes SDPA's kernel (a system cuDNN first on the path; torch's switch).
    info["env"] = {"TORCH_CUDNN_SDPA_DEPRIORITIZED": os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
                   "LD_LIBRARY_PATH_cudnn": [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":")
                                             if "cudnn" in p.lower()]}
    head_dim = 128 if device.type == "cuda" else 16
    info["backends"] = list(select.BACKENDS)
    info["auto"] = select.resolve_backend("auto", frozenset(), device, dtype, head_dim)
    info["kernels"] = {}
    dump(path, info)
    for name in select.BACKENDS:
        if name in COMPILES and device.type == "cuda":
            info["kernels"][name] = {"runs": None, "not_tried": "compiles cold (torch.compile): tried by the "
                                                               "shape pieces, last"}
        else:
            info["kernels"][name] = _kernel_trial(name, device, dtype)
        dump(path, info)
    info["sdpa_kernel"] = next(iter(info["kernels"]["sdpa"].get("dispatch") or []), None)
    info["runs_here"] = [n for n in select.BACKENDS if info["kernels"][n]["runs"]]
    info["complete"] = True
    dump(path, info)
    print(json.dumps({k: info[k] for k in ("device", "torch", "cuda", "cudnn", "auto", "sdpa_kernel", "runs_here")}))
    return 0


# --------------------------------------------------------------------------- #
# profile: one step cut into the library's regions
# --------------------------------------------------------------------------- #


def piece_profile(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import bench_train as B
    from _gpu_perf_shape import bench_argv
    from _region_table import format_table, region_table
    from ulysses_dtensor.parallel.mesh import ParallelDims
    from ulysses_dtensor.trainer.step import train_step

    shape = shapes(args)[args.shape]
    device = simulated_rank_device(args)
    layers = args.layers or PROFILE_LAYERS
    a = B.parse_args(bench_argv(shape, device, "auto", [layers], save_attention=False))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, sp=8, world_size=8)
        pmesh = dims.build_mesh(device.type)
        margs = B.model_args(a, layers)
        model, optimizer = B.build(a, margs, pmesh, device)
        seq = B.seq_list(a, dims.sp)[0]
        batch = B.make_batch(a, pmesh, seq, margs.vocab_size, device)
        n_valid = torch.tensor(seq - 1, device=device)
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            train_step(model, optimizer, batch, n_valid, max_norm=a.max_norm, params=params)

        for _ in range(a.warmup):
            step()
        B.C.sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            step()
            B.C.sync(device)
            step_s = time.perf_counter() - t0
        table = region_table(prof.events(), step_s, device=device.type == "cuda")
    finally:
        dist.destroy_process_group()
    result = {"shape": args.shape, "title": shape["title"], "layers": layers, "kernel": "auto",
              "ac": "full", "seq": seq, "note": "the step under the profiler (slower than unprofiled)",
              "table": table, "markdown": format_table(table)}
    dump(args.out / f"profile_{args.shape}.json", result)
    print(result["markdown"])
    return 0


# --------------------------------------------------------------------------- #
# plan / plan_check: the planner's 1-GPU maximum, and one real step there
# --------------------------------------------------------------------------- #


def plan_config(tiny: bool):
    from ulysses_dtensor.trainer.config import load_config

    argv = TINY_PLAN_ARGV if tiny else PLAN_ARGV
    return argv, load_config([*argv, "--data.path", ""])


def plan_target(env: dict):
    """The GPU the plan is for, named from env.json (this process sees no GPU: gpu_perf.sh runs
    the planner with CUDA_VISIBLE_DEVICES empty), and where that name came from."""
    import torch

    from ulysses_dtensor.attention import Capabilities
    from ulysses_dtensor.attention.capabilities import cudnn_version_str

    gpu = env.get("capability") or env.get("device")
    if not gpu or env.get("device_type") != "cuda":
        return Capabilities.target("H100", torch.__version__), "env.json names no GPU: planned for an H100"
    packages = tuple(p for p, dist in (("flash_attn", "flash-attn"), ("fa4", "flash-attn-4"))
                     if dist in (env.get("packages") or {}))
    target = Capabilities.target(gpu, env.get("torch") or torch.__version__, cuda=env.get("cuda") or "13.0",
                                 cudnn=cudnn_version_str(env["cudnn"]) if env.get("cudnn") else None,
                                 packages=packages)
    return target, f"env.json: {env.get('device')}"


def piece_plan(args) -> int:
    """CPU only: on a GPU run gpu_perf.sh hides the GPU from this process (no CUDA context beside
    the timed pieces) and the target GPU is named to the planner."""
    import torch

    from ulysses_dtensor.estimate import find_max_seq_len

    tiny = args.tiny  # not tiny_mode(): this process sees no GPU on a GPU run either
    argv, cfg = plan_config(tiny)
    budget = TINY_PLAN_BUDGET_GIB if tiny else min(args.budget_gib or PLAN_BUDGET_GIB, PLAN_BUDGET_GIB)
    headroom = TINY_PLAN_HEADROOM_GIB if tiny else PLAN_HEADROOM_GIB
    target, target_from = (None, "the CPU") if tiny else plan_target(load_env(args.out))
    t0 = time.perf_counter()
    search = find_max_seq_len(cfg, 1, budget_gib=budget, headroom_gib=headroom,
                              granularity=TINY_GRANULARITY if tiny else 4096, device="cpu" if tiny else "cuda",
                              layers="full", guess=TINY_PLAN_GUESS if tiny else PLAN_GUESS, target=target,
                              log=lambda m: print(m, file=sys.stderr))
    best = search.best
    result = {"config_argv": argv, "world_size": 1, "budget_gib": budget, "headroom_gib": headroom,
              "device": "cpu" if tiny else "cuda", "target": target.describe() if target else "cpu",
              "target_from": target_from, "max_seq_len": search.max_seq_len,
              "peak_bytes": best.peak_bytes if best else None, "peak_phase": best.peak_phase if best else None,
              "breakdown": best.breakdown if best else None, "notes": best.notes if best else [],
              "tried": search.plans, "seconds": round(time.perf_counter() - t0, 1),
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "cuda_initialized": torch.cuda.is_initialized()}
    dump(args.out / "plan.json", result)
    print(json.dumps({k: result[k] for k in ("max_seq_len", "peak_bytes", "seconds", "target")}))
    return 0 if best else 1


def piece_plan_check(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import _common as C
    from ulysses_dtensor.attention.select import resolve_backend
    from ulysses_dtensor.data import build_tokenizer
    from ulysses_dtensor.parallel.loss import count_valid_tokens
    from ulysses_dtensor.trainer.build import build_model, resolve_vocab_size
    from ulysses_dtensor.trainer.config import model_args, validate_config
    from ulysses_dtensor.trainer.step import build_optimizer, train_step

    plan = json.loads((args.out / "plan.json").read_text())
    seq = plan["max_seq_len"]
    _, cfg = plan_config(tiny_mode(args))
    cfg.training.seq_len = seq
    device = device_of(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        dims = validate_config(cfg, 1, weights=False)
        pmesh = dims.build_mesh(device.type)
        vocab = resolve_vocab_size(cfg, build_tokenizer(cfg.data.tokenizer).vocab_size)
        attention = f"{cfg.model.attn_backend} -> " + resolve_backend(
            cfg.model.attn_backend, frozenset(), device, getattr(torch, cfg.training.mixed_precision_param),
            model_args(cfg, vocab).head_dim)
        model = build_model(cfg, pmesh, vocab, device)
        optimizer = build_optimizer(cfg, model)
        params = [p for p in model.parameters() if p.requires_grad]
        # The planner's steady state: optimizer state exists before the step.
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (1, seq), generator=gen)
        batch = {"input_ids": ids.to(device), "labels": torch.roll(ids, -1, 1).to(device),
                 "position_ids": torch.arange(seq).unsqueeze(0).to(device), "document_ids": None}
        n_valid = count_valid_tokens(batch["labels"], pmesh.loss)
        t0 = time.perf_counter()
        oom = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            try:
                train_step(model, optimizer, batch, n_valid, max_norm=cfg.training.max_norm)
                torch.cuda.synchronize(device)
            except torch.OutOfMemoryError as e:  # a finding: the plan promised this would fit
                oom = first_line(e)
            measured = torch.cuda.max_memory_allocated(device)
            reserved = torch.cuda.max_memory_reserved(device)
            method = ("torch.cuda.max_memory_allocated over one step (optimizer state created before it); "
                      "max_memory_reserved beside it")
        else:
            import bench_train as B

            resident = B.resident_bytes(model, optimizer, device) + sum(
                t.numel() * t.element_size() for t in batch.values() if t is not None)
            with C.PeakMemory(device) as pm:
                train_step(model, optimizer, batch, n_valid, max_norm=cfg.training.max_norm)
            measured, reserved = resident + pm.peak_bytes, None
            method = "CPU: parameters + optimizer state + batch, plus the step's allocation peak (profiler)"
        step_s = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    # What the caching allocator held beyond the tensors at their peak, against the planner's
    # headroom for it (and for what the CUDA context and libraries take).
    headroom = int(plan["headroom_gib"] * 2**30)
    gap = None if reserved is None else reserved - measured
    result = {"seq_len": seq, "planned_bytes": plan["peak_bytes"], "measured_bytes": measured,
              "reserved_bytes": reserved, "ratio": round(measured / plan["peak_bytes"], 4),
              "reserved_minus_allocated_bytes": gap, "headroom_bytes": headroom,
              "headroom_covers_gap": None if gap is None else gap <= headroom,
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if device.type == "cuda" else None,
              "method": method, "step_s": round(step_s, 2), "attention": attention,
              "plan_seconds": plan["seconds"], "plan_budget_gib": plan["budget_gib"],
              **({"oom": oom, "note": "measured_bytes: the peak before running out of memory"} if oom else {})}
    dump(args.out / "plan_check.json", result)
    print(json.dumps(result))
    return 1 if oom else 0


# The disk piece: how much it writes and reads (bounded by a quarter of the free space).
DISK_GIB, TINY_DISK_MIB, DISK_LAYER_MIB, TINY_DISK_LAYER_MIB = 8, 32, 512, 4


def disk_dir(out: Path) -> str:
    """The directory the disk tier is measured in: GPU_PERF_DISK_DIR (gpu_perf.sh sets it beside
    OUT, on OUT's disk), else OUT/disk_probe."""
    return os.environ.get("GPU_PERF_DISK_DIR") or str(out / "disk_probe")


def piece_disk(args) -> int:
    """The disk tier's write and read bandwidth through the offloader's own store (issue 54);
    the step with and without it is a pair of variants of the shape pieces."""
    import torch

    import bench_disk_tier as D
    from ulysses_dtensor.memory.offload_dir import free_bytes

    tiny = tiny_mode(args)
    directory = disk_dir(args.out)
    os.makedirs(directory, exist_ok=True)
    total = TINY_DISK_MIB << 20 if tiny else min(DISK_GIB << 30, free_bytes(directory) // 4)
    layer = (TINY_DISK_LAYER_MIB if tiny else DISK_LAYER_MIB) << 20
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    result = {**D.measure(directory, total, layer, device), "tiny": tiny}
    dump(args.out / "disk.json", result)
    print(json.dumps(result))
    return 0 if result["read_back_equal"] else 1


# --------------------------------------------------------------------------- #


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("piece", choices=["env", "parity", "shape", "profile", "plan", "plan_check", "disk", "report"])
    p.add_argument("--out", type=Path, required=True, help="the kit's output folder")
    p.add_argument("--shape", choices=list(SHAPES), default="llama")
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (the default without CUDA)")
    p.add_argument("--deadline-s", type=float,
                   help="shape: start no further variant that would not finish within this many seconds "
                        "(default: the piece's limit that gpu_perf.sh sets, GPU_PERF_PIECE_LIMIT, less 10 s)")
    p.add_argument("--layers", type=int, help=f"profile: layers of the profiled model (default {PROFILE_LAYERS})")
    p.add_argument("--budget-gib", type=float, help=f"plan: device memory (capped at {PLAN_BUDGET_GIB})")
    a = p.parse_args(argv)
    if a.deadline_s is None:
        a.deadline_s = float(os.environ.get("GPU_PERF_PIECE_LIMIT", 1e9)) - 10
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.piece == "report":
        from _gpu_perf_report import report

        return report(args.out)
    if args.piece == "shape":
        from _gpu_perf_shape import piece_shape

        return piece_shape(args)
    if args.piece == "parity":
        from _gpu_perf_parity import piece_parity

        return piece_parity(args)
    return {"env": piece_env, "profile": piece_profile, "plan": piece_plan,
            "plan_check": piece_plan_check, "disk": piece_disk}[args.piece](args)


if __name__ == "__main__":
    sys.exit(main())
