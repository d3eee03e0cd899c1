"""A sharded model in and out of the Trainer's directories.

What ``save_model`` and each ``checkpoint-N/`` hold, and who writes them:

* the model as ``from_pretrained`` reads it -- ``model.safetensors`` + ``config.json``
  written shard by shard (:func:`~ulysses_dtensor.integrations.hf.save_hf_weights`: every
  rank its shards, one rank merges them; no rank holds the whole model), or for a peft
  model its adapter (``adapter_model.safetensors`` + ``adapter_config.json``: the
  trained matrices are small, gathered whole, chosen by peft and written by one rank);
* ``ulysses_state/`` (checkpoints only): what resuming needs beyond that, with
  ``torch.distributed.checkpoint`` -- the optimizer state, shard by shard, keyed by
  parameter name, so a run resumes on another mesh; for a peft model also its trained
  parameters (the frozen base is the resuming model's own, as our trainer's
  ``trainable_only`` checkpoints do);
* the scheduler, RNG states and ``trainer_state.json`` as the Trainer writes them.

Resuming reads the full model back with :func:`~ulysses_dtensor.integrations.hf.load_hf_weights`
(each rank only its shards) and everything else from ``ulysses_state/``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ulysses_dtensor.models.llama_checkpoint import HFCheckpointError

from ..checkpoint_io import load_hf_weights, save_hf_weights
from .refusals import UlyssesTrainerError

__all__ = ["STATE_DIR", "save_peft_adapter", "load_model", "load_optimizer", "save_full_model",
           "save_training_state", "has_training_state"]

STATE_DIR = "ulysses_state"
# What compile and activation checkpointing put into module names (not into state-dict keys).
_WRAPPERS = re.compile(r"(_orig_mod\.|_checkpoint_wrapped_module\.)")
_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def _torch_optimizer(optimizer):
    """accelerate's wrapper holds the torch optimizer whose parameters DCP maps to names."""
    return getattr(optimizer, "optimizer", optimizer)


def save_peft_adapter(model: nn.Module, output_dir: str) -> None:
    """A peft model's adapter as ``PeftModel.from_pretrained`` reads it; collective.

    peft picks the adapter's entries by walking the model's modules, whose names hold the
    wrappers activation checkpointing puts around the decoder layers; the entries are
    selected under those names, then written under the plain model's."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    trained = {}
    for name, p in model.named_parameters():  # the same order on every rank: each gather is collective
        if p.requires_grad:
            p = p.detach()
            trained[name] = (p.full_tensor() if isinstance(p, DTensor) else p).cpu()
    adapter = model.active_adapter
    selected = get_peft_model_state_dict(model, state_dict=trained, adapter_name=adapter)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(output_dir, exist_ok=True)
    save_file({_WRAPPERS.sub("", k): v.contiguous() for k, v in selected.items()},
              os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.copy(model.peft_config[adapter])
    config.inference_mode = True
    config.save_pretrained(output_dir)


def save_full_model(model: nn.Module, output_dir: str) -> None:
    """The (sharded) transformers model as a ``from_pretrained`` directory; collective."""
    save_hf_weights(model, output_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        generation.save_pretrained(output_dir)


def save_training_state(model: nn.Module, optimizer, output_dir: str, *, with_params: bool) -> None:
    """The optimizer's shards (and with ``with_params`` the trained parameters') into
    ``output_dir/ulysses_state``; collective."""
    state = {"optimizer": get_optimizer_state_dict(model, _torch_optimizer(optimizer))}
    if with_params:
        state["model"] = get_model_state_dict(model, options=_TRAINED)
    dcp.save(state, checkpoint_id=os.path.join(output_dir, STATE_DIR))


def has_training_state(checkpoint: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint, STATE_DIR, ".metadata"))


@contextlib.contextmanager
def _resuming(checkpoint: str):
    """A checkpoint that cannot be read back: UlyssesTrainerError naming it and the first cause
    (DCP's exception holds every rank's failure with its traceback)."""
    try:
        yield
    except (HFCheckpointError, CheckpointException) as e:
        cause = e.failures[min(e.failures)][0] if isinstance(e, CheckpointException) and e.failures else e
        first_line = (str(cause).strip().splitlines() or [""])[0][:300]
        raise UlyssesTrainerError(f"{checkpoint} cannot be resumed: {type(cause).__name__}: {first_line}") from e


def load_model(model: nn.Module, base: nn.Module, checkpoint: str, *, peft: bool) -> None:
    """The weights of ``checkpoint`` into the sharded model: a peft model's trained parameters
    from ``ulysses_state``, a full model (``base``, the transformers model) from its
    safetensors, each rank reading its shards; collective."""
    if not peft:
        with _resuming(checkpoint):
            load_hf_weights(base, checkpoint)
        return
    if not has_training_state(checkpoint):
        raise UlyssesTrainerError(f"{checkpoint} has no {STATE_DIR}/ (a checkpoint of UlyssesHFTrainer holds the "
                                  "trained adapter there): it cannot be resumed")
    state = {"model": get_model_state_dict(model, options=_TRAINED)}
    with _resuming(checkpoint):
        dcp.load(state, checkpoint_id=os.path.join(checkpoint, STATE_DIR))
    set_model_state_dict(model, state["model"], options=_TRAINED)


def load_optimizer(model: nn.Module, optimizer, checkpoint: str) -> None:
    """The optimizer's shards from ``checkpoint/ulysses_state``, on whatever mesh this run has."""
    torch_opt = _torch_optimizer(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, torch_opt)}
    with _resuming(checkpoint):
        dcp.load(state, checkpoint_id=os.path.join(checkpoint, STATE_DIR))
    set_optimizer_state_dict(model, torch_opt, state["optimizer"])
