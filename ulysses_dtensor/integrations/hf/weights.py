"""Weights of a (sharded) transformers model from a Hugging Face directory, in
whatever layout the directory stores them.

transformers 5 keeps some families' weights in memory in another layout than on
disk: the experts of Qwen3-MoE, Mixtral, DeepSeek-V3 ... are one fused tensor per
layer in the model (``mlp.experts.gate_up_proj``, ``(experts, 2 * ffn, dim)``)
and one tensor per expert and projection in the files
(``mlp.experts.3.gate_proj.weight``); ``from_pretrained`` converts with the
rules of ``transformers.conversion_mapping`` and ``save_pretrained`` converts
back. :func:`load_transformers_weights` applies the same rules, so a model built
with ``from_config`` on ``meta`` and parallelized loads any directory
``save_pretrained`` (or the Hub) wrote:

* tensors the files hold under the model's own name and shape: read with
  ``torch.distributed.checkpoint``'s Hugging Face reader, each rank only the
  slices of its FSDP shards (collective over the default process group);
* tensors transformers converts: their source tensors are read whole (one
  target at a time, e.g. one layer's experts), converted by transformers' own
  operations, and each rank copies its shard (no collective). Every rank reads
  these sources in full (for a large MoE: most of the checkpoint, from the page
  cache after the first rank); host memory holds one target at a time.

Buffers that no checkpoint holds (rotary ``inv_freq``, Gemma's ``embed_scale``)
hold garbage after ``to_empty``; :func:`init_non_persistent_buffers` recomputes
them with transformers' own initialisation, touching nothing else.
"""

from __future__ import annotations

import os
from copy import deepcopy
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["init_non_persistent_buffers", "load_transformers_weights", "unique_state_dict", "weight_conversions"]

# Tensors some checkpoints carry that no model loads (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def unique_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with tied tensors once, under their first name
    (transformers saves a tied output embedding only as the input embedding)."""
    seen: set[int] = set()
    out = {}
    # keep_vars: the parameter objects themselves, so tied ones are recognised.
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out[name] = tensor.detach()  # shares storage: loading writes into the parameter
    return out


def weight_conversions(model: nn.Module) -> list:
    """transformers' checkpoint <-> model weight transforms for ``model`` (empty when
    the files store the model's own layout). Call it on the plain model, before
    ``fully_shard`` renames its class."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))


