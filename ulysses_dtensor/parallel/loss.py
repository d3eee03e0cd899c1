"""Cross entropy that gives the single-device mean under any sequence/data split.

Each rank sums the loss over its own valid tokens and divides by the number of
valid tokens in the whole global batch (reduced over dp and sp). The sum of
the ranks' values is then exactly the single-device token-weighted mean, and
so is the sum of their gradients. A rank whose slice has no valid token
contributes 0 (never 0/0). Gradient reduction must therefore SUM over ranks:
``parallelize_llama`` sets FSDP's divide factor accordingly.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

IGNORE_INDEX = -100


def count_valid_tokens(
    labels: Tensor, mesh: DeviceMesh | None = None, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Number of labels != ignore_index, summed over ``mesh`` (all ranks that share the loss)."""
    count = (labels != ignore_index).sum()
    if mesh is not None and mesh.size() > 1:
        count = funcol.all_reduce(count, "sum", mesh.get_group())
    return count


def sp_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    mesh: DeviceMesh | None = None,
    *,
    num_valid_tokens: Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """This rank's share of the global token-mean cross entropy.

    Args:
        logits: ``(..., vocab)`` for this rank's tokens (labels already shifted).
        labels: ``(...)`` target ids, ``ignore_index`` where there is no target.
        mesh: the mesh over which the global batch is spread (all ranks that
            hold a part of it). ``None`` means this rank holds all of it.
        num_valid_tokens: the global count when the caller already knows it
            (saves one all-reduce); else it is counted over ``mesh``.

    Returns a scalar; summed over the ranks of ``mesh`` it is the global mean.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: "
            "logits must be labels.shape + (vocab,)"
        )
    local_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    if num_valid_tokens is None:
        num_valid_tokens = count_valid_tokens(labels, mesh, ignore_index)
    # A global batch with no target at all gives loss 0, not NaN.
    denom = torch.as_tensor(num_valid_tokens, device=local_sum.device).clamp(min=1)
    return local_sum / denom


def global_loss(local_loss: Tensor, mesh: DeviceMesh | None) -> Tensor:
    """The global mean loss for logging: the sum of every rank's share (no grad)."""
    loss = local_loss.detach()
    if mesh is not None and mesh.size() > 1:
        loss = funcol.all_reduce(loss, "sum", mesh.get_group())
        # Wait here: a value that only rank 0 reads would otherwise leave the
        # collective unwaited on the other ranks.
        if isinstance(loss, funcol.AsyncCollectiveTensor):
            loss = loss.wait()
    return loss
