"""The model-spec parallelize function: Ulysses at the inner-attention seam, then torchtitan's own steps.

Order (the same as torchtitan's llama3 / qwen3 parallelize functions, with our
style in place of its context parallelism):

1. ``parallelize_module(layers.<i>.attention.inner_attention, sp_mesh,
   UlyssesAttention())``: forward hooks on a parameter-free module, so they
   must be in place before the block is checkpointed and compiled.
2. torchtitan's activation checkpointing (``ac_config.build().apply``).
3. torchtitan's per-block ``torch.compile`` (``apply_compile``).
4. torchtitan's FSDP2 (``apply_fsdp_to_decoder``) on the ``fsdp`` mesh, which
   torchtitan flattens from ``dp_shard x cp``: Ulysses rides on the ``cp`` axis
   (see :mod:`.trainer`), so parameters are sharded over ``dp_shard x sp`` and
   replicated over ``dp_replicate`` (HSDP).

The sp degree is the ``cp`` degree of torchtitan's ``ParallelDims``; nothing of
torchtitan's context parallelism (its ring / all-gather attention, its load
balancer) is applied.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.protocols.model_spec import ModelSpec

from ...ulysses import UlyssesAttention, kv_replication

__all__ = ["check_heads", "parallelize_ulysses", "ulysses_model_spec"]


def ulysses_model_spec(spec: ModelSpec, *, pack_qkv: bool = False) -> ModelSpec:
    """``spec`` with its parallelize function replaced by ours (everything else kept)."""
    return dataclasses.replace(spec, parallelize_fn=functools.partial(parallelize_ulysses, pack_qkv=pack_qkv))


def check_heads(model_config, sp: int) -> None:
    """Raise unless every attention layer of ``model_config`` can be split over ``sp`` ranks."""
    for i, layer in enumerate(model_config.layers):
        attention = getattr(layer, "attention", None)
        if attention is None or not hasattr(attention, "n_heads"):
            raise ValueError(
                f"Ulysses needs an attention with n_heads in every layer; layers.{i} has "
                f"{type(attention).__name__}: the plug-in supports torchtitan's GQA decoders "
                "(llama3, qwen3)"
            )
        heads = attention.n_heads
        kv_heads = getattr(attention, "n_kv_heads", None) or heads
        try:
            kv_replication(heads, kv_heads, sp)
        except ValueError as e:
            raise ValueError(f"ulysses.degree={sp} does not fit layers.{i}.attention: {e}") from None


def parallelize_ulysses(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config,
    dump_folder: str,
    pack_qkv: bool = False,
) -> nn.Module:
    """A ``ModelSpec.parallelize_fn`` for torchtitan's dense decoders (llama3, qwen3).

    Call on the meta-device model, as torchtitan's trainer does. The sp degree
    is ``parallel_dims.cp``; ``pack_qkv`` sends q, k, v in one all-to-all.
    """
    for name, degree in (("tensor_parallel_degree", parallel_dims.tp), ("pipeline_parallel_degree", parallel_dims.pp),
                         ("expert_parallel_degree", parallel_dims.ep)):
        if degree > 1:
            raise NotImplementedError(
                f"parallelism.{name}={degree}: the Ulysses plug-in composes with FSDP/HSDP, "
                "activation checkpointing and compile only; set it to 1"
            )
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelism.spmd_backend={parallelism.spmd_backend!r}: the Ulysses plug-in runs "
            "torchtitan's 'partial_dtensor' path (plain local activations around the "
            "all-to-all); set parallelism.spmd_backend='partial_dtensor'"
        )

    sp = parallel_dims.cp
    if sp > 1:
        check_heads(model.config, sp)  # before any change to the model
        sp_mesh = parallel_dims.get_mesh("cp")
        style = UlyssesAttention(pack_qkv=pack_qkv)
        for block in model.layers.values():
            parallelize_module(block.attention.inner_attention, sp_mesh, style)

    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)

    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    apply_fsdp_to_decoder(
        model,
        parallel_dims.get_mesh(names),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=False,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    # torchtitan already divides by the global token count and sets FSDP's
    # divide factor to 1; plain SUM collectives (instead of a pre-multiplied
    # sum by 1) give the same gradients and also run on gloo.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model
