"""What a run builds before its first step: the process group, the vocabulary
size, and the parallelized model (ours or transformers').

The trainer, the evaluator and the memory planner build the same model from the
same config, so they share these.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..data import padded_vocab_size
from ..runtime.process_group import process_group_backend
from ..runtime.restarts import process_group_store
from .config import ConfigError, JobConfig, model_args
from .config_checks import check_attention_kernel
from .hf_start import tokenizer_spec
from .lora_setup import uses_lora

__all__ = ["build_model", "init_distributed", "resolve_vocab_size"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def init_distributed(cpu_collectives: bool = False, timeout_s: float | None = None) -> tuple[torch.device, bool]:
    """Start the process group from torchrun's env (or a world of one).

    nccl + this process's LOCAL_RANK GPU when CUDA is present, else gloo + CPU.
    ``cpu_collectives``: on CUDA also give the group a gloo backend for CPU
    tensors (host-offloaded parameters meet in the gradient-norm reduction).
    ``timeout_s``: how long the start and the default group's collectives may
    wait for a peer (None: torch's default). Under a torchrun agent that shares
    its store, the group's keys go under this restart attempt's prefix (see
    :mod:`ulysses_dtensor.runtime.restarts`). Returns (device, whether this call created the group).
    """
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = process_group_backend(device.type, cpu_collectives)
    if dist.is_initialized():
        if cpu_collectives and device.type == "cuda" and "gloo" not in str(dist.get_backend()):
            raise RuntimeError(
                f"memory.offload_params=true needs a process group that can reduce CPU tensors; "
                f"the existing one has backend {dist.get_backend()!r}: initialise it with "
                f"backend={process_group_backend('cuda', True)!r}"
            )
        return device, False
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        attempt = process_group_store(timeout or dist.default_pg_timeout)
        start = {} if attempt is None else dict(zip(("store", "rank", "world_size"), attempt))
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                **start)
    else:  # plain `python -m ulysses_dtensor.train`: a world of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device, True


def resolve_vocab_size(cfg: JobConfig, tokenizer_vocab: int) -> int:
    if cfg.model.hf_path:
        vocab = model_args(cfg, 0).vocab_size
        if tokenizer_vocab > vocab:
            raise ConfigError(
                f"the tokenizer {tokenizer_spec(cfg)!r} has {tokenizer_vocab} tokens, more than "
                f"the vocabulary of {vocab} of model.hf_path={cfg.model.hf_path!r}; use the "
                f"model's own tokenizer"
            )
        return vocab
    if cfg.model.vocab_size:
        if cfg.model.vocab_size < tokenizer_vocab:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                f"vocabulary of {tokenizer_vocab} (data.tokenizer={cfg.data.tokenizer!r}); "
                f"use >= {tokenizer_vocab} or 0 to derive it"
            )
        return cfg.model.vocab_size
    return padded_vocab_size(tokenizer_vocab, cfg.model.vocab_multiple_of)


def build_model(
    cfg: JobConfig, pmesh, vocab_size: int, device: torch.device, *, init_weights: bool = True, args=None
):
    """The parallelized Llama of ``cfg``, materialised on ``device`` (parameter
    shards on the host with ``memory.offload_params``), its weights loaded from
    ``model.hf_path`` (each rank reads its shards) or initialised from the seed.
    ``init_weights=False`` leaves the values uninitialised (memory planning, or
    a checkpoint about to be loaded). ``args``: LlamaArgs to use instead of the
    config's (the memory planner's shorter traces)."""
    from ..models.llama import Llama
    from ..models.llama_parallelize import parallelize_llama
    from .hf_model import build_transformers_model, uses_transformers
    from .float8_config import float8_options
    from .memory_config import memory_options

    shape = args or model_args(cfg, vocab_size)
    check_attention_kernel(cfg.model.attn_backend, shape, device, _DTYPES[cfg.training.mixed_precision_param])
    if uses_transformers(cfg):  # transformers' own model class (model.implementation)
        return build_transformers_model(cfg, pmesh, device, init_weights=init_weights,
                                        n_layers=args.n_layers if args is not None else None)
    from .lora_setup import apply_lora

    args = shape
    with torch.device("meta"):
        model = Llama(args)
    apply_lora(cfg, model, native=True)  # peft's adapters, before FSDP shards the blocks holding them
    model = parallelize_llama(
        model,
        pmesh,
        memory=memory_options(cfg),
        compile=cfg.training.compile,
        compile_backend=cfg.training.compile_backend,
        param_dtype=_DTYPES[cfg.training.mixed_precision_param],
        reduce_dtype=_DTYPES[cfg.training.mixed_precision_reduce],
        pack_qkv=cfg.training.pack_qkv,
        float8=float8_options(cfg),
    )
    # Host-offloaded parameter shards live in host memory from the start.
    model.to_empty(device="cpu" if cfg.memory.offload_params else device)
    if init_weights and cfg.model.hf_path:
        from ..integrations.lora import is_adapter_param
        from ..models.llama_checkpoint import load_hf_weights

        load_hf_weights(model, cfg.model.hf_path, ignore=is_adapter_param)
    elif init_weights:
        model.init_weights(seed=cfg.job.seed)
    if init_weights and uses_lora(cfg):
        from ..integrations.lora import init_lora_weights

        init_lora_weights(model, cfg.job.seed)
    return model
