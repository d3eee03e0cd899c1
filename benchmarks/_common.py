"""Helpers shared by the benchmark scripts.

* ``env_info`` / ``emit``: every benchmark prints one JSON object per
  configuration, stamped with the device, torch version and date.
* ``summarize`` / ``timed_interleaved``: medians after warm-up, with the
  variants of one configuration measured round-robin in the same loop so that
  noise from other processes hits them alike (compare ratios, not absolutes).
* ``PeakMemory``: the allocator's high-water mark over a region, relative to
  its start. CUDA: ``torch.cuda.max_memory_allocated``. CPU: there is no
  peak counter, so the region runs under the PyTorch profiler with
  ``profile_memory=True`` and the peak is read off the allocator's own
  alloc/free events (the prefix-sum maximum). Both count bytes handed out by
  torch's allocator to tensors; neither counts allocator caching, NCCL/gloo
  internal buffers or the Python heap. The CPU profile is a separate, untimed
  pass.
* ``C10dCounter``: counts the non-functional ``c10d`` collectives (what
  ``torch.distributed.all_to_all_single`` dispatches to) and their bytes, for
  peers that do not use functional collectives (DeepSpeed).
* ``launch_ranks``: spawn N ranks (gloo on CPU, nccl on CUDA) with a FileStore
  rendezvous; rank 0 hands records back through a queue and only the parent
  writes to stdout, so stdout stays pure JSON lines. Under ``torchrun`` the
  worker runs in-process instead (``torchrun_env``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import queue as queue_mod
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_dtensor.runtime.process_group import (
    exit_process,
    finish_together,
    process_group_backend,
)

RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=600)


# --------------------------------------------------------------------------- #
# Environment stamp and output
# --------------------------------------------------------------------------- #


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_device_dtype(args) -> None:
    """``--device auto`` / ``--dtype auto``: CUDA in bf16 when there is a GPU, else CPU in fp32."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {cpu_model()} ({usable_cores()} cores)"


def env_info(device: torch.device) -> dict:
    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def emit(record: dict, stream=None) -> None:
    """Print one JSON object on one line and flush (so sweeps stream)."""
    stream = stream or sys.stdout
    stream.write(json.dumps(record, sort_keys=False) + "\n")
    stream.flush()


def parse_json_lines(text: str) -> list[dict]:
    """The JSON objects among the lines of ``text`` (other lines ignored)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(seconds: Sequence[float]) -> dict:
    """Median / min / max / interquartile range, in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    if len(ms) >= 4:
        q = statistics.quantiles(ms, n=4)
        iqr = q[2] - q[0]
    else:
        iqr = ms[-1] - ms[0]
    return {
        "median_ms": round(statistics.median(ms), 4),
        "min_ms": round(ms[0], 4),
        "max_ms": round(ms[-1], 4),
        "iqr_ms": round(iqr, 4),
        "n": len(ms),
    }


