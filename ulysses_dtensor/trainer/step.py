"""One optimizer step of the trainer, shared by the training loop and the memory planner.

The loop calls :func:`train_step` with real tensors; the planner
(:mod:`ulysses_dtensor.estimate`) calls the very same function on fake tensors
under a fake process group to trace the step's memory. Keeping one copy of the
step is what keeps the plan true when the step changes.

One step::

    for each micro-batch of this rank's rows:
        loss share = model(ids, positions, documents, labels=, num_valid_tokens=)
        backward            (FSDP2 reduce-scatters and sums the gradients)
    clip to a global norm, set the scheduled lr, AdamW step, drop the gradients

With a :class:`~ulysses_dtensor.runtime.nonfinite.NonFiniteGuard` the AdamW step is
taken only when the loss and the gradient norm are finite on every rank (decided on all
ranks together, before the step); ``guard.streak`` then says whether it was skipped.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple

import torch
from torch import Tensor, nn

from ..precision.float8 import precompute_fp8_weight_scales
from ..runtime.nonfinite import NonFiniteGuard, inject_nonfinite_grad, inject_nonfinite_loss
from ..runtime.regions import region

__all__ = ["StepResult", "build_optimizer", "train_step"]


class StepResult(NamedTuple):
    loss_sum: Tensor  # this rank's summed loss shares (detached); global_loss() sums ranks
    grad_norm: Tensor  # global gradient norm before clipping


def build_optimizer(cfg, model: nn.Module, *, foreach: bool | None = None) -> torch.optim.Optimizer:
    """The trainer's AdamW over ``model``'s trained parameters, from ``cfg.optimizer``.

    Frozen parameters (a LoRA base, a VL model's vision tower) are not given to
    it: they get no gradient, so AdamW would keep no state for them anyway, and a
    checkpoint's optimizer state then names only what trains.
    ``foreach=None`` keeps torch's default: the multi-tensor (foreach) kernels
    on CUDA, the per-parameter loop on CPU.
    """
    opt = cfg.optimizer
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        foreach=foreach,
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, Tensor | None],
    num_valid_tokens: Tensor | int,
    *,
    micro_batch_size: int = 0,
    max_norm: float = math.inf,
    lr: float | None = None,
    params: list[Tensor] | None = None,
    on_phase: Callable[[str], None] | None = None,
    step: int = 0,
    guard: NonFiniteGuard | None = None,
) -> StepResult:
    """Forward + backward over micro-batches, clip, optimizer step, zero grad.

    Args:
        batch: this rank's slice from ``shard_batch`` (on the model's device):
            ``input_ids``, ``position_ids``, ``labels`` (B, s_local) and
            ``document_ids`` (B, S) or None.
        num_valid_tokens: valid labels of the WHOLE global batch (every rank
            divides its loss sum by it, see ``count_valid_tokens``).
        micro_batch_size: rows per forward/backward (0: all rows at once).
        max_norm: gradient clipping norm (``inf``: measure, don't clip).
        lr: if given, set on every param group before the step.
        params: the parameters to clip (default: those requiring grad).
        on_phase: called with ``"forward"``, ``"backward"`` (per micro-batch),
            ``"clip"``, ``"optimizer"`` and ``"zero_grad"`` as the step enters
            each phase (the memory planner attributes memory to phases).
        step, guard: the step's number and its non-finite guard (None: every
            step is applied, as the planner and the benchmarks run it).
    """
    from ..models.llama_parallelize import clip_grad_norm_

    def phase(name: str) -> None:
        if on_phase is not None:
            on_phase(name)

    ids = batch["input_ids"]
    n_rows = ids.shape[0]
    micro = micro_batch_size or n_rows
    docs = batch.get("document_ids")
    loss_sum = torch.zeros((), device=ids.device)
    if hasattr(model, "aux_loss_weight"):
        # A per-call loss term (a MoE router loss) is the mean over the step's micro-batches.
        model.aux_loss_weight = 1.0 / -(-n_rows // micro)
    for i in range(0, n_rows, micro):
        rows = slice(i, i + micro)
        phase("forward")
        # With labels the model returns this rank's loss share; the head
        # computes it chunk by chunk when memory.tiled_loss is on.
        with region("step.forward"):
            loss = model(
                ids[rows],
                position_ids=batch["position_ids"][rows],
                document_ids=None if docs is None else docs[rows],
                labels=batch["labels"][rows],
                num_valid_tokens=num_valid_tokens,
            )
        if guard is not None:
            loss = inject_nonfinite_loss(step, loss)  # a test hook (runtime/nonfinite.py)
        phase("backward")
        with region("step.backward"):
            loss.backward()
        loss_sum += loss.detach()
        del loss

    phase("clip")
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    if guard is not None:
        inject_nonfinite_grad(step, params)  # a test hook (runtime/nonfinite.py)
    with region("step.clip"):
        grad_norm = clip_grad_norm_(params, max_norm)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    phase("optimizer")
    with region("step.optimizer"):
        if guard is None or guard.check(step, loss_sum, grad_norm, model) is None:
            optimizer.step()
            precompute_fp8_weight_scales(model)  # FP8 all-gathers: next step's weight scales, one all-reduce
        phase("zero_grad")
        optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, grad_norm)
