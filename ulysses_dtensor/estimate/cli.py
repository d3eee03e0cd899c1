"""Command line: ``python -m ulysses_dtensor.estimate``."""

from __future__ import annotations

import argparse
import json
import sys

from .disk import ATTENTION_TFLOPS, DISK_GBPS, MATMUL_TFLOPS, STAGING_LAYERS
from .plan import GIB
from .planner import plan_memory
from .search import HOST_BUDGET_GIB, PRECISION, find_max_seq_len

_EPILOG = """\
Every other --section.key value is a config override, as for the trainer
(e.g. --parallelism.sp 8 --memory.tiled_loss true --model.vocab_size 128256).

With memory.offload_dir (the disk tier; --memory.offload_dir DIR) the offloaded
layer inputs are planned on that disk (--disk-gib per GPU), the host holding a
staging area of a few layers and the parameter state; the directory is not touched.

The figure is allocated-tensor bytes (torch.cuda.max_memory_allocated), not
nvidia-smi: keep --headroom-gib for the caching allocator, CUDA context and NCCL.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ulysses_dtensor.estimate",
        description="Per-rank peak memory of one training step, traced on fake tensors.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--config", help="trainer TOML config")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to simulate (default: dp_replicate*dp_shard*sp of the config, dp_shard=-1 and sp=auto as 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's longest stage)")
    p.add_argument("--rows", type=int, default=None,
                   help="sequences per dp rank in the step (default: from the config; 1 with --max-seq-len)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="plan for GPUs (default) or CPU")
    p.add_argument("--layers", choices=("full", "extrapolate", "auto"), default=None,
                   help="full trace, or 4/5/6-layer traces extrapolated linearly in the layer count; "
                        "auto (default): whichever costs less to trace")
    p.add_argument("--foreach", choices=("true", "false"), default=None, help="AdamW foreach (default: torch's choice)")
    p.add_argument("--loops", choices=("edges", "all"), default="edges",
                   help="trace the first and last two pieces of each loop over the sequence (tiles, chunks; "
                        "default: the same memory, at a cost independent of the length) or all of them")
    p.add_argument("--gpu", default=None,
                   help="the GPU planned for: its attention kernels (auto's row of the kernel table for each "
                        "case) decide what attention keeps; a name (H100, H200, B200, A100, ...) or sm90 "
                        "(default: this machine's GPU, else H100)")
    p.add_argument("--gpu-torch", default=None, help="torch version on that GPU machine (default: this torch's)")
    p.add_argument("--gpu-cudnn", default=None,
                   help="cuDNN version there (default: what torch's CUDA 13 wheels ship, 9.15.1)")
    p.add_argument("--gpu-packages", default="",
                   help="attention packages installed there, comma-separated: flash_attn, fa4 (default: none)")
    p.add_argument("--max-seq-len", action="store_true",
                   help="search the longest sequence that fits the device budget and the host budget")
    p.add_argument("--budget-gib", type=float, default=80.0, help="device memory in GiB (default 80)")
    p.add_argument("--headroom-gib", type=float, default=6.0,
                   help="kept free for allocator fragmentation, CUDA context, NCCL (default 6)")
    p.add_argument("--host-budget-gib", type=float, default=HOST_BUDGET_GIB,
                   help=f"host memory per GPU for offloaded activations and parameter state, GiB (default "
                        f"{HOST_BUDGET_GIB:g}: an 8-GPU node with 2 TiB of RAM, 16 GiB per GPU kept for the rest; "
                        f"0: no host ceiling)")
    p.add_argument("--disk-gib", type=float, default=0.0,
                   help="with memory.offload_dir: disk per GPU for the offloaded layer inputs, GiB (default 0: no "
                        "disk ceiling; 3500 is about one 3.84 TB drive per GPU)")
    p.add_argument("--disk-gbps", type=float, default=DISK_GBPS,
                   help=f"with memory.offload_dir: the disk's bandwidth per GPU each way, GB/s, for the MODELLED step "
                        f"time (default {DISK_GBPS:g}, an assumption: pass the figure measured there); the pinned "
                        f"staging area holds {STAGING_LAYERS} layers' worth")
    p.add_argument("--achieved-tflops", type=float, nargs="+", default=None, metavar="TFLOPS",
                   help=f"the MODELLED step time's achieved rates, TFLOP/s: one for everything, or attention then "
                        f"matmuls (default {ATTENTION_TFLOPS:g} {MATMUL_TFLOPS:g}: Hopper, SDPA forward+backward "
                        f"and a large bf16 matmul)")
    p.add_argument("--precision", type=float, default=100 * PRECISION,
                   help=f"percent: the limit lies within this above the answer (default {100 * PRECISION:g})")
    p.add_argument("--granularity", type=int, default=None,
                   help="search multiples of this many tokens per sp rank instead, the next one up planned "
                        "not to fit (slower)")
    p.add_argument("--confirm", action="store_true",
                   help="re-plan the answer and the next length up with every layer traced")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--grpo", action="store_true",
                   help="plan a GRPO step of UlyssesGRPOTrainer instead (the reference model's forward, per-token "
                        "log-probabilities; seq_len = prompt + completion): ulysses_dtensor.estimate.grpo")
    p.add_argument("--grpo-beta0", action="store_true", help="with --grpo: no reference model (beta = 0)")
    p.add_argument("--grpo-iterations", type=int, default=1,
                   help="with --grpo: num_iterations (> 1 adds the old policy's forward at rollout time)")
    return p


def _step_kind(ns):
    """(plan, prepare) of the step planned: a training step, or with --grpo a GRPO step."""
    if not ns.grpo:
        return plan_memory, None
    import functools

    from .grpo import grpo_plan, prepare_grpo

    options = dict(reference=not ns.grpo_beta0, old_policy=ns.grpo_iterations > 1)
    return functools.partial(grpo_plan, **options), functools.partial(prepare_grpo, **options)


def _search_report(res) -> str:
    limit = res.budget_gib - res.headroom_gib
    lines = [f"PLANNED longest sequence: {res.answer()}"]
    best, nxt = res.best, res.next_up
    device = (f"device: {res.budget_gib:g} GiB - {res.headroom_gib:g} GiB headroom = {limit:g} GiB of "
              f"allocated tensors per GPU")
    host = (f"host: {res.host_budget_gib:g} GiB per GPU (--host-budget-gib)" if res.host_budget_gib is not None
            else "host: no ceiling")
    if best is not None:
        device += f", {best.peak_gib:.2f} GiB at the answer"
        if res.host_budget_gib is not None:
            host += f", {best.host_bytes / GIB:.1f} GiB at the answer"
    lines.append(f"  ceilings: {device}; {host}")
    if res.disk_tier:
        disk = (f"disk: {res.disk_budget_gib:g} GiB per GPU (--disk-gib)" if res.disk_budget_gib is not None
                else "disk: no ceiling")
        if best is not None:
            rest = best.host_bytes - best.staging_bytes
            disk += (f", {best.disk_bytes / GIB:.1f} GiB at the answer; the host holds the staging area "
                     f"({STAGING_LAYERS} layers, {best.staging_bytes / GIB:.1f} GiB)"
                     + (f" and {rest / GIB:.1f} GiB of parameter state and the rest" if rest > 0.05 * GIB else ""))
        lines.append(f"  {disk}")
    if res.binding is not None:
        lines.append(f"  binding ceiling: {res.binding}" + ("" if res.binding == "disk" else " memory"))
    if nxt is not None:
        over = f"{nxt.peak_gib:.2f} GiB on the device"
        if res.host_budget_gib is not None:
            over += f", {nxt.host_bytes / GIB:.1f} GiB on the host"
        if res.disk_tier:
            over += f", {nxt.disk_bytes / GIB:.1f} GiB on the disk"
        lines.append(f"  {nxt.seq_len:,} tokens does not fit: {over}")
    made = "every layer traced" if res.confirmed else "extrapolated from 4/5/6-layer traces"
    lines.append(f"  search: {len(res.plans)} lengths planned ({made}), {res.traces} traced steps, "
                 f"{res.seconds:.0f} s; lengths are multiples of {res.unit:,} tokens")
    if best is not None:
        lines.append(best.format())
    return "\n".join(lines)


def _target(ns):
    """The machine --gpu* name (None: planning's default), or a ConfigError."""
    import torch

    from ..attention import Capabilities
    from ..trainer.config import ConfigError

    named = [f"--{k.replace('_', '-')}" for k in ("gpu", "gpu_torch", "gpu_cudnn", "gpu_packages") if getattr(ns, k)]
    if not named:
        return None
    if ns.device == "cpu":
        raise ConfigError(f"{', '.join(named)}: a GPU is planned for with --device cuda, not cpu")
    packages = tuple(p.strip() for p in ns.gpu_packages.split(",") if p.strip())
    try:
        return Capabilities.target(ns.gpu or "H100", ns.gpu_torch or torch.__version__, cudnn=ns.gpu_cudnn,
                                   packages=packages)
    except ValueError as e:
        raise ConfigError(f"{', '.join(named)}: {e}") from None


def _rates(ns) -> dict:
    """The MODELLED step time's assumptions as keywords of the planner, or a ConfigError."""
    from ..trainer.config import ConfigError
    from .disk import Rates

    tflops = ns.achieved_tflops
    try:
        Rates.of(tflops, ns.disk_gbps)
    except ValueError as e:
        raise ConfigError(f"--achieved-tflops / --disk-gbps: {e}") from None
    return {"disk_gbps": ns.disk_gbps, "achieved_tflops": tflops}


def main(argv: list[str] | None = None) -> int:
    from ..trainer.config import ConfigError, load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    ns, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(rest + (["--config", ns.config] if ns.config else []))
        target = _target(ns)
        foreach = None if ns.foreach is None else ns.foreach == "true"
        plan_step, prepare = _step_kind(ns)
        rates = _rates(ns)
        if ns.max_seq_len:
            log = None if ns.json else (lambda s: print(s, file=sys.stderr, flush=True))
            if not 0 < ns.precision < 100:
                raise ConfigError(f"--precision {ns.precision:g} must be a percentage between 0 and 100 (e.g. 0.5)")
            if ns.host_budget_gib < 0:
                raise ConfigError(f"--host-budget-gib {ns.host_budget_gib:g} must be GiB per GPU (0: no host ceiling)")
            if ns.disk_gib < 0:
                raise ConfigError(f"--disk-gib {ns.disk_gib:g} must be GiB per GPU (0: no disk ceiling)")
            if ns.granularity is not None and ns.granularity < 1:
                raise ConfigError(f"--granularity {ns.granularity} must be a positive number of tokens per sp rank")
            res = find_max_seq_len(
                cfg, ns.world_size, budget_gib=ns.budget_gib, headroom_gib=ns.headroom_gib,
                host_budget_gib=ns.host_budget_gib or None, precision=ns.precision / 100,
                granularity=ns.granularity, rows=ns.rows or 1, device=ns.device,
                layers=ns.layers or "auto", foreach=foreach, loops=ns.loops, confirm=ns.confirm, log=log,
                target=target, prepare=prepare, disk_budget_gib=ns.disk_gib or None, **rates,
            )
            if ns.json:
                print(json.dumps(res.to_dict()))
                return 0
            print(_search_report(res))
            return 0
        plan = plan_step(
            cfg, ns.world_size, ns.seq_len, rows=ns.rows, device=ns.device,
            layers=ns.layers or "auto", foreach=foreach, loops=ns.loops, target=target, **rates,
        )
        print(json.dumps(plan.to_dict()) if ns.json else plan.format())
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
