"""Tensor parallelism (``tp > 1``) under Ulysses: PyTorch's own styles, per decoder block.

Within a block the weights are split Megatron-style over the ``tp`` ranks:
q/k/v and the MLP's up-projections column-wise (each rank computes its
``heads / tp`` heads and ``ffn / tp`` columns), the attention output and the
MLP's down-projection row-wise (partial sums, all-reduced). Between blocks the
residual stream is replicated over ``tp`` -- each tp rank holds this sp rank's
whole slice -- so the norms, the embedding and the head stay whole (FSDP shards
them over ``dp_shard x sp`` as before) and everything that runs per token
(norms, tiling, the tiled loss, offload) sees plain tensors. Ulysses then
exchanges the ``heads / tp`` local heads over the sp ranks:
``heads % (tp * ulysses) == 0``, and the GQA rules hold for ``kv_heads / tp``.

A norm over one head's dim (Qwen3's q/k norms) sees only this rank's heads, so
its weight's gradient is a partial sum: :func:`sum_grad_over` all-reduces it
over tp in backward (transformers' ``replicated_with_grad_allreduce``).

Communication per block and step (:func:`tp_all_reduces`): an all-reduce of
``(B, S/sp, dim)`` per row-wise module forward (attention output, MLP output)
and per column-wise module backward (the gradients of their replicated input),
plus the Ulysses bytes of ``heads / tp`` heads over sp.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from .mesh import divisors
from .ulysses import kv_replication

__all__ = [
    "HF_TP_STYLES",
    "LLAMA_TP_PLAN",
    "check_tp_heads",
    "hf_tp_plan",
    "sum_grad_over",
    "tensor_parallelize",
    "tp_all_reduces",
]

# Our Llama's block, by module path: (style, whether its weight gradient is partial over tp).
LLAMA_TP_PLAN = {
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "attention.q_norm": "replicated_with_grad_allreduce",
    "attention.k_norm": "replicated_with_grad_allreduce",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}
# transformers' base_model_tp_plan values this module runs; any other (packed, gathered,
# expert or embedding styles) refuses the family for tp > 1.
HF_TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def check_tp_heads(n_heads: int, n_kv_heads: int, tp: int, ulysses: int, where: str) -> None:
    """Refuse heads the tp x ulysses ranks cannot place (one message naming the values)."""
    if tp == 1:
        return
    if n_heads % tp or n_kv_heads % tp:
        valid = [d for d in divisors(n_heads) if n_kv_heads % d == 0]
        raise ValueError(
            f"{where}: tp={tp} must divide the heads ({n_heads}) and the kv heads ({n_kv_heads}), each rank "
            f"computing its own; valid tp: {valid}")
    try:
        kv_replication(n_heads // tp, n_kv_heads // tp, ulysses)
    except ValueError as e:
        raise ValueError(f"{where} with tp={tp}: the {n_heads // tp} heads and {n_kv_heads // tp} kv heads "
                         f"of a tp rank over ulysses={ulysses}: {e}") from None


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group."""

    @staticmethod
    def forward(ctx, weight: Tensor, group) -> Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def sum_grad_over(weight: Tensor, group) -> Tensor:
    """``weight``, whose gradient is summed over ``group`` in backward (None: as it is)."""
    return weight if group is None else _SumGradOver.apply(weight, group)


def _style(name: str, value: str):
    if value == "colwise":
        return ColwiseParallel(use_local_output=True)
    if value == "rowwise":
        return RowwiseParallel(use_local_output=True)
    raise ValueError(f"{name}: TP style {value!r} is not one this package runs; valid: {', '.join(HF_TP_STYLES)}")


def tensor_parallelize(blocks: list[nn.Module], mesh: DeviceMesh, plan: dict[str, str]) -> int:
    """Apply ``plan`` (block-relative module path patterns -> style) to every block in
    place; return how many modules it sharded. Norms marked
    ``replicated_with_grad_allreduce`` get ``sp_grad_group`` (their forward sums
    the weight's gradient over tp)."""
    group = mesh.get_group()
    sharded = 0
    for block in blocks:
        names = dict(block.named_modules())
        for pattern, value in plan.items():
            for name in fnmatch.filter(names, pattern):
                if value == "replicated_with_grad_allreduce":
                    names[name].sp_grad_group = group
                    continue
                parallelize_module(names[name], mesh, _style(pattern, value))
                sharded += 1
    return sharded


def hf_tp_plan(model: nn.Module, decoder_prefix: str) -> dict[str, str]:
    """A transformers model's ``base_model_tp_plan``, block-relative (``layers.*.`` cut),
    restricted to what :data:`HF_TP_STYLES` runs; ValueError naming the model and the
    style for one it does not."""
    name = type(model).__name__
    plan = getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{name} has no base_model_tp_plan in its config: transformers declares no tensor-parallel "
                         "plan for this family; use tp=1")
    out = {}
    for key, value in plan.items():
        if value not in HF_TP_STYLES:
            raise ValueError(f"{name}: its base_model_tp_plan shards {key} with {value!r}, which this package does not "
                             f"run under Ulysses (valid: {', '.join(HF_TP_STYLES)}); use tp=1")
        if not key.startswith(decoder_prefix):
            raise ValueError(f"{name}: base_model_tp_plan key {key!r} is outside the decoder layers "
                             f"({decoder_prefix}*); use tp=1")
        out[key[len(decoder_prefix):]] = value
    return out


def tp_all_reduces(plan: dict[str, str]) -> tuple[int, int]:
    """(forward, backward) all-reduces of ``(batch, seq/sp, dim)`` per block under ``plan``: each
    row-wise module sums its output in forward; each column-wise module's input gradient is
    summed in backward (DTensor converts the replicated input once per module)."""
    styles = list(plan.values())
    return styles.count("rowwise"), styles.count("colwise")
