"""The ``[lora]`` section: peft's LoRA adapters on the trainer's model (either implementation).

``lora.rank > 0`` puts adapters on ``lora.target_modules`` (transformers' module
names; this package's Llama takes the same names, mapped to its own below)
before the model is parallelized, freezes the base, and trains the adapters and
``lora.modules_to_save``. What changes around the model:

* weights: the base is read from ``model.hf_path`` by its checkpoint names
  (``...q_proj.base_layer.weight`` is ``...q_proj.weight`` there); the adapters
  start from peft's initialisation, seeded by ``job.seed``;
* the frozen base is held in the compute dtype under
  ``training.mixed_precision_param = "bfloat16"`` (no float32 master copy of a
  weight that never changes: half the base's memory), the trained parameters
  in float32 as always;
* optimizer, clipping: the trained parameters only (AdamW keeps no state for
  the base; the planner counts adapter state only);
* checkpoints: the trained parameters and their optimizer state only (a resume
  reads the base from ``model.hf_path`` again), so a checkpoint of an 8B model
  is megabytes; ``model.json`` records the adapters for the export
  (``python -m ulysses_dtensor.export``: a peft adapter directory, or ``--merge``d
  full weights).

Refused before anything starts (:func:`check_lora_model`, one ConfigError): a
target that matches no module or is not a Linear layer, the output head as a
target, a tied embedding / head among the modules to save, a module both
adapted and saved. LoRA needs ``model.hf_path`` (``config_checks``).
"""

from __future__ import annotations

from torch import nn

from .config_schema import ConfigError

__all__ = ["NATIVE_NAMES", "apply_lora", "check_lora_model", "flops_per_token", "lora_info", "lora_spec", "uses_lora"]

# transformers' module names -> this package's Llama's (models/llama.py), for targets and modules to save.
NATIVE_NAMES = {
    "q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
    "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
    "self_attn": "attention", "mlp": "feed_forward", "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm", "embed_tokens": "tok_embeddings", "lm_head": "output",
}


def uses_lora(cfg) -> bool:
    return cfg.lora.rank > 0


def lora_spec(cfg, *, native: bool = False):
    """The :class:`~ulysses_dtensor.integrations.lora.LoraSpec` of ``cfg`` (module names mapped
    to our Llama's with ``native``), or None without adapters."""
    from ..integrations.lora import LoraSpec

    if not uses_lora(cfg):
        return None
    lo = cfg.lora
    rename = (lambda n: ".".join(NATIVE_NAMES.get(part, part) for part in n.split("."))) if native else str
    return LoraSpec(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                    target_modules=tuple(rename(t) for t in lo.target_modules),
                    modules_to_save=tuple(rename(t) for t in lo.modules_to_save))


def _head(model: nn.Module, native: bool) -> nn.Module | None:
    return model.output if native else model.get_output_embeddings()


def check_lora_model(cfg, model: nn.Module, *, native: bool) -> None:
    """The adapters of ``cfg`` fit ``model`` (a meta model, before any process group), or one
    ConfigError naming the key, the value and what would be valid."""
    from ..integrations.lora import check_lora_targets

    if not uses_lora(cfg):
        return
    spec = lora_spec(cfg, native=native)
    try:
        check_lora_targets(model, spec, head=_head(model, native))
    except ValueError as e:
        msg, impl = str(e), "this package's Llama" if native else "transformers"
        given = list(cfg.lora.target_modules) + list(cfg.lora.modules_to_save)
        for ours, theirs in zip(spec.target_modules + spec.modules_to_save, given):
            if ours != theirs:  # the user's name, and ours beside it
                msg = msg.replace(f"{ours!r}", f"{theirs!r} ({ours!r} in this package's Llama)", 1)
        raise ConfigError(f"model.hf_path={cfg.model.hf_path!r} ({impl}): {msg}") from None


def apply_lora(cfg, model: nn.Module, *, native: bool) -> nn.Module:
    """``model`` (on meta, not yet parallelized) with the adapters of ``cfg`` (none without)."""
    import torch

    from ..integrations.lora import add_lora, store_frozen_as

    if uses_lora(cfg):
        check_lora_model(cfg, model, native=native)
        add_lora(model, lora_spec(cfg, native=native), head=_head(model, native))
        if cfg.training.mixed_precision_param == "bfloat16":
            store_frozen_as(model, torch.bfloat16)
    return model


def flops_per_token(cfg, model: nn.Module):
    """``model.flops_per_token`` for MFU, less the weight gradients a frozen base skips: a
    frozen weight costs 4 FLOPs per token and parameter (forward, input gradient), not 6.
    The frozen parameters counted are those the model's own count uses (its matmuls: not
    the input embedding of an untied model)."""
    if not uses_lora(cfg):
        return model.flops_per_token
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.tok_embeddings
    counted = model._active_params if hasattr(model, "_active_params") else model.num_params(exclude_embeddings=True)
    untied = not model.args.tie_embeddings
    trained = sum(p.numel() for p in model.parameters()
                  if p.requires_grad and not (untied and p is embed.weight))
    frozen = counted - trained
    return lambda seq_len: model.flops_per_token(seq_len) - 2 * frozen


def lora_info(cfg) -> dict | None:
    """What the export needs of the adapters (``model.json``): the config's values, with
    transformers' module names (the names the peft adapter directory uses)."""
    if not uses_lora(cfg):
        return None
    lo = cfg.lora
    return {"rank": lo.rank, "alpha": lo.alpha, "dropout": lo.dropout, "target_modules": list(lo.target_modules),
            "modules_to_save": list(lo.modules_to_save)}
