"""The policy's full weights, out of its FSDP2 shards: an unsharded copy that generates,
and the weights a vLLM engine is sent.

Generation runs a KV cache over a growing sequence, one token at a time: nothing of
the sequence-parallel machinery (a slice per rank, the all-to-alls, per-layer FSDP
gathers that every rank of the mesh must join the same number of times) fits it. So
for a rollout the trained model steps aside entirely: every rank gathers the full
weights once (:func:`unsharded_policy`: gathers every rank joins), builds a
plain copy of the model with its own attention (``sdpa`` or what it was loaded with)
and its LoRA adapters, generates its rows with no collective at all, and drops the
copy. vLLM (TRL's ``use_vllm``) is sent the same weights with the adapters merged
(:func:`named_full_weights`), under the names a ``from_pretrained`` checkpoint has.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from ..hf.causal_lm import transformers_class

__all__ = ["named_full_weights", "unsharded_policy"]

# What activation checkpointing and compile put into module names (not into checkpoint names).
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module\.|_orig_mod\.)")


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def unsharded_policy(model: nn.Module, sp_model: nn.Module, *, attn_implementation: str, dtype: torch.dtype,
                     device: torch.device) -> nn.Module:
    """A plain, unsharded copy of ``model`` (the trainer's model: a peft model or the
    transformers model ``sp_model``, parallelized) on ``device`` in ``dtype``, in eval
    mode, with ``attn_implementation`` and a KV cache. Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    config = copy.deepcopy(sp_model.config)
    config.use_cache = True
    with torch.device("meta"):
        plain = transformers_class(sp_model)(config)
    plain.set_attn_implementation(attn_implementation)
    plain.generation_config = copy.deepcopy(sp_model.generation_config)
    if _is_peft(model):
        from peft import get_peft_model

        adapters = dict(model.peft_config)
        active = model.active_adapter
        plain = get_peft_model(plain, adapters[active], adapter_name=active)
        for name, adapter in adapters.items():
            if name != active:
                plain.add_adapter(name, adapter)
        plain.set_adapter(active)
    weights = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    missing, _ = plain.load_state_dict(weights, strict=False, assign=True)
    buffers = {_WRAPPERS.sub("", n): b for n, b in model.named_buffers()}
    for name, buf in list(plain.named_buffers()):
        if buf.is_meta and name in buffers:  # non-persistent (rotary frequencies): the trained model's own
            owner, _, attr = name.rpartition(".")
            plain.get_submodule(owner).register_buffer(attr, buffers[name].to(device), persistent=False)
    left = [n for n, t in (*plain.named_parameters(), *plain.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"the unsharded copy of {type(sp_model).__name__} lacks {left[0]} (not in the gathered "
                           f"state: {missing[:3]})")
    if getattr(config.get_text_config(), "tie_word_embeddings", False) and hasattr(plain, "tie_weights"):
        plain.tie_weights()
    return plain.eval().requires_grad_(False)


def named_full_weights(model: nn.Module, sp_model: nn.Module, *, dtype: torch.dtype, device: torch.device):
    """``(name, tensor)`` of the full policy, LoRA merged, named as its ``from_pretrained``
    checkpoint names them; tied weights once. Collective: every rank iterates it."""
    plain = unsharded_policy(model, sp_model, attn_implementation="sdpa", dtype=dtype, device=device)
    if _is_peft(plain):
        plain = plain.merge_and_unload()
    for name, param in plain.named_parameters():
        yield name, param.data
