"""The model-spec parallelize function: Ulysses at the inner-attention seam, then torchtitan's own steps.

Order (torchtitan's own llama3 / qwen3 / deepseek_v3 parallelize functions,
with our Ulysses in place of its context parallelism):

1. Ulysses in ``layers.<i>.attention.inner_attention.forward`` over the cp
   mesh (:func:`ulysses_in_forward`). torchtitan puts its own CP at the same
   place and for the same reason: the forward, not hooks around the call, is
   what its tensor parallelism wraps in ``local_map``, so the exchange runs on
   the plain local tensors a tp rank holds: ``(B, S/sp, heads/tp, D)``.
2. torchtitan's tensor / expert parallelism, ``model.parallelize(parallel_dims)``,
   from the sharding configs its model configs declare (the TP plans of llama3 /
   qwen3 / deepseek_v3, the expert sharding and token dispatch of their MoE layers).
3. torchtitan's activation checkpointing (``ac_config.build().apply``).
4. torchtitan's per-block ``torch.compile`` (``apply_compile``).
5. torchtitan's FSDP2 (``apply_fsdp_to_decoder``, or its MTP variant for
   deepseek_v3) on the ``fsdp`` mesh, which torchtitan flattens from
   ``dp_shard x cp`` (routed experts on ``efsdp`` under EP): Ulysses rides on the
   ``cp`` axis (see :mod:`.trainer`), so parameters are sharded over
   ``dp_shard x sp`` and replicated over ``dp_replicate`` (HSDP).

Pipeline parallelism splits first: torchtitan's ``pipelining_fn``
(``pipeline_llm``, kept in the model spec) cuts the model into stages and calls
this function on each. The sp degree is the ``cp`` degree of torchtitan's
``ParallelDims``; nothing of torchtitan's context parallelism (its ring /
all-gather attention, its load balancer) is applied.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.config import (
    TORCH_DTYPE_MAP,
    CompileConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.deepseek_v3.mtp import apply_fsdp_to_mtp_decoder
from torchtitan.protocols.model_spec import ModelSpec

from ulysses_dtensor.parallel.tensor_parallel import check_tp_heads
from ulysses_dtensor.parallel.ulysses import UlyssesAttention, kv_replication

__all__ = [
    "check_heads",
    "check_parallelism",
    "parallelize_ulysses",
    "ulysses_in_forward",
    "ulysses_model_spec",
]

def ulysses_model_spec(spec: ModelSpec, *, pack_qkv: bool = False) -> ModelSpec:
    """``spec`` with its parallelize function replaced by ours (everything else kept)."""
    return dataclasses.replace(spec, parallelize_fn=functools.partial(parallelize_ulysses, pack_qkv=pack_qkv))


# ---------------------------------------------------------------------------
# What the mesh can place: one message each, before anything changes
# ---------------------------------------------------------------------------


def check_heads(model_config, sp: int, tp: int = 1) -> None:
    """Raise unless every attention layer of ``model_config`` can be split over ``tp x sp`` ranks.

    Under tensor parallelism a tp rank computes ``heads / tp`` heads (and
    ``kv_heads / tp``), which Ulysses then exchanges over the sp ranks.
    """
    for i, layer in enumerate(model_config.layers):
        attention = getattr(layer, "attention", None)
        if attention is None or not hasattr(attention, "n_heads"):
            raise ValueError(
                f"Ulysses needs an attention with n_heads in every layer; layers.{i} has "
                f"{type(attention).__name__}: the plug-in supports torchtitan's GQA and MLA decoders "
                "(llama3, qwen3, qwen3 MoE, deepseek_v3)"
            )
        heads = attention.n_heads
        kv_heads = getattr(attention, "n_kv_heads", None) or heads  # MLA: k and v per head
        if tp > 1:
            where = f"layers.{i}.attention under parallelism.tensor_parallel_degree x ulysses.degree"
            check_tp_heads(heads, kv_heads, tp, sp, where)
            continue
        try:
            kv_replication(heads, kv_heads, sp)
        except ValueError as e:
            raise ValueError(f"ulysses.degree={sp} does not fit layers.{i}.attention: {e}") from None


def _has_moe(model_config) -> bool:
    return any(getattr(layer, "moe", None) is not None for layer in model_config.layers)


def check_parallelism(model_config, *, sp: int, tp: int = 1, ep: int = 1) -> None:
    """Refuse what torchtitan's tensor / expert parallelism and our Ulysses (sp = cp degree) cannot place together."""
    if sp > 1 or tp > 1:
        check_heads(model_config, sp, tp)
    if ep > 1 and not _has_moe(model_config):
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep}: the model has no MoE layer to spread over "
            "experts; set it to 1 (expert parallelism is for torchtitan's MoE models: qwen3 MoE, "
            "deepseek_v3)"
        )