@torch.no_grad()
def init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute the buffers that are not in ``model.state_dict()`` with the
    model's own ``_init_weights``; parameters and persistent buffers are left as
    they are (marked initialised, which transformers' init functions respect)."""
    for tensor in model.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    # FSDP renames the class (FSDP<Name>), which transformers takes for remote code, whose modules
    # it skips once their own tensors look initialised: a buffer a PARENT initialises (Falcon-H1's
    # Model sets each mixer's mup_vector) would keep to_empty's garbage. The model's code is
    # transformers' own.
    model.is_custom_code = lambda: False
    try:
        model.initialize_weights()
    finally:
        del model.is_custom_code


def _local_part(full: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """(the slice of ``full`` this rank holds, the tensor to copy it into)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return full, target
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))], target.to_local()


class _Files:
    """Lazy whole-tensor reads from the safetensors files of a directory."""

    def __init__(self, path: Path, files: list[Path]):
        from safetensors import safe_open

        self._handles = {}
        self.where = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            self._handles[f] = handle
            for key in handle.keys():
                self.where[key] = f

    def read(self, key: str) -> Tensor:
        return self._handles[self.where[key]].get_tensor(key)


def _conversion_plan(model, targets: dict[str, Tensor], file_keys: list[str], conversions) -> tuple[dict, list]:
    """target name -> (transform with its source keys collected), and the file keys no target takes."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    renamings = [t for t in conversions if isinstance(t, WeightRenaming)]
    converters = [t for t in conversions if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    plan, unused = {}, []
    for key in sorted(file_keys):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, targets)
        if target not in targets:
            unused.append(key)
            continue
        if pattern is None:
            transform = plan.setdefault(target, WeightRenaming(key, target))
            pattern = key
        else:
            transform = plan.setdefault(target, deepcopy(by_pattern[pattern]))
        transform.add_tensor(target, key, pattern, key)  # the key stands in for the tensor until read
    return plan, unused


def _load_converted(model, files: _Files, pending: dict[str, Tensor], file_keys: list[str], conversions,
                    path) -> list[str]:
    """Fill ``pending`` (converted targets) in place; return the file keys they did not use."""
    from ulysses_dtensor.models.llama_checkpoint import HFCheckpointError

    plan, unused = _conversion_plan(model, pending, file_keys, conversions)
    done = set()
    for first, transform in plan.items():
        for pattern, keys in list(transform.collected_tensors.items()):
            transform.collected_tensors[pattern] = [files.read(k) for k in keys]
        for name, value in transform.convert(first, model=model, config=model.config).items():
            value = value[0] if isinstance(value, list) else value
            if name not in pending:
                raise HFCheckpointError(f"{path}: converting {first} gave {name}, which {type(model).__name__} lacks")
            target = pending[name]
            if tuple(value.shape) != tuple(target.shape):
                raise HFCheckpointError(f"{path}: {name} converts to shape {tuple(value.shape)}; the model's is "
                                        f"{tuple(target.shape)} (does config.json match the weights?)")
            part, local = _local_part(value, target)
            local.copy_(part)
            done.add(name)
    missing = sorted(set(pending) - done)
    if missing:
        shown = ", ".join(missing[:6]) + (f" ... ({len(missing)} in all)" if len(missing) > 6 else "")
        raise HFCheckpointError(f"{path} lacks {shown}")
    return unused


def load_transformers_weights(model: nn.Module, path: str | os.PathLike, *, conversions: list | None = None) -> None:
    """Fill ``model``'s parameters and persistent buffers (DTensor shards included)
    from the safetensors files of ``path`` in place, converting layouts as
    ``from_pretrained`` would; then recompute the non-persistent buffers. LoRA
    adapters (:mod:`~ulysses_dtensor.integrations.lora`) are left as they are, their base layers filled.

    ``conversions``: :func:`weight_conversions` of the plain model (default: from
    ``model``). Every rank of the default process group calls it. Names and
    shapes are checked first: one HFCheckpointError naming what is missing, what
    the model would ignore, or what has the wrong shape.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from ulysses_dtensor.models.llama_checkpoint import (
        HFCheckpointError,
        checkpoint_tensor_shapes,
        quiet_single_process,
        require_safetensors,
        safetensors_files,
    )

    from ..lora import base_name, is_adapter_param

    require_safetensors()
    path = Path(path)
    # By the checkpoint's names: a LoRA layer holds its base weight as ...base_layer.weight,
    # and its adapters are nowhere in the checkpoint.
    state = {base_name(k): v for k, v in unique_state_dict(model).items() if not is_adapter_param(k)}
    shapes = checkpoint_tensor_shapes(path)
    direct = {k: v for k, v in state.items() if k in shapes}
    wrong = [f"{k} {tuple(shapes[k])} (the model's is {tuple(v.shape)})" for k, v in direct.items()
             if tuple(shapes[k]) != tuple(v.shape)]
    if wrong:
        raise HFCheckpointError(f"{path} has tensors of the wrong shape: {', '.join(wrong[:6])}")
    pending = {k: v for k, v in state.items() if k not in shapes}
    rest = [k for k in shapes if k not in direct]
    unused = rest
    with torch.no_grad():
        if pending:
            if conversions is None:
                conversions = weight_conversions(model)
            files = _Files(path, safetensors_files(path))
            unused = _load_converted(model, files, pending, rest, conversions, path)
        tied = model.get_output_embeddings() is not None and getattr(model.config, "tie_word_embeddings", False)
        extra = [k for k in unused if not k.endswith(_IGNORED_SUFFIXES) and not (tied and k == "lm_head.weight")]
        if extra:
            shown = ", ".join(extra[:6]) + (f" ... ({len(extra)} in all)" if len(extra) > 6 else "")
            raise HFCheckpointError(f"{path} has tensors {type(model).__name__} would ignore: {shown}")
        with quiet_single_process():
            dcp.load({k: v.detach() for k, v in direct.items()}, storage_reader=HuggingFaceStorageReader(str(path)))
    init_non_persistent_buffers(model)
