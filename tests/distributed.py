"""Run a function on N CPU ranks (gloo) from a test, on a pool of live ranks.

Spawning N interpreters that import torch costs seconds per call (6 s for 8
ranks on 2 cores), far more than most multi-rank tests themselves. So each
world size gets ONE pool of spawned processes per pytest session: they join a
gloo group once and then run one task after another. A task is
``fn(rank, world_size, *args)``; its return values come back as a list indexed
by rank.

What a task may rely on, and must leave as it found:
  * the default (world) process group is initialised and stays so: never
    init or destroy it; sub-groups (meshes) made by a task are destroyed after
    it, and dynamo's caches are reset;
  * global state (default dtype, grad mode, threads, registries) is restored
    by the pool where it is torch's, and by the task where it is anyone else's.
A task whose process groups outlive the cleanup retires its pool: the next call
forks fresh ranks from the preloaded server (about a second). The cleanup frees
what torch keeps of a task's meshes (DTensor's caches, the compiled functions
dynamo leaves in module globals), so few do.

An exception on any rank fails the test with that rank's traceback and the
pool is discarded (the other ranks may be stuck in a collective); the next
call starts a fresh one. A task that runs past ``timeout`` fails the same way.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=180)
TASK_TIMEOUT_S = 300.0

__all__ = ["run_ranks", "RankFailure", "destroy_subgroups", "release_task_state"]


class RankFailure(AssertionError):
    """A task failed (or hung) on a rank; the message holds the rank's traceback."""


def destroy_subgroups() -> None:
    """Destroy every process group but the world's (the meshes made so far), on every rank
    together: each gloo group holds sockets and threads in every rank. A task that builds
    many meshes calls this between them (nothing of the old meshes may be used after)."""
    dist.barrier()
    _destroy_groups_but_world()
    _free_dead_groups()


def release_task_state() -> None:
    """Drop what torch keeps of a finished task (compiled code, meshes) and free its groups.

    What the pool does after every task, for a test that runs a world in its own
    process and has just destroyed it: dynamo's caches and the compiled functions
    it left in module globals hold the task's modules and meshes.
    """
    torch._dynamo.reset()
    _drop_compiled_functions()
    _free_dead_groups()


def _destroy_groups_but_world() -> None:
    world = dist.group.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)


def _free_dead_groups() -> None:
    # destroy_process_group only unregisters a group: its sockets and threads go
    # when the object is freed, and the task's modules (FSDP state, meshes) hold
    # it in reference cycles that only a full collection breaks. Left to gc's own
    # schedule, hundreds of dead groups piled up per rank, their loops spinning
    # on sockets the peers had closed (load averages over 100 on 2 cores). The
    # caches that hold meshes go first, or the collection cannot free them.
    _clear_dtensor_caches()
    # One collection is not always enough: after a training task, one left 4 of a
    # rank's gloo loops alive and a second freed them.
    for _ in range(3):
        if not gc.collect():
            break