# ---------------------------------------------------------------------------
# Ulysses inside the inner attention's forward
# ---------------------------------------------------------------------------


class _Forward(nn.Module):
    """A module's own forward as a module of its own, for a ``ParallelStyle``'s hooks.

    Not registered under the model: its state, names and checkpoints are
    unchanged; it holds the bound forward, not a submodule.
    """

    def __init__(self, forward):
        super().__init__()
        self.run = forward

    def forward(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def ulysses_in_forward(module: nn.Module, sp_mesh: DeviceMesh, style: UlyssesAttention) -> None:
    """Make our ``UlyssesAttention`` part of ``module.forward`` itself.

    The same style and exchange as ``parallelize_module(module, sp_mesh,
    style)``, one level in: torchtitan's tensor parallelism (applied next)
    wraps ``module.forward`` in ``local_map``, so the exchange sees the local
    ``heads / tp`` heads of a tp rank, never a DTensor on the tp mesh.
    """
    kernel = parallelize_module(_Forward(module.forward), sp_mesh, style)
    module.forward = kernel.__call__  # a bound method: not registered as a submodule


# ---------------------------------------------------------------------------
# The parallelize function
# ---------------------------------------------------------------------------


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
    """A ``ModelSpec.parallelize_fn`` for torchtitan's decoders (llama3, qwen3, qwen3 MoE, deepseek_v3).

    Call on the meta-device model (or, under pipeline parallelism, on each
    stage's part), as torchtitan's trainer does. The sp degree is
    ``parallel_dims.cp``; ``pack_qkv`` sends q, k, v in one all-to-all.
    """
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelism.spmd_backend={parallelism.spmd_backend!r}: the Ulysses plug-in runs "
            "torchtitan's 'partial_dtensor' path (plain local activations around the "
            "all-to-all); set parallelism.spmd_backend='partial_dtensor'"
        )
    # before any change to the model
    check_parallelism(model.config, sp=parallel_dims.cp, tp=parallel_dims.tp, ep=parallel_dims.ep)

    if parallel_dims.cp > 1:
        sp_mesh = parallel_dims.get_mesh("cp")
        style = UlyssesAttention(pack_qkv=pack_qkv)
        for block in model.layers.values():
            ulysses_in_forward(block.attention.inner_attention, sp_mesh, style)
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)

    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)

    replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
    edp_mesh = parallel_dims.get_optional_mesh([*replicate, "efsdp"]) if parallel_dims.ep_enabled else None
    apply_fsdp = apply_fsdp_to_mtp_decoder if getattr(model, "mtp_layers", None) is not None else apply_fsdp_to_decoder
    apply_fsdp(
        model,
        parallel_dims.get_mesh([*replicate, "fsdp"]),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        ep_degree=parallel_dims.ep,
        edp_mesh=edp_mesh,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    # torchtitan already divides by the global token count and sets FSDP's
    # divide factor to 1; plain SUM collectives (instead of a pre-multiplied
    # sum by 1) give the same gradients and also run on gloo.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model
