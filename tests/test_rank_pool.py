"""The test helper's rank pool leaves nothing of a task behind for the next one.

Every multi-rank test runs on the same live ranks (tests/distributed.py), so a
task's process groups must be gone, sockets and threads included, when the next
task starts: before they were collected explicitly, hundreds of dead gloo groups
piled up per rank over the suite, their event loops spinning on closed sockets.
"""

from __future__ import annotations

import os

from distributed import run_ranks


def _gloo_threads(rank: int, world: int) -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


def _sharded_step_in_a_cycle(rank: int, world: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "sp"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fully_shard(model, mesh=mesh["dp"])
    model(torch.ones(2, 8)).sum().backward()
    torch.distributed.all_reduce(torch.ones(1), group=mesh.get_group("sp"))
    model.cycle = [model, mesh]  # held only by a reference cycle, as real tasks' state often is


def test_a_tasks_process_groups_are_gone_before_the_next_task():
    before = run_ranks(4, _gloo_threads)
    for _ in range(3):
        run_ranks(4, _sharded_step_in_a_cycle)
    assert run_ranks(4, _gloo_threads) == before
