"""The kit's shape pieces: which variants of a shape are measured, in what order, and
measuring them (``python benchmarks/gpu_perf.py shape --shape llama --out OUT``).

A variant is an attention kernel with an activation-checkpointing mode (and, for
later variants, more ``bench_train.py`` flags). Every variant is measured at two
layer counts or more, so that it has a line of its own to scale to full depth;
the report gives no figure for a variant with fewer (``_gpu_perf_figures.py``).

Order (:func:`plan_variants`): the kernel ``auto`` picks, full AC then
``save_attention``; then ``varlen``; then the other backends that ran in the env
piece; then the backends that compile (flex), last, as their first call compiles
cold. A backend whose forward dispatched, in the env piece, to the same kernel as
one already in the list (our ``sdpa`` on Hopper is cuDNN, what ``auto`` picks) is
not measured again, and the plan says so. Then `auto` without head chunks, where the
shape's default runs them. To add a variant, add a :class:`Variant` to
:data:`EXTRA_VARIANTS`.

A variant is started only if it is expected to finish within what is left of the
piece's time: its cost is estimated from the first variant's cost per layer count.
Everything is appended to ``OUT/shape_<shape>.jsonl`` as it happens: first the plan,
then one record per layer count measured (or skipped, or failed).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from _gpu_perf_common import COMMON, COMPILES, append, first_line, load_env, shapes, simulated_rank_device, tiny_mode

# Seconds a compiling backend is allowed for its cold compile, on top of its steps.
COMPILE_ALLOWANCE_S = {"cuda": 60.0, "cpu": 0.0}
SAFETY = 1.25  # estimated cost x this must fit in the time left


@dataclass(frozen=True)
class Variant:
    """One kernel and AC mode of a shape; ``argv``: more ``bench_train.py`` flags."""

    kernel: str
    save_attention: bool = False
    argv: tuple[str, ...] = ()
    label: str = ""  # words after the kernel and AC mode in the report (e.g. "head chunks 4")

    @property
    def ac(self) -> str:
        return "save_attention" if self.save_attention else "full"

    def name(self, auto_is: str | None = None) -> str:
        kernel = f"auto ({auto_is})" if self.kernel == "auto" and auto_is else self.kernel
        ac = "full AC" if self.ac == "full" else "save_attention"
        return f"{kernel} / {ac}" + (f" / {self.label}" if self.label else "")


# At the kit's GPU shapes `auto` runs head chunks (one query head per chunk: the exchanged
# working set passes parallel/head_chunk_plan.AUTO_MIN_BYTES), so the variant that prices them is
# the same kernel with none. Where the shape's default runs none it would repeat `auto`.
NO_HEAD_CHUNKS = Variant("auto", argv=("--head-chunks", "1"), label="no head chunks")

# FP8 linear layers (torchao, rowwise: SP needs nothing for it) on the kernel auto picks: its
# speed-up against the bf16 `auto` variant, after every bf16 variant of that kernel.
FP8_ROWWISE = Variant("auto", argv=("--float8", "rowwise"), label="FP8 rowwise")

# The disk tier (issue 54) against host offload at the same shape, where both fit: the offloaded
# layer inputs in host memory, then in a file in the kit's disk directory (bench_argv puts it in
# place of OFFLOAD_DIR: GPU_PERF_DISK_DIR, which gpu_perf.sh sets).
OFFLOAD_DIR = "{offload_dir}"
HOST_OFFLOAD = Variant("auto", argv=("--offload-activations",), label="host offload")
DISK_TIER = Variant("auto", argv=("--offload-activations", "--offload-dir", OFFLOAD_DIR), label="disk tier")

# Variants after the backends' own, before the compiling ones.
EXTRA_VARIANTS: tuple[Variant, ...] = (NO_HEAD_CHUNKS, FP8_ROWWISE, HOST_OFFLOAD, DISK_TIER)


def auto_head_chunks(shape: dict, sp: int = 8) -> int:
    """The head chunks ``bench_train.py`` runs at ``shape`` when none is named (bf16)."""
    from _train_record import run_head_chunks
    from bench_train import parse_override, parse_size

    from ulysses_dtensor.models.llama import llama_args

    args = llama_args(shape["flavor"], **dict(parse_override(o) for o in shape["overrides"]))
    return run_head_chunks(None, 1, parse_size(shape["local_seq"]) * sp, args, sp, 2)


def plan_variants(env: dict, device_type: str, auto_chunks: int | None = None
                  ) -> tuple[list[Variant], dict[str, str]]:
    """The variants to measure, in order, and the backends left out with the reason.
    ``auto_chunks``: the head chunks ``auto`` runs at the shape (1: the no-chunks variant
    would repeat it, and is left out)."""
    auto_is = env.get("auto")
    kernels = env.get("kernels") or {}
    variants = [Variant("auto"), Variant("auto", save_attention=True)]
    left_out: dict[str, str] = {}
    extra = list(EXTRA_VARIANTS)
    if device_type == "cpu":  # the smoke run keeps to auto's two variants (their timing matters nowhere)
        left_out.update({v.label: "on a GPU only: the CPU smoke run measures auto's two variants" for v in extra})
        extra = []
    if FP8_ROWWISE in extra and importlib.util.find_spec("torchao") is None:
        extra.remove(FP8_ROWWISE)
        left_out[FP8_ROWWISE.label] = ("torchao is not installed here (the 'float8' extra; offline: carry its wheel, "
                                       "scripts/kernel_wheels.sh)")
    if auto_chunks == 1 and NO_HEAD_CHUNKS in extra:
        extra.remove(NO_HEAD_CHUNKS)
        left_out[NO_HEAD_CHUNKS.label] = "auto runs no head chunks at this shape (a small working set): it is auto"
    if not kernels:
        left_out["other kernels"] = ("env.json has no kernel trials (the env piece did not get that far): "
                                     "which kernels run here is unknown")
        return variants + extra, left_out
    backends = list(env.get("backends") or kernels)
    order = [b for b in ("varlen",) if b in backends]
    order += [b for b in backends if b not in ("auto", "varlen") and b not in COMPILES]
    order += [b for b in backends if b in COMPILES]
    auto_dispatch = tuple((kernels.get("auto") or {}).get("dispatch") or ())
    seen = {auto_dispatch: f"auto ({auto_is})"} if auto_dispatch else {}
    for b in order:
        trial = kernels.get(b) or {}
        if b == auto_is:
            left_out[b] = "what `auto` runs here: measured as auto"
        elif trial.get("runs") is False:
            left_out[b] = f"does not run here: {trial.get('error') or 'no reason recorded'}"
        elif trial.get("runs") is None and not (b in COMPILES and device_type == "cuda"):
            left_out[b] = "not tried by the env piece"
        elif tuple(trial.get("dispatch") or ()) in seen:
            dispatch = tuple(trial["dispatch"])
            left_out[b] = f"dispatches to the same kernel as {seen[dispatch]} ({', '.join(dispatch)}): not measured twice"
        else:
            if trial.get("dispatch"):
                seen[tuple(trial["dispatch"])] = b
            variants.append(Variant(b))
    # Extra variants before the compiling backends (flex stays last).
    n_plain = next((i for i, v in enumerate(variants) if v.kernel in COMPILES), len(variants))
    return variants[:n_plain] + extra + variants[n_plain:], left_out


def bench_argv(shape: dict, device, kernel: str, layers: list[int], *, save_attention: bool,
               extra: tuple[str, ...] = ()) -> list[str]:
    argv = [*COMMON, "--flavor", shape["flavor"], "--local-seq", shape["local_seq"], "--attn-backend", kernel,
            "--device", device.type, "--warmup", str(shape["warmup"]), "--iters", str(shape["iters"]),
            "--layers", *map(str, layers),
            *(os.environ.get("GPU_PERF_DISK_DIR") or tempfile.gettempdir() if x == OFFLOAD_DIR else x for x in extra)]
    for o in shape["overrides"]:
        argv += ["--override", o]
    if len(set(layers)) >= 2:
        argv += ["--extrapolate-layers", str(shape["layers"])]
    if save_attention:
        argv.append("--save-attention")
    if device.type == "cpu":  # the smoke run: one thread, timed in CPU seconds (other processes do not count)
        argv += ["--threads", "1", "--cpu-clock"]
    return argv


class CostModel:
    """Seconds one variant takes at a list of layer counts: a line in the layer count through
    the first variant's measured (build + steps) seconds per layer count."""

    def __init__(self):
        self.points: dict[int, float] = {}

    def add(self, layers: int, seconds: float) -> None:
        self.points.setdefault(layers, seconds)

    def estimate(self, layers: list[int]) -> float | None:
        if not self.points:
            return None
        xs = sorted(self.points)
        if len(xs) == 1:  # the cost of one layer count: scale it, the fixed part counted as one layer
            per = self.points[xs[0]] / (xs[0] + 1)
            return sum(per * (n + 1) for n in layers)
        n = len(xs)
        mx, my = sum(xs) / n, sum(self.points[x] for x in xs) / n
        slope = sum((x - mx) * (self.points[x] - my) for x in xs) / sum((x - mx) ** 2 for x in xs)
        icpt = my - slope * mx
        return sum(max(icpt + slope * n_layers, 0.0) for n_layers in layers)


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
    env = load_env(args.out)
    auto_is = env.get("auto")
    variants, left_out = plan_variants(env, device.type, auto_head_chunks(shape))
    fit = shape["fit"]
    layers_of = {v: fit if (v.kernel, v.ac) == ("auto", "full") else fit[:2] for v in variants}
    append(out, {"plan": {"shape": args.shape, "title": shape["title"], "tiny": tiny_mode(args), "auto_is": auto_is,
                          "full_layers": shape["layers"], "variants": [v.name(auto_is) for v in variants],
                          "layers": {v.name(auto_is): layers_of[v] for v in variants}, "left_out": left_out}})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    cost = CostModel()
    ok = True
    try:
        pmesh = ParallelDims(dp_replicate=1, dp_shard=-1, sp=8, world_size=8).build_mesh(device.type)
        for i, v in enumerate(variants):
            layers = layers_of[v]
            tag = {"shape": args.shape, "title": shape["title"], "variant": v.name(auto_is), "kernel": v.kernel,
                   "auto_is": auto_is, "ac": v.ac, "full_layers": shape["layers"], "layers": layers,
                   "tiny": tiny_mode(args)}
            left = deadline - time.monotonic()
            need = cost.estimate(layers) if i else None
            if need is not None:
                need = need * SAFETY + (COMPILE_ALLOWANCE_S[device.type] if v.kernel in COMPILES else 0.0)
                if need > left:
                    append(out, {"kit": tag, "skipped": f"not enough time left in this piece ({left:.0f} s; this "
                                                        f"variant at {layers} layers: about {need:.0f} s)"})
                    continue
            t0 = last = time.monotonic()

            def report(record, tag=tag, first=i == 0):
                nonlocal last
                now = time.monotonic()
                if first and "extrapolated" not in record and "config" in record:
                    cost.add(record["config"]["model"]["n_layers"], now - last)
                last = now
                append(out, {"kit": tag, **record})

            try:
                a = B.parse_args(bench_argv(shape, device, v.kernel, layers, save_attention=v.save_attention,
                                            extra=v.argv))
                ok &= B.sweep(a, pmesh, device, report, simulate=True)
            except Exception as e:  # noqa: BLE001 -- one variant failing must not stop the others
                append(out, {"kit": tag, "error": first_line(e)})
                traceback.print_exc()
                ok = False
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"gpu_perf: {args.shape} {tag['variant']} layers {layers}: {time.monotonic() - t0:.1f} s",
                  file=sys.stderr)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1
