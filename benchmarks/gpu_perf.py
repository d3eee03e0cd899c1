"""The pieces of the one-call GPU kit (``bash scripts/gpu_perf.sh OUT``); see docs/benchmarks.md.

Each piece is one process under its own time limit (the shell script sets them)
and writes its results into OUT as it goes, so a piece that fails or runs out of
time never loses another's:

    python benchmarks/gpu_perf.py env        --out OUT   # versions, the kernels that run here, auto's choice
    python benchmarks/gpu_perf.py shape      --out OUT --shape llama   # step time per kernel, AC mode
    python benchmarks/gpu_perf.py profile    --out OUT --shape llama   # one step cut into regions
    python benchmarks/gpu_perf.py plan       --out OUT   # the planner's 1-GPU maximum (CPU only)
    python benchmarks/gpu_perf.py plan_check --out OUT   # one real step at that length
    python benchmarks/gpu_perf.py report     --out OUT   # summary, targets, RESULTS.md block

Shapes are one rank of 8 simulated on the fake process group (``bench_train.py
--mode simulate``: real compute and allocations of rank 0, every collective
skipped, the all-to-all and FSDP traffic modelled from counted bytes). Without
CUDA (or with ``--tiny``) every piece runs at tiny sizes on the CPU: what the
test suite runs so that the kit cannot rot.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# Shapes: one rank of world 8 with sp 8; full activation checkpointing, tiled MLP and loss
# (the long-context configs' switches). ``fit``: layer counts timed for the linear fit.
SHAPES = {
    "llama": {
        "title": "Llama-3-8B, 256K tokens on 8 GPUs (32K per GPU)",
        "flavor": "llama3_8b", "overrides": [], "local_seq": "32K", "layers": 32,
        "fit": [1, 2, 4], "warmup": 1, "iters": 2,
    },
    "qwen": {
        # Our Llama at Qwen3-8B's sizes, q/k norms included (the rope's base does not change the work).
        "title": "Qwen3-8B-shaped, 1M tokens on 8 GPUs (128K per GPU)",
        "flavor": "llama3_8b",
        "overrides": ["ffn_dim=12288", "vocab_size=151936", "explicit_head_dim=128", "qk_norm=true", "norm_eps=1e-06"],
        "local_seq": "128K", "layers": 36, "fit": [1, 2], "warmup": 1, "iters": 1,
    },
}
TINY_SHAPES = {
    "llama": {**SHAPES["llama"], "title": "tiny Llama (CPU smoke run)", "flavor": "debug", "local_seq": "16",
              "layers": 6, "fit": [1, 2], "iters": 1},
    "qwen": {**SHAPES["qwen"], "title": "tiny Qwen3-shaped (CPU smoke run)", "flavor": "debug", "local_seq": "16",
             "overrides": ["n_kv_heads=8", "explicit_head_dim=16", "qk_norm=true", "ffn_dim=160", "vocab_size=640"],
             "layers": 5, "fit": [1, 2]},
}
COMMON = ["--mode", "simulate", "--world", "8", "--sp", "8", "--ac", "full", "--tiled-loss", "--tiled-mlp"]
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


def tiny_mode(args) -> bool:
    import torch

    return args.tiny or not torch.cuda.is_available()


def shapes(args) -> dict:
    return TINY_SHAPES if tiny_mode(args) else SHAPES


def device_of(args):
    import torch

    return torch.device("cpu") if tiny_mode(args) else torch.device("cuda", 0)


def simulated_rank_device(args):
    """The device of the shapes' one simulated rank, made current; on the CPU one thread, and
    denormals flushed (the skipped collectives leave unspecified values behind)."""
    import torch

    device = device_of(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
    return device


def dump(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def append(path: Path, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record, default=str) + "\n")


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


# --------------------------------------------------------------------------- #
# env: versions, the kernels that run here, auto's choice
# --------------------------------------------------------------------------- #


def _kernel_trial(name: str, device, dtype) -> dict:
    """A small causal GQA forward + backward through ``local_attention(backend=name)``."""
    import torch

    from ulysses_dtensor.attention import local_attention

    torch.manual_seed(0)
    q = torch.randn(1, 512, 4, 128, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 512, 1, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    t0 = time.perf_counter()
    try:
        out = local_attention(q, k, v, backend=name)
        out.float().square().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ok = bool(torch.isfinite(out).all() and torch.isfinite(q.grad).all())
        return {"runs": ok, "seconds": round(time.perf_counter() - t0, 2),
                **({} if ok else {"error": "non-finite output or gradient"})}
    except Exception as e:  # noqa: BLE001 -- any failure means: does not run here
        return {"runs": False, "seconds": round(time.perf_counter() - t0, 2), "error": first_line(e)}


def _sdpa_dispatch(device, dtype) -> str | None:
    """The aten kernel our ``sdpa`` backend dispatches to here (cuDNN, flash, efficient, ...)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ulysses_dtensor.attention import local_attention

    q = torch.randn(1, 256, 4, 128, device=device, dtype=dtype)
    k = v = torch.randn(1, 256, 1, 128, device=device, dtype=dtype)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        local_attention(q, k, v, backend="sdpa")
    names = sorted({e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")})
    return names[-1] if names else None


def piece_env(args) -> int:
    import importlib.metadata
    import platform

    import torch

    from ulysses_dtensor.attention import select

    device = device_of(args)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    info = {"date": time.strftime("%Y-%m-%d"), "tiny": tiny_mode(args), "device_type": device.type,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "dtype": str(dtype).replace("torch.", "")}
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
    info["sdpa_kernel"] = _sdpa_dispatch(device, dtype)
    info["kernels"] = {name: _kernel_trial(name, device, dtype) for name in select.BACKENDS}
    info["runs_here"] = [n for n in select.BACKENDS if info["kernels"][n]["runs"]]
    dump(args.out / "env.json", info)
    print(json.dumps({k: info[k] for k in ("device", "torch", "cuda", "cudnn", "auto", "sdpa_kernel", "runs_here")}))
    return 0


def load_env(args) -> dict:
    try:
        return json.loads((args.out / "env.json").read_text())
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- #
# shape: step time, tokens/s, MFU and peak memory per kernel and AC mode
# --------------------------------------------------------------------------- #


def _bench_argv(shape: dict, device, kernel: str, layers: list[int], *, save_attention: bool) -> list[str]:
    argv = [*COMMON, "--flavor", shape["flavor"], "--local-seq", shape["local_seq"], "--attn-backend", kernel,
            "--device", device.type, "--warmup", str(shape["warmup"]), "--iters", str(shape["iters"]),
            "--layers", *map(str, layers)]
    for o in shape["overrides"]:
        argv += ["--override", o]
    if len(set(layers)) >= 2:
        argv += ["--extrapolate-layers", str(shape["layers"])]
    if save_attention:
        argv.append("--save-attention")
    if device.type == "cpu":
        argv += ["--threads", "1"]
    return argv


def piece_shape(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import bench_train as B
    from ulysses_dtensor.parallel.mesh import ParallelDims

    deadline = time.monotonic() + args.deadline_s
    shape = shapes(args)[args.shape]
    device = simulated_rank_device(args)
    out = args.out / f"shape_{args.shape}.jsonl"
    env = load_env(args)
    runs_here = env.get("runs_here") or ["auto"]
    auto_is = env.get("auto")
    # auto first (with the layer fit), then save_attention, then every other kernel that runs here.
    variants = [("auto", False, shape["fit"]), ("auto", True, shape["fit"][:1])]
    variants += [(k, False, shape["fit"][:1]) for k in runs_here if k not in ("auto", auto_is)]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    ok = True
    try:
        pmesh = ParallelDims(dp_replicate=1, dp_shard=-1, sp=8, world_size=8).build_mesh(device.type)
        first_cost = None
        for kernel, save_attention, layers in variants:
            tag = {"shape": args.shape, "title": shape["title"], "kernel": kernel, "auto_is": auto_is,
                   "ac": "save_attention" if save_attention else "full", "full_layers": shape["layers"],
                   "role": "fit" if len(layers) > 1 else "single", "tiny": tiny_mode(args)}
            left = deadline - time.monotonic()
            if first_cost is not None and left < first_cost:
                append(out, {"kit": tag, "skipped": f"not enough time left in this piece ({left:.0f} s; "
                                                    f"one kernel at {layers} layer(s): about {first_cost:.0f} s)"})
                continue
            t0 = time.monotonic()
            try:
                a = B.parse_args(_bench_argv(shape, device, kernel, layers, save_attention=save_attention))
                good = B.sweep(a, pmesh, device, lambda r: append(out, {"kit": tag, **r}), simulate=True)
                ok &= good
            except Exception as e:  # noqa: BLE001 -- one kernel failing must not stop the others
                append(out, {"kit": tag, "error": first_line(e)})
                traceback.print_exc()
                ok = False
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            spent = time.monotonic() - t0
            if first_cost is None:  # one more kernel at the fit's first layer count, from the fit's cost
                # (the fixed part of a run -- build, embedding, head, optimizer -- counted as one layer)
                first_cost = 1.3 * spent * (layers[0] + 1) / (sum(layers) + len(layers))
            print(f"gpu_perf: {args.shape} {kernel} {tag['ac']} layers {layers}: {spent:.1f} s", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


# --------------------------------------------------------------------------- #
# profile: one step cut into the library's regions
# --------------------------------------------------------------------------- #


def piece_profile(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import bench_train as B
    from _region_table import format_table, region_table
    from ulysses_dtensor.parallel.mesh import ParallelDims
    from ulysses_dtensor.trainer.step import train_step

    shape = shapes(args)[args.shape]
    device = simulated_rank_device(args)
    layers = args.layers or PROFILE_LAYERS
    a = B.parse_args(_bench_argv(shape, device, "auto", [layers], save_attention=False))
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


def plan_config(args):
    from ulysses_dtensor.trainer.config import load_config

    argv = TINY_PLAN_ARGV if tiny_mode(args) else PLAN_ARGV
    return argv, load_config([*argv, "--data.path", ""])


def piece_plan(args) -> int:
    from ulysses_dtensor.estimate import find_max_seq_len

    tiny = tiny_mode(args)
    argv, cfg = plan_config(args)
    budget = TINY_PLAN_BUDGET_GIB if tiny else min(args.budget_gib or PLAN_BUDGET_GIB, PLAN_BUDGET_GIB)
    headroom = TINY_PLAN_HEADROOM_GIB if tiny else PLAN_HEADROOM_GIB
    t0 = time.perf_counter()
    search = find_max_seq_len(cfg, 1, budget_gib=budget, headroom_gib=headroom,
                              granularity=TINY_GRANULARITY if tiny else 4096, device="cpu" if tiny else "cuda",
                              layers="full", guess=TINY_PLAN_GUESS if tiny else PLAN_GUESS,
                              log=lambda m: print(m, file=sys.stderr))
    best = search.best
    result = {"config_argv": argv, "world_size": 1, "budget_gib": budget, "headroom_gib": headroom,
              "device": "cpu" if tiny else "cuda", "max_seq_len": search.max_seq_len,
              "peak_bytes": best.peak_bytes if best else None, "peak_phase": best.peak_phase if best else None,
              "breakdown": best.breakdown if best else None, "notes": best.notes if best else [],
              "tried": search.plans, "seconds": round(time.perf_counter() - t0, 1)}
    dump(args.out / "plan.json", result)
    print(json.dumps({k: result[k] for k in ("max_seq_len", "peak_bytes", "seconds")}))
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
    _, cfg = plan_config(args)
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
            method = "torch.cuda.max_memory_allocated over one step (optimizer state created before it)"
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
    result = {"seq_len": seq, "planned_bytes": plan["peak_bytes"], "measured_bytes": measured,
              "reserved_bytes": reserved, "ratio": round(measured / plan["peak_bytes"], 4),
              "method": method, "step_s": round(step_s, 2), "attention": attention,
              "plan_seconds": plan["seconds"], "plan_budget_gib": plan["budget_gib"],
              **({"oom": oom, "note": "measured_bytes: the peak before running out of memory"} if oom else {})}
    dump(args.out / "plan_check.json", result)
    print(json.dumps(result))
    return 1 if oom else 0


# --------------------------------------------------------------------------- #


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("piece", choices=["env", "shape", "profile", "plan", "plan_check", "report"])
    p.add_argument("--out", type=Path, required=True, help="the kit's output folder")
    p.add_argument("--shape", choices=list(SHAPES), default="llama")
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (the default without CUDA)")
    p.add_argument("--deadline-s", type=float,
                   help="shape: start no further kernel that would not finish within this many seconds "
                        "(default: the piece's limit that gpu_perf.sh sets, GPU_PERF_PIECE_LIMIT, less 10 s)")
    p.add_argument("--layers", type=int, help=f"profile: layers of the profiled model (default {PROFILE_LAYERS})")
    p.add_argument("--budget-gib", type=float, help=f"plan: device memory (capped at {PLAN_BUDGET_GIB})")
    p.add_argument("--budget-s", type=float, help="report: the kit's time budget, for the summary")
    a = p.parse_args(argv)
    if a.deadline_s is None:
        a.deadline_s = float(os.environ.get("GPU_PERF_PIECE_LIMIT", 1e9)) - 10
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.piece == "report":
        from _gpu_perf_report import report

        return report(args.out, budget_s=args.budget_s)
    return {"env": piece_env, "shape": piece_shape, "profile": piece_profile, "plan": piece_plan,
            "plan_check": piece_plan_check}[args.piece](args)


if __name__ == "__main__":
    sys.exit(main())
