"""What the GPU kit's pieces share: the shapes they measure, the device they run on,
and writing their results as they go (``gpu_perf.py`` and its ``_gpu_perf_*`` modules)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Shapes: one rank of world 8 with sp 8; full activation checkpointing, tiled MLP and loss
# (the long-context configs' switches). ``fit``: layer counts of `auto`'s fit; every other
# variant is measured at the first two of them (two points: its own line).
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
# The CPU smoke run times steps in process CPU seconds (``bench_train.py --cpu-clock``), the
# median of 5 (a tiny step is ~30 ms a layer, ~50 ms): on a shared CPU whose other processes
# slow a step (even in CPU seconds, on hyperthreads) a 1-layer step must not look slower than
# a 2-layer one.
TINY_SHAPES = {
    "llama": {**SHAPES["llama"], "title": "tiny Llama (CPU smoke run)", "flavor": "debug", "local_seq": "16",
              "layers": 6, "fit": [1, 2], "iters": 5},
    "qwen": {**SHAPES["qwen"], "title": "tiny Qwen3-shaped (CPU smoke run)", "flavor": "debug", "local_seq": "16",
             "overrides": ["n_kv_heads=8", "explicit_head_dim=16", "qk_norm=true", "ffn_dim=160", "vocab_size=640"],
             "layers": 5, "fit": [1, 2], "iters": 5},
}
COMMON = ["--mode", "simulate", "--world", "8", "--sp", "8", "--ac", "full", "--tiled-loss", "--tiled-mlp"]

# Backends whose first call compiles (seconds to a minute, cold): never tried by `env` on a
# GPU, measured last by the shape pieces.
COMPILES = ("flex",)


def tiny_mode(args) -> bool:
    import torch

    return args.tiny or not torch.cuda.is_available()


def shapes(args) -> dict:
    return TINY_SHAPES if tiny_mode(args) else SHAPES


def device_of(args):
    import torch

    return torch.device("cpu") if tiny_mode(args) else torch.device("cuda", 0)


def simulated_rank_device(args):
    """The device of the shapes' one simulated rank, made current; on the CPU one thread,
    denormals flushed (slow on CPUs, and no figure here depends on them)."""
    import torch

    device = device_of(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
    return device


def dump(path: Path, obj) -> None:
    """Write ``obj`` as JSON, atomically: a piece killed mid-write leaves the previous version."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def append(path: Path, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record, default=str) + "\n")


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


def load_env(out: Path) -> dict:
    """``OUT/env.json`` as far as the env piece wrote it ({} when it wrote nothing)."""
    try:
        return json.loads((out / "env.json").read_text())
    except (OSError, ValueError):
        return {}
