"""Load and save the weights of a parallelized transformers model as HF safetensors.

``torch.distributed.checkpoint`` (DCP) with its Hugging Face storage reader and
writer: every rank reads only the slices its FSDP shards hold, and writes only
its own shards, so no rank ever holds the whole model. Parameter names are the
checkpoint's own because :func:`~ulysses_dtensor.integrations.hf.parallelize_hf_model`
keeps them (in-place compile; the checkpoint wrapper hides its prefix).

Typical use, for a model too large for one device::

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parallelize_hf_model(model, pmesh, ...)
    model.to_empty(device=device)
    load_hf_weights(model, path)       # also recomputes the rotary buffers
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from .weights import load_transformers_weights, unique_state_dict

__all__ = ["load_hf_weights", "save_hf_weights", "reset_rotary_buffers"]


def reset_rotary_buffers(model: nn.Module) -> None:
    """Recompute rotary-embedding buffers (``inv_freq``) with transformers' own
    initialisation. They are not in checkpoints, so after ``to_empty`` they hold
    garbage until this runs."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "inv_freq"):
            model._init_weights(module)


def load_hf_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Fill ``model``'s (sharded) parameters and buffers from the safetensors files in ``path``.

    Names and shapes are checked against the files first (one message naming
    what is missing, extra or of the wrong shape); values are converted to the
    model's dtype. Layouts transformers converts on load (MoE experts stored one
    by one) are converted the same way; buffers no checkpoint holds (rotary
    ``inv_freq``, ...) are recomputed afterwards. See :mod:`.weights`.
    """
    load_transformers_weights(model, path)


def save_hf_weights(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> None:
    """Write ``model``'s weights to ``path`` as one consolidated ``model.safetensors``
    (plus the model's ``config.json``), loadable with ``from_pretrained``.

    Every rank writes its own shards (under ``path/sharded``), then one rank
    merges them. ``dtype`` converts floating tensors first (e.g. ``torch.bfloat16``
    for float32 master weights). Call it on every rank.
    """
    state = unique_state_dict(model)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    # One output file, index 1: the consolidated name is then transformers' default.
    mapping = {name: 1 for name in state}
    writer = HuggingFaceStorageWriter(
        str(path), fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        # The per-rank shards were only the input of the consolidation.
        shutil.rmtree(os.path.join(str(path), "sharded"), ignore_errors=True)
        config = model.config
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(str(path))
