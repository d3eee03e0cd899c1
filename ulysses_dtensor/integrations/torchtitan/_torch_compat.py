"""The torch APIs torchtitan 0.3.0's trainer calls that the supported torch releases lack.

* ``Trainer.train`` shortens every process group's timeout after the first
  step with ``torch.distributed.set_timeout``, which torch added after 2.13
  (pytorch PR #187387 made the private ``_set_pg_timeout`` public under that
  name). On torch 2.11-2.13 the trainer would stop with an AttributeError after
  step 1, so the Ulysses trainer provides the name, bound to torch's own
  function, where it is missing.
* Under pipeline parallelism the trainer (and validator) hand the schedule
  micro-batches it already split: ``schedule.step(arg_mbs=, kwarg_mbs=,
  target_mbs=, ...)``. torch 2.13's ``step`` takes a whole batch and would
  treat those lists as model arguments; its ``_step_microbatches`` takes them
  as they are. :func:`ensure_microbatch_step` gives one schedule object that
  keyword form, doing what torch's ``step`` does around ``_step_microbatches``.

Nothing else is touched.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout


def ensure_set_timeout() -> bool:
    """Provide ``torch.distributed.set_timeout`` if absent; return whether it was added."""
    if hasattr(dist, "set_timeout"):
        return False
    dist.set_timeout = _set_pg_timeout
    return True


def ensure_microbatch_step(schedule) -> bool:
    """Let ``schedule.step`` take pre-split micro-batches if torch's does not; return whether it was added."""
    if "arg_mbs" in inspect.signature(type(schedule).step).parameters:
        return False
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])

    def step(*, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
             loss_kwargs=None, target=None):
        if target is not None:
            raise TypeError("pass target_mbs (one target per micro-batch), not target")
        for stage in stages:  # per iteration, as torch's step
            stage.has_backward = schedule._has_backward  # False under schedule.eval
            stage.clear_runtime_states()
        schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        last = [s for s in stages if s.is_last]
        return schedule._merge_outputs(last[0].output_chunks) if last and return_outputs else None

    schedule.step = step
    return True
