"""``model.implementation``: which code trains the model of ``model.hf_path``.

* ``native``: this package's Llama (``models/llama.py``), for the Llama 3.x,
  Mistral, Qwen2/2.5 and Qwen3 checkpoints it can load.
* ``transformers``: transformers' own model class, built with
  ``AutoModelForCausalLM.from_config`` on ``meta`` (a multimodal model's
  ``AutoModelForImageTextToText`` class: see below), parallelized with
  :func:`~ulysses_dtensor.integrations.hf.parallelize_hf_model` (Ulysses or
  USP, the memory switches, activation checkpointing, compile, FSDP2 / HSDP),
  materialised, its weights
  read shard by shard (:func:`~ulysses_dtensor.integrations.hf.weights.load_transformers_weights`),
  and given the Llama's call interface (:func:`~ulysses_dtensor.integrations.hf.causal_lm.adapt_causal_lm`).
  Any family the integration runs; context stages change its rope
  (``set_rope``, :mod:`~ulysses_dtensor.integrations.hf.rotary`) and MoE models with
  ``output_router_logits`` train with their router load-balancing loss.
* ``auto`` (default): ``native`` when our Llama can load the checkpoint,
  ``transformers`` otherwise; the run's banner says which and why.

A multimodal model (Qwen2.5-VL) trains its text path: the decoder under Ulysses,
called with text only (2-D global position ids, which its multimodal rope
repeats on all three sections, as ``get_rope_index`` does for text), its head,
its embeddings. The vision tower is frozen (no gradient reaches it from text:
no optimizer state, weights exported as loaded) and sharded as one FSDP group
of its own that no forward gathers; it keeps its own bidirectional attention
(never our causal exchange). The data path has no image inputs, and the
integration refuses any.

The family must pass the family matrix for the installed transformers (a refused
one stops the run before anything starts); a family newer than the matrix is
checked by ``parallelize_hf_model`` at start on the run's own ranks, and the
banner says which (``model.allow_untested`` skips both, and says so).

Everything that can be checked without a process group is checked by
:func:`check_transformers_model` (``validate_config`` calls it): the model is
built on ``meta`` and put through the integration's own structural checks and
the head check, so a model the integration refuses stops the run before
anything starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from .config_schema import ConfigError

__all__ = [
    "IMPLEMENTATIONS",
    "Implementation",
    "build_transformers_model",
    "check_transformers_model",
    "model_info",
    "resolve_implementation",
    "transformers_args",
    "uses_transformers",
]

IMPLEMENTATIONS = ("auto", "native", "transformers")
_HF_EXTRA = "model.implementation='transformers' needs transformers: pip install 'ulysses-dtensor[hf]'"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Implementation:
    name: str  # "native" or "transformers"
    reason: str  # for the banner


def resolve_implementation(cfg) -> Implementation:
    """The implementation that trains ``cfg``'s model, and why (ConfigError for an
    unreadable ``hf_path``)."""
    m = cfg.model
    if not m.hf_path:
        return Implementation("native", f"model.flavor={m.flavor!r}")
    if m.implementation != "auto":
        return Implementation(m.implementation, f"model.implementation={m.implementation!r}")
    from ..models.llama_checkpoint import HFCheckpointError, args_from_hf_config
    from .hf_start import hf_source_config

    source = hf_source_config(cfg)
    arch = (source.get("architectures") or ["?"])[0]
    try:
        args_from_hf_config(source, attn_backend=m.attn_backend)
    except HFCheckpointError as e:
        why = str(e).removeprefix("config.json: ")
        return Implementation("transformers", f"auto: this package's Llama cannot load {arch} ({why})")
    return Implementation("native", f"auto: {arch} loads into this package's Llama")


def uses_transformers(cfg) -> bool:
    return bool(cfg.model.hf_path) and resolve_implementation(cfg).name == "transformers"


def _where(cfg) -> str:
    """The model and why transformers builds it (for auto: why our Llama cannot)."""
    return f"model.hf_path={cfg.model.hf_path!r} ({resolve_implementation(cfg).reason})"


def _hf_config(cfg):
    """transformers' config of ``hf_path`` (ConfigError naming the path)."""
    from .hf_start import hf_source_config

    hf_source_config(cfg)  # a readable config.json, or its own ConfigError
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(_HF_EXTRA) from None
    try:
        return AutoConfig.from_pretrained(cfg.model.hf_path)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"{_where(cfg)}: transformers cannot read its config.json: {e}") from None


