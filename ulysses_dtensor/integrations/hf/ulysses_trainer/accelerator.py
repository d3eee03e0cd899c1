"""The Trainer's ``Accelerator``, made to see data-parallel ranks rather than processes.

transformers' Trainer builds its ``accelerate.Accelerator`` itself and asks it to shard
every dataloader over all processes, to wrap the model in DDP and to gather evaluation
outputs from all processes. Under sequence parallelism the unit of data is the
data-parallel rank (``dp_replicate x dp_shard``): the sp ranks of a group read the SAME
samples and split each sequence among themselves, and the model is already FSDP2.

:func:`make_sp_accelerator` gives the Trainer's accelerator a class with three methods
changed (the object keeps its state; FSDP2 does the same to the modules it shards):

* ``prepare_data_loader``: accelerate's own sharding, over the dp ranks (this rank's dp
  index), never dispatched from one process;
* ``prepare_model``: the model as it is (FSDP2 / HSDP already; no DDP, no whole-model
  compile, no autocast wrapper: bf16 is FSDP2's mixed precision);
* ``gather``: over the dp ranks only, so a value every sp rank of a group holds is
  counted once (tokens seen, evaluation losses and predictions; transformers #48842
  returns predictions ``cp_size`` times under context parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["SPAccelerator", "make_sp_accelerator"]


class SPAccelerator:
    """Mixed into the class of the Trainer's ``Accelerator`` (see :func:`make_sp_accelerator`)."""

    sp_dp_group = None  # the process group of this rank's data-parallel peers (None: one dp rank)
    sp_dp_rank: int = 0
    sp_dp_size: int = 1

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        from accelerate.data_loader import prepare_data_loader

        if getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.sp_dp_size,
            process_index=self.sp_dp_rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=False,
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if model not in self._models:
            self._models.append(model)
        return model

    def gather(self, tensor):
        from accelerate.utils import recursively_apply

        return recursively_apply(self._gather_over_dp, tensor, error_on_other_type=True)

    def _gather_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor[None] if tensor.dim() == 0 else tensor.contiguous()
        if self.sp_dp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.sp_dp_size)]
        dist.all_gather(parts, tensor, group=self.sp_dp_group)
        return torch.cat(parts, dim=0)


_CLASSES: dict[type, type] = {}


def make_sp_accelerator(accelerator, pmesh):
    """Give ``accelerator`` (the Trainer's) :class:`SPAccelerator`'s methods over ``pmesh``'s
    data-parallel ranks, in place; returns it."""
    cls = type(accelerator)
    if not issubclass(cls, SPAccelerator):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"SP{cls.__name__}", (SPAccelerator, cls), {})
        accelerator.__class__ = _CLASSES[cls]
    accelerator.sp_dp_size = pmesh.dims.dp
    accelerator.sp_dp_rank = pmesh.dp_rank
    accelerator.sp_dp_group = pmesh.dp.get_group() if pmesh.dims.dp > 1 else None
    return accelerator