def _gloo_loops() -> int:
    """This process's gloo event-loop threads: one per live gloo group."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().startswith("gloo_tcp")
        except OSError:  # the thread ended meanwhile
            pass
    return n


def _clear_dtensor_caches() -> None:
    # DTensor caches sharding decisions per op and input specs (in Python and
    # in its C++ fast path). A DeviceMesh compares equal to any mesh of the same
    # layout and names, whatever its process groups, so a later task building
    # the same mesh would get output specs carrying this task's mesh, whose
    # groups were just destroyed ("Could not resolve the process group").
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # older torch: the Python cache only
        from torch.distributed.tensor import DTensor

        _clear_sharding_prop_cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear
    _clear_sharding_prop_cache()
    # Three more caches keep every mesh they saw (torch 2.13): redistribute's planners
    # and transform plans, keyed by spec, and the collective cost model's topology.
    # Their groups then outlived the task, which retired its pool: a full run started
    # 55 pools, and 9 with this cleanup (tests/README.md).
    import torch.distributed.tensor._collective_utils as collective_utils
    import torch.distributed.tensor._redistribute as redistribute

    topology = getattr(getattr(collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)
    for clear in (getattr(redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", None),
                  getattr(topology, "cache_clear", None)):
        if clear is not None:
            clear()


_DYNAMO_GLOBALS = ("__compiled_fn_", "__resume_at_")


def _drop_compiled_functions() -> None:
    """Remove what dynamo installed in the compiled code's module globals.

    Dynamo binds each compiled graph to a global of the module whose function it
    compiled (``__compiled_fn_<n>_<uuid>``), and ``torch._dynamo.reset()`` leaves
    those in place: the graph, its example values (the task's meshes) and their
    groups then outlive the task.
    """
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name in [n for n in names if isinstance(n, str) and n.startswith(_DYNAMO_GLOBALS)]:
            del names[name]


def _reset_between_tasks() -> None:
    # Sub-groups of the finished task (meshes) would otherwise accumulate:
    # every group holds sockets and threads in every rank.
    _destroy_groups_but_world()
    release_task_state()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)


def _worker(rank: int, world_size: int, store_path: str, tasks, results) -> None:
    # Before any task imports a transformers model: fla-core must not take its CPU paths.
    # (Python 3.11's forkserver ignores the parent's sys.path: tests/ is importable only here.)
    import transformers_torch_paths  # noqa: F401

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    dist.barrier()
    # What the server preloaded (torch, transformers: ~0.5M objects) lives as long as
    # the rank: out of the collector's sight, a full collection between tasks scans
    # only what the tasks made (0.3 s -> ~0 per rank and task, and the same for gc's own).
    gc.freeze()
    world_loops = _gloo_loops()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            value = fn(rank, world_size, *args)
            dist.barrier()  # finish together: no rank tears down what a peer still uses
            _reset_between_tasks()
            results.put((rank, True, value, _gloo_loops() > world_loops))
        except BaseException:  # noqa: BLE001 - report everything, the pool is discarded
            results.put((rank, False, traceback.format_exc(), True))
            break
    # The queue hands reports to a feeder thread: flush it before leaving. A
    # finished rank then skips interpreter teardown (ulysses_dtensor.runtime.process_group.exit_process).
    results.close()
    results.join_thread()
    from ulysses_dtensor.runtime.process_group import exit_process

    exit_process(0)


# What the server imports before it forks ranks: what most tasks import anyway
# (about 8 s of CPU per rank together). None leaves a thread running (checked
# with /proc/self/task), so a fork of the server is safe; a missing optional
# package is skipped. torchtitan imports pyarrow, whose jemalloc would start a
# background thread: conftest.py turns that thread off (JE_ARROW_MALLOC_CONF).
PRELOAD = [
    "torch", "torch.distributed", "ulysses_dtensor.models.llama_parallelize", "torch._functorch.aot_autograd",
    "torch._inductor.compile_fx", "transformers", "transformers.modeling_utils",
    "ulysses_dtensor.integrations.hf", "ulysses_dtensor.trainer.loop", "matplotlib.pyplot",
    "torchtitan.train",
    # transformers' Trainer and TRL (with datasets, peft, accelerate): 7 s of CPU per rank
    # that tests/test_hf_trainer.py's ranks would otherwise each pay; TRL's GRPO and DPO
    # trainers (tests/test_trl_grpo.py, tests/test_trl_dpo.py): 1 s more, once.
    "transformers.trainer", "trl.trainer.sft_trainer", "trl.trainer.grpo_trainer", "trl.trainer.dpo_trainer",
]


def _context():
    """Ranks are forked from one server process that imported torch once.

    Spawning each rank afresh costs an interpreter and its imports per rank
    (14 ranks over the three pools). The forkserver is itself a fresh
    interpreter (no threads, no CUDA, nothing initialised): it only imports,
    and every rank is a fork of that clean state.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Pool:
    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"ranks{world_size}-")
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, os.path.join(self.tmp, "store"), self.tasks[r], self.results),
                name=f"rank{r}of{world_size}",
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        # Set when a task left a process group alive past the cleanup (something
        # outside the task still holds it): the pool is then replaced, since a
        # dead group's loop spins once its peers close their ends.
        self.stale = False

    def run(self, fn, args, timeout: float) -> list:
        for q in self.tasks:
            q.put((fn, args))
        values: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(values) < self.world_size:
            try:
                rank, ok, payload, stale = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    raise RankFailure(f"{fn.__name__}: rank process(es) {dead} died without a report")
                if time.monotonic() > deadline:
                    raise RankFailure(f"{fn.__name__}: no result after {timeout:.0f} s (hang?)")
                continue
            if not ok:
                raise RankFailure(f"{fn.__name__} failed on rank {rank} of {self.world_size}:\n{payload}")
            values[rank] = payload
            self.stale |= stale
        return [values[r] for r in range(self.world_size)]

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close(graceful=True)
    _POOLS.clear()


def run_ranks(world_size: int, fn, *args, timeout: float = TASK_TIMEOUT_S) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return
    the per-rank return values (index = rank).

    ``fn`` must be a module-level function (it is pickled by reference), and
    ``args`` and return values picklable.
    """
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        values = pool.run(fn, args, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(graceful=False)
        raise
    if pool.stale:
        _POOLS.pop(world_size, None)
        pool.close(graceful=True)
    return values