def transformers_args(cfg):
    """The :class:`~ulysses_dtensor.integrations.hf.causal_lm.CausalLMShape` of ``hf_path``."""
    from ..integrations.hf.causal_lm import causal_lm_shape

    return causal_lm_shape(_hf_config(cfg))


def _meta_model(config, n_layers: int | None = None):
    from ..integrations.hf.causal_lm import auto_model_class

    if n_layers:
        config = _with_layers(config, n_layers)
    cls = auto_model_class(config)
    with torch.device("meta"):
        return cls.from_config(config, dtype=torch.float32)


def _with_layers(config, n_layers: int):
    """A copy of ``config`` with the first ``n_layers`` decoder layers (the planner's
    shorter traces)."""
    config = config.__class__.from_dict(config.to_dict())
    text = config.get_text_config()
    text.num_hidden_layers = n_layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:n_layers]
    return config


def check_transformers_model(cfg, dims, *, weights: bool = True) -> None:
    """Everything about the transformers model checkable before a process group: its
    config reads, it is a causal LM, it has weights (``weights=False``: sizing a run
    needs config.json alone), the integration accepts its structure at this sp and
    ring degree with the memory switches asked for, and its head is one the trainer
    computes. One ConfigError naming the model class, the key and the value."""
    from ..models.llama_checkpoint import HFCheckpointError, safetensors_files

    config = _hf_config(cfg)
    if getattr(config, "quantization_config", None):
        raise ConfigError(f"{_where(cfg)}: quantized weights (quantization_config) are not supported; "
                          f"dequantize the checkpoint first")
    text = config.get_text_config()
    if float(getattr(text, "attention_dropout", 0.0) or 0.0):
        raise ConfigError(f"{_where(cfg)}: attention_dropout={text.attention_dropout} is not implemented by "
                          f"Ulysses attention; set it to 0.0 in config.json")
    if weights:
        try:
            safetensors_files(cfg.model.hf_path)
        except HFCheckpointError as e:
            raise ConfigError(str(e)) from None
    try:
        model = _meta_model(config)
    except ValueError as e:  # not a causal LM architecture transformers knows
        why = str(e).split("\nModel type should be one of")[0]  # not the list of every class
        raise ConfigError(f"{_where(cfg)}: not a causal LM transformers can build: {why}") from None
    from ..integrations.hf.attention_function import check_backend_for_patterns, model_patterns
    from ..integrations.hf.causal_lm import router_aux_setup
    from ..integrations.hf.memory_switches import per_token_blocks
    from ..integrations.hf.output_head import check_output_head
    from ..integrations.hf.parallelize_model import _check_model, check_ring_model, check_tp_model
    from ..integrations.hf.rotary import rope_support
    from .rope_stages import stage_ropes

    name = type(model).__name__
    mesh = (f"parallelism.sp={dims.sp}" + (f", parallelism.ring={dims.ring}" if dims.ring > 1 else "")
            + (f", parallelism.tp={dims.tp}" if dims.tp > 1 else ""))
    try:
        layers, attentions, linear, _ = _check_model(model, dims.ulysses, cfg.model.allow_untested, tp=dims.tp)
        if dims.tp > 1:
            check_tp_model(model, layers, linear, dims.tp)
        # A backend named in the config that cannot express a layer's pattern
        # (e.g. sinks on flash_attn) fails here, not at the first step.
        check_backend_for_patterns(name, cfg.model.attn_backend, model_patterns(text, attentions))
        check_output_head(model)
        if getattr(text, "output_router_logits", False):
            router_aux_setup(model)  # a router loss the adapter computes, or why not
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{_where(cfg)} with {mesh}: {e}") from None
    try:
        if dims.ring > 1:
            check_ring_model(model, attentions, linear, cfg.model.attn_backend, dims.ring)
    except ValueError as e:
        raise ConfigError(f"parallelism.ring={dims.ring} with {_where(cfg)}: {e}") from None
    if cfg.memory.tiled_mlp:
        try:
            per_token_blocks(name, layers)
        except ValueError as e:
            raise ConfigError(f"{_where(cfg)}: {e}") from None
    # Every stage's rope, in a type and shape this family's rotary module takes (ConfigError
    # naming the stage and key; a family whose rope cannot change says why).
    stage_ropes(cfg, rope_support(model))
    from .lora_setup import check_lora_model

    check_lora_model(cfg, model, native=False)  # [lora] targets that exist and can be adapted


