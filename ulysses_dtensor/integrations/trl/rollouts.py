"""Where GRPO's rollouts meet the mesh: who generates and scores which rows, and which
ranks TRL's collectives count.

TRL's ``GRPOTrainer`` is written for one process per data stream: it gathers
completion lengths and rewards over every process, slices the advantages by
``process_index`` and normalises ``dapo`` by ``num_processes``. Under SP the data
streams are the data-parallel ranks; the sp ranks of a group hold the same rows. So:

* generation and scoring (TRL's ``_generate`` -- transformers, vLLM, ``rollout_func``
  -- and ``_calculate_rewards``) run on :func:`share` of the group's rows per sp rank,
  in the **world view**: TRL's gathers over every process then collect each row once,
  in the order of the global batch, exactly as without SP; :func:`gather_rows` hands
  every sp rank its group's rows back;
* the rest of the rollout and the loss run in the **data-parallel view**: the
  accelerator's ``process_index`` / ``num_processes`` are the data-parallel rank and
  size, its gathers and TRL's ``gather_object`` go over the data-parallel ranks
  (the sp ranks of a group hold the same rows: each counted once);
* after generation the random state of sp rank 0 is copied to its group
  (:func:`sync_rng`): TRL's shuffle of the rows must cut every sp rank's batch alike;
* :func:`fit_generation_batch`: ``GRPOConfig``'s batch sizes, which TRL computes over
  every process, over the data-parallel ranks.

The views switch attributes TRL reads (``accelerator.process_index`` and friends, and
``trl.trainer.grpo_trainer.gather_object``) for the duration of a call; they nest.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
import torch.distributed as dist

from ..hf.ulysses_trainer.refusals import UlyssesTrainerError

__all__ = [
    "RankViews",
    "data_parallel_view",
    "fit_generation_batch",
    "gather_rows",
    "make_rank_views",
    "share",
    "sync_rng",
    "world_view",
]


def fit_generation_batch(args, ulysses_args) -> None:
    """Make ``args`` (a ``GRPOConfig``, whose sizes TRL computed over every process) count
    data-parallel ranks, or ValueError naming the size that cannot be split."""
    sp, world = ulysses_args.sp_size, args.world_size
    if world % sp:
        return  # the mesh refuses it, with the sizes named
    dp = world // sp
    name = type(args).__name__
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise UlyssesTrainerError(
            f"{name}.num_generations={args.num_generations} must divide the generation batch, "
            f"per_device_train_batch_size={args.per_device_train_batch_size} x {dp} data-parallel ranks x "
            f"steps_per_generation={args.steps_per_generation} = {args.generation_batch_size} (under SP the sp ranks "
            "of a group share their rows)")
    rows = args.per_device_train_batch_size * args.steps_per_generation
    if rows % sp:
        raise UlyssesTrainerError(
            f"{name}.per_device_train_batch_size={args.per_device_train_batch_size} x steps_per_generation="
            f"{args.steps_per_generation} = {rows} rows per data-parallel rank must be divisible by "
            f"UlyssesArguments.sp_size={sp}: each sp rank of a group generates and scores an equal share of them")
    if args.do_eval and args.eval_strategy != "no":
        generations = args.num_generations_eval or args.num_generations
        if (args.per_device_eval_batch_size * dp) % generations or args.per_device_eval_batch_size % sp:
            raise UlyssesTrainerError(
                f"{name}.per_device_eval_batch_size={args.per_device_eval_batch_size} must be divisible by "
                f"UlyssesArguments.sp_size={sp}, and times the {dp} data-parallel ranks by the evaluation's "
                f"{generations} generations per prompt")


class RankViews:
    """Mixed into the class of the trainer's accelerator (itself an
    :class:`~ulysses_dtensor.integrations.hf.ulysses_trainer.accelerator.SPAccelerator`):
    ``rank_view`` None is the SP accelerator as it is; ``"dp"`` makes ``process_index`` /
    ``num_processes`` the data-parallel rank and size; ``"world"`` makes ``gather`` run
    over every process (each rank holding a share of the rows)."""

    rank_view: str | None = None

    @property
    def process_index(self) -> int:
        return self.sp_dp_rank if self.rank_view == "dp" else super().process_index

    @property
    def num_processes(self) -> int:
        return self.sp_dp_size if self.rank_view == "dp" else super().num_processes

    def gather(self, tensor):
        if self.rank_view == "world":
            from ..hf.ulysses_trainer.accelerator import SPAccelerator

            return super(SPAccelerator, self).gather(tensor)
        return super().gather(tensor)


_CLASSES: dict[type, type] = {}


def make_rank_views(accelerator):
    """Give ``accelerator`` (already an SP accelerator) :class:`RankViews`, in place."""
    cls = type(accelerator)
    if not issubclass(cls, RankViews):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"RL{cls.__name__}", (RankViews, cls), {})
        accelerator.__class__ = _CLASSES[cls]
    return accelerator


def _gather_object_over(group):
    def gather_object(obj):
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, obj, group=group)
        return [x for part in parts for x in part]

    return gather_object


@contextlib.contextmanager
def _view(accelerator, view: str, gather_object):
    import trl.trainer.grpo_trainer as grpo

    saved = accelerator.rank_view, grpo.gather_object
    accelerator.rank_view, grpo.gather_object = view, gather_object
    try:
        yield
    finally:
        accelerator.rank_view, grpo.gather_object = saved


def data_parallel_view(accelerator):
    """TRL's collectives and ranks over the data-parallel ranks (see the module doc)."""
    if accelerator.sp_dp_size == 1:
        return _view(accelerator, "dp", list)  # one data stream: this rank's objects are all of them
    return _view(accelerator, "dp", _gather_object_over(accelerator.sp_dp_group))


def world_view(accelerator):
    """TRL's collectives and ranks over every process, each holding a share of the rows."""
    from accelerate.utils import gather_object

    return _view(accelerator, "world", gather_object)


def share(rows: list, sp_rank: int, sp: int) -> list:
    """This sp rank's equal share of its group's rows (contiguous, in order)."""
    n = len(rows) // sp
    return rows[sp_rank * n:(sp_rank + 1) * n]


def gather_rows(value, group):
    """The sp group's shares of a value, joined in rank order: lists concatenated, dicts
    joined per key, tuples per element; anything else (a scalar, None) is sp rank 0's."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, value, group=group)
    return _join(parts)


def _join(parts: list):
    first = parts[0]
    if isinstance(first, list):
        return [x for part in parts for x in part]
    if isinstance(first, tuple):
        return tuple(_join([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _join([p[k] for p in parts]) for k in first}
    return first


def sync_rng(group) -> None:
    """Every rank of ``group`` takes the random state of its first rank (torch, CUDA, Python, NumPy)."""
    state = [(torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
              random.getstate(), np.random.get_state())]
    dist.broadcast_object_list(state, src=dist.get_global_rank(group, 0), group=group)
    cpu, cuda, py, npy = state[0]
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)
