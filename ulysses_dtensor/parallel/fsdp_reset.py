"""FSDP2 put back as a training step expects it, after forward passes with no backward.

A forward without backward (evaluation, a reference model's or old policy's
log-probs, ``Trainer.evaluate`` / ``predict``) leaves FSDP2 mid-iteration: the
groups built with ``reshard_after_forward=False`` (the output head, used last in
forward and first in backward) keep their gathered parameters, the last
all-gather result stays referenced, and the recorded forward order would steer
the next backward's prefetch. Worse, while a module is gathered its parameters
ARE the gathered tensors: an optimizer built then (``evaluate()`` before
``train()``) holds them instead of the shards, and those parameters never train.

:func:`reset_fsdp` ends that iteration on every FSDP2 root under a module: torch
>= 2.12's ``reset_iter_state``, or :func:`reset_fsdp_by_hand` (the same through
FSDP2's private state, for torch 2.10-2.11).
"""

from __future__ import annotations

from torch import nn

__all__ = ["fsdp_roots", "reset_fsdp", "reset_fsdp_by_hand"]


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules under ``model`` (itself if it is one): the modules
    ``fully_shard`` was applied to last, which own their iteration's state."""
    from torch.distributed.fsdp import FSDPModule

    roots: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and not any(
                r == "" or name.startswith(r + ".") for r, _ in roots):
            roots.append((name, module))
    return [m for _, m in roots]


def reset_fsdp(model: nn.Module) -> None:
    """Reshard every FSDP2 group under ``model`` and clear the iteration's records
    (a no-op where nothing is sharded)."""
    for root in fsdp_roots(model):
        if hasattr(root, "reset_iter_state"):
            root.reset_iter_state()
        else:
            reset_fsdp_by_hand(root)


def reset_fsdp_by_hand(model: nn.Module) -> None:
    """What torch 2.12's ``reset_iter_state`` does, through FSDP2's private state
    (torch 2.10-2.11). Seen on torch 2.11 + CUDA before the training states were
    reset: the gathered norm + head (32 MiB) stayed allocated."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        comm = state._comm_ctx
        gathered = getattr(comm, "all_gather_state", None)
        if gathered is not None:
            if gathered.event is not None:
                state._device_handle.current_stream().wait_event(gathered.event)
            comm.all_gather_state = None  # frees the last all-gather result
        comm.post_forward_order.clear()
        state._training_state = TrainingState.IDLE
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.12: one group per state
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            # A group left in FORWARD with reshard_after_forward=False ignores reshard().
            group._training_state = TrainingState.IDLE
            group.reshard()
            group._post_forward_indices.clear()