def build_transformers_model(cfg, pmesh, device: torch.device, *, init_weights: bool = True,
                             n_layers: int | None = None):
    """The transformers model of ``hf_path``, parallelized like our Llama (the
    config's activation checkpointing, compile, mixed precision, attention backend),
    materialised on ``device`` with the weights of ``hf_path`` (``init_weights``;
    else left for a checkpoint to fill), with the trainer's call interface."""
    from ..integrations.hf.causal_lm import adapt_causal_lm
    from ..integrations.hf.parallelize_model import parallelize_hf_model
    from ..integrations.hf.weights import (
        init_non_persistent_buffers,
        load_transformers_weights,
        weight_conversions,
    )
    from .lora_setup import apply_lora, uses_lora
    from .float8_config import float8_options
    from .memory_config import memory_options

    model = _meta_model(_hf_config(cfg), n_layers)
    conversions = weight_conversions(model)  # of the plain class: FSDP renames it
    apply_lora(cfg, model, native=False)  # peft's adapters, before FSDP shards the layers holding them
    tr, mem = cfg.training, cfg.memory
    _shard_vision(model, pmesh, _DTYPES[tr.mixed_precision_param], _DTYPES[tr.mixed_precision_reduce],
                  mem.offload_params)
    parallelize_hf_model(
        model,
        pmesh,
        memory=memory_options(cfg),
        compile=tr.compile,
        compile_backend=tr.compile_backend,
        param_dtype=_DTYPES[tr.mixed_precision_param],
        reduce_dtype=_DTYPES[tr.mixed_precision_reduce],
        attn_backend=cfg.model.attn_backend,
        pack_qkv=tr.pack_qkv,
        allow_untested=cfg.model.allow_untested,
        float8=float8_options(cfg),
    )
    # Host-offloaded parameter shards live in host memory from the start.
    model.to_empty(device="cpu" if mem.offload_params else device)
    if init_weights:
        load_transformers_weights(model, cfg.model.hf_path, conversions=conversions)
    else:
        init_non_persistent_buffers(model)
    if init_weights and uses_lora(cfg):
        from ..integrations.lora import init_lora_weights

        init_lora_weights(model, cfg.job.seed)
    return adapt_causal_lm(model, pmesh)  # the loss tiling of model.memory_options


def _shard_vision(model, pmesh, param_dtype, reduce_dtype, offload_params: bool) -> None:
    """Freeze a multimodal model's vision tower and make it an FSDP group of its own:
    text-only steps never call it, so it is never gathered (in the root group it
    would be, every step, whole). Its shards live where the others do."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    from ..integrations.hf.causal_lm import freeze_vision_modules

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    policy = CPUOffloadPolicy(pin_memory=pmesh.param_mesh.device_type == "cuda") if offload_params else OffloadPolicy()
    for module in freeze_vision_modules(model):
        fully_shard(module, mesh=pmesh.param_mesh, mp_policy=mp, offload_policy=policy)


def model_info(cfg, args) -> dict:
    """What an export needs to know about the trained model (``model.json``)."""
    from .hf_start import hf_source_config, tokenizer_spec
    from .lora_setup import lora_info

    hf_path = cfg.model.hf_path or None
    tok = tokenizer_spec(cfg)
    return {
        "implementation": resolve_implementation(cfg).name,
        "args": dataclasses.asdict(args),
        "hf_path": str(Path(hf_path).resolve()) if hf_path else None,
        "hf_config": hf_source_config(cfg) if hf_path else None,
        "tokenizer": tok if tok == "byte" else str(Path(tok).resolve()),
        "max_seq_len": max(s.seq_len for s in cfg.stages()),
        "lora": lora_info(cfg),  # None: every weight in the checkpoint; else the adapters only
    }