def timed_interleaved(
    fns: dict[str, Callable[[], None]],
    *,
    warmup: int,
    iters: int,
    device: torch.device,
    barrier: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time each callable ``iters`` times after ``warmup`` untimed rounds.

    Variants run round-robin inside each iteration, the starting variant
    rotating, so that slow phases of a shared machine hit all of them. With a
    ``barrier`` every timed call starts with the ranks lined up. Returns the
    per-iteration seconds of each variant on this rank: wall seconds, or what
    ``clock`` counts (``time.process_time``: this process's CPU seconds).
    """
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for it in range(warmup + iters):
        order = names[it % len(names):] + names[: it % len(names)]
        for name in order:
            sync(device)
            if barrier is not None:
                barrier()
            t0 = clock()
            fns[name]()
            sync(device)
            dt = clock() - t0
            if it >= warmup:
                times[name].append(dt)
    return times


def ratio_of_medians(x: Sequence[float], y: Sequence[float], digits: int = 4) -> float:
    return round(statistics.median(x) / statistics.median(y), digits)


def paired_ratio(x: Sequence[float], y: Sequence[float], digits: int = 4) -> float:
    """Median over iterations of x[i] / y[i].

    ``timed_interleaved`` runs the variants of iteration i back to back, so a
    slow phase of a shared machine inflates both; the per-iteration ratio
    cancels most of it and is steadier than the ratio of medians.
    """
    return round(statistics.median(a / b for a, b in zip(x, y)), digits)


def max_over_ranks(times: dict[str, list[float]], device: torch.device) -> dict[str, list[float]]:
    """Per iteration, the slowest rank's time (a step is as slow as its slowest rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    names = list(times)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: t[i].tolist() for i, n in enumerate(names)}


# --------------------------------------------------------------------------- #
# Peak memory and op profile
# --------------------------------------------------------------------------- #


class PeakMemory:
    """High-water mark of allocated bytes over a region, relative to its start.

    On CUDA this is ``max_memory_allocated() - memory_allocated()`` at entry.
    On CPU the region runs under the PyTorch profiler (``profile_memory=True``)
    and the peak is the running maximum of the bytes allocated in the region
    and not yet freed, from the allocator's alloc/free events: the same
    quantity for the CPU allocator. Free what the previous step left (grads,
    outputs) before entering, as for ``max_memory_allocated``. The profiler
    slows the region down: never time inside it.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes: int | None = None
        self._prof = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self._prof is not None:
            self._prof.__exit__(*exc)
        if exc[0] is not None:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self.peak_bytes = _peak_from_memory_events(self._prof)
        return False


def _peak_from_memory_events(prof) -> int:
    """Peak bytes of CPU blocks allocated inside the profiled region and still live.

    Walks the profiler's allocation events in time order. Frees of blocks that
    were allocated before the region are ignored (their size is not known
    reliably: the CPU allocator only records sizes while profiling is on), so
    the figure is the region's own high-water mark, like
    ``max_memory_allocated() - memory_allocated()`` with nothing freed early.
    """
    alloc_tag = torch._C._profiler._EventType.Allocation
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == alloc_tag and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
    events.sort(key=lambda e: e[0])
    live: dict[int, int] = {}
    level = peak = 0
    for _, nbytes, ptr in events:
        if nbytes > 0:
            live[ptr] = nbytes
            level += nbytes
            peak = max(peak, level)
        elif ptr in live:
            level -= live.pop(ptr)
    return peak


# ops that write a fresh copy of their input (layout changes, packing, head
# repetition, zero-fill, gradient accumulation): where copies are looked for
COPY_OPS = ("aten::copy_", "aten::cat", "aten::index_select", "aten::fill_", "aten::add_")


def profile_ops(fn: Callable[[], object], element_size: int, ops: Sequence[str] = COPY_OPS) -> dict:
    """Run ``fn`` once under the CPU profiler and return ``op_table`` of it.

    Run it with no TorchDispatchMode active: a mode re-dispatches every op and
    the profiler would list it twice.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return op_table(prof, element_size, ops)


def op_table(prof, element_size: int, ops: Sequence[str] = COPY_OPS) -> dict:
    """Per copy-like op of a profiled region: calls, self CPU ms, bytes written.

    Bytes are the first input's size (the destination of ``copy_``/``fill_``/
    ``add_``) where the profiler recorded its shape (``record_shapes=True``);
    ``cat`` takes a list, whose shapes the profiler does not record, so its
    bytes are reported as ``None``.
    """
    table: dict[str, dict] = {}
    for e in prof.events():
        if e.name not in ops:
            continue
        row = table.setdefault(e.name, {"calls": 0, "self_ms": 0.0, "bytes": 0})
        row["calls"] += 1
        row["self_ms"] += e.self_cpu_time_total / 1e3
        shapes = getattr(e, "input_shapes", None) or []
        if shapes and shapes[0] and row["bytes"] is not None:
            numel = 1
            for dim in shapes[0]:
                numel *= int(dim)
            row["bytes"] += numel * element_size
        else:
            row["bytes"] = None
    for row in table.values():
        row["self_ms"] = round(row["self_ms"], 3)
    return table


# --------------------------------------------------------------------------- #
# Counting non-functional c10d collectives
# --------------------------------------------------------------------------- #


@dataclass
class C10dRecord:
    op: str
    input_bytes: int
    group_size: int

    @property
    def sent_bytes(self) -> int:
        if self.op.startswith("alltoall"):
            return self.input_bytes * (self.group_size - 1) // self.group_size
        return self.input_bytes


@dataclass
class C10dCounter(TorchDispatchMode):
    """Counts ``c10d::*`` ops (``torch.distributed.*`` calls) and their input bytes.

    ``torch.distributed.all_to_all_single(out, inp)`` dispatches to
    ``c10d::alltoall_base_(out, inp, group, ...)``; the bytes are ``inp``'s.
    Functional collectives (``_c10d_functional``) are left to
    ``ulysses_dtensor.parallel.comm_stats.CollectiveCounter``.
    """

    records: list[C10dRecord] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    _INPUT_ARG = {"alltoall_base_": 1}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            name = func._overloadpacket.__name__
            idx = self._INPUT_ARG.get(name, 0)
            tensor = args[idx] if len(args) > idx else None
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            tensors = [t for t in _flatten(tensors) if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            size = group.size() if group is not None else dist.get_world_size()
            if name not in ("barrier", "monitored_barrier_"):
                self.records.append(C10dRecord(name, nbytes, size))
        return func(*args, **kwargs)

    def counts(self) -> dict[str, int]:
        return dict(Counter(r.op for r in self.records))

    def sent_bytes(self, op: str | None = None) -> int:
        return sum(r.sent_bytes for r in self.records if op is None or r.op == op)


def _flatten(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


# --------------------------------------------------------------------------- #
# Launching ranks
# --------------------------------------------------------------------------- #


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when launched by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    ):
        return (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        )
    return None


def init_distributed(
    device_type: str, rank: int, world_size: int, local_rank: int, store_path: str | None,
    cpu_collectives: bool = False,
) -> torch.device:
    """Init the default process group (gloo on CPU, nccl on CUDA); return this rank's device.

    ``cpu_collectives``: on CUDA add gloo for CPU tensors (host-offloaded parameters).
    """
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = process_group_backend(device_type, cpu_collectives)
    kwargs = {"backend": backend, "rank": rank, "world_size": world_size, "timeout": RENDEZVOUS_TIMEOUT}
    if store_path is not None:
        kwargs["init_method"] = f"file://{store_path}"
    if device_type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    return device


def stdout_for_records():
    """Keep a handle on stdout for JSON records, then send fd 1 to stderr.

    Libraries (DeepSpeed's logger, C++ prints) write to stdout; after this
    they land on stderr and stdout carries JSON lines only.
    """
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _rank_entry(rank, world_size, store_path, device_type, threads, out_queue, fn, args, cpu_collectives):
    # Only the parent writes to stdout: route this rank's prints to stderr.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    device = init_distributed(device_type, rank, world_size, rank, store_path, cpu_collectives)

    def report(record: dict) -> None:
        if rank == 0:
            out_queue.put(record)

    with finish_together():
        fn(rank, world_size, device, report, *args)
    # Records go through the queue's feeder thread: let it finish first.
    out_queue.close()
    out_queue.join_thread()
    exit_process(0)  # done and flushed: skip the teardown that can abort (see runtime)


def launch_ranks(
    world_size: int,
    fn,
    args: tuple,
    *,
    device_type: str = "cpu",
    threads: int = 1,
    on_record: Callable[[dict], None] = emit,
    cpu_collectives: bool = False,
) -> bool:
    """Run ``fn(rank, world_size, device, report, *args)`` on ``world_size`` new ranks.

    ``report(record)`` on rank 0 hands a dict to ``on_record`` in the parent as
    soon as it is produced. Returns False (after printing the traceback to
    stderr) when a rank failed. ``fn`` must be a module-level function.
    """
    # Ranks fork from a server process that imported torch once (and the benchmark,
    # whose functions the ranks run): a spawned rank would import torch itself, seconds
    # each. The server initialises nothing (no CUDA), so its forks are clean.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "torch.distributed"])
    out_queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        pc = mp.start_processes(
            _rank_entry,
            args=(world_size, store, device_type, threads, out_queue, fn, args, cpu_collectives),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        ok = True
        done = False
        while not done:
            try:
                done = pc.join(timeout=0.2)
            except Exception:  # a rank raised: its traceback is in the message
                traceback.print_exc(file=sys.stderr)
                ok = False
                done = True
            _drain(out_queue, on_record)
        time.sleep(0.05)
        _drain(out_queue, on_record)
    return ok


def _drain(q, on_record) -> None:
    while True:
        try:
            record = q.get_nowait()
        except (queue_mod.Empty, EOFError, OSError):
            return
        on_record(record)
