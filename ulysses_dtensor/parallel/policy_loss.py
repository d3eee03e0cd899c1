"""The GRPO family's loss of a batch of completions, from per-token log-probabilities of
whole sequences: for a training loop of your own under sequence parallelism.

Under SP each rank computes its tokens' log-probabilities
(:func:`~ulysses_dtensor.memory.token_logprobs.chunked_token_stats`) and joins them
into whole sequences (:func:`~ulysses_dtensor.parallel.sequence_values.sp_gather_tokens`:
every sp rank holds them, its gradient flowing into its own tokens). This function then
computes the loss of those whole sequences -- the same value on every sp rank -- with
the normalisations TRL's ``GRPOTrainer`` uses; summed over the sp ranks (FSDP2's
gradient sum) the gradients are the loss's.

Per token, with ``r = exp(logp - old_logp)`` (or its per-sequence mean in log space
for ``importance_sampling_level="sequence"``, GSPO) and the sequence's advantage A:

* ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``-min(r A, clip(r, 1-eps_low,
  1+eps_high) A)`` (``delta`` caps r from above, INTELLECT-2's two-sided clip);
* ``cispo``: ``-sg(min(r, eps_high)) A logp``; ``sapo``: a sigmoid gate of ``r - 1``;
* ``beta > 0`` adds ``beta * (exp(ref - logp) - (ref - logp) - 1)`` (the k3 KL
  estimate), times r with ``bias_correction_kl``.

Then one number: ``grpo``/``sapo`` the mean over sequences of each sequence's token
mean; ``bnpo`` the token mean of the batch; ``dr_grpo`` the token sum over
``batch * max_completion_length``; ``dapo``/``cispo`` the token sum over
``normalizer`` (the global batch's tokens divided by the data-parallel ranks, so that
their mean is the global token mean); ``luspo`` the mean over sequences of their
token sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GRPO_LOSS_TYPES", "GRPOLoss", "grpo_loss"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@dataclass
class GRPOLoss:
    """:func:`grpo_loss`'s result: the loss and what TRL logs of it (masked means over
    this batch's tokens; ``kl`` None when ``beta == 0``)."""

    loss: Tensor
    kl: Tensor | None
    clip_low: Tensor
    clip_high: Tensor


def _capped(ratio: Tensor, delta: float | None) -> Tensor:
    return ratio if delta is None else torch.clamp(ratio, max=delta)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    if x.shape[1] == 1:  # one value per sequence
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def grpo_loss(logps: Tensor, advantages: Tensor, mask: Tensor, *, loss_type: str = "dapo",
              old_logps: Tensor | None = None, ref_logps: Tensor | None = None, beta: float = 0.0,
              epsilon_low: float = 0.2, epsilon_high: float | None = None, delta: float | None = None,
              importance_sampling_level: str = "token", bias_correction_kl: bool = True,
              normalizer: Tensor | float | None = None, max_completion_length: int | None = None,
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05) -> GRPOLoss:
    """The loss of completions ``(B, T)``: ``logps`` the policy's per-token
    log-probabilities (with gradient), ``mask`` 1 for the completion tokens that count,
    ``advantages`` ``(B,)`` (or ``(B, T)``); ``old_logps`` those of the policy that
    sampled (None: on-policy, ``logps`` detached); ``ref_logps`` the reference's (for
    ``beta > 0``). See the module doc for each ``loss_type``."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; valid: {', '.join(GRPO_LOSS_TYPES)}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}; valid: token, sequence")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps, the reference model's per-token log-probabilities")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' divides by batch * max_completion_length: give max_completion_length")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)

    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=eps_high).detach() * advantages * logps
    elif loss_type == "sapo":
        temp = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -(torch.sigmoid(temp * (ratio - 1)) * 4 / temp) * advantages
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
        per_token = -torch.min(_capped(ratio, delta) * advantages, clipped * advantages)

    kl = None
    if beta != 0.0:
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl

    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    elif loss_type == "luspo":
        loss = (per_token * mask).sum(-1).mean()
    else:  # dapo, cispo: over the global batch's tokens per data-parallel rank
        norm = mask.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=per_token.dtype)
        loss = (per_token * mask).sum() / norm.clamp(min=1.0)

    if loss_type in _CLIPPED:
        capped = _capped(ratio, delta)
        low = ((capped < 1 - epsilon_low) & (advantages < 0)).to(logps.dtype)
        high = ((capped > 1 + eps_high) & (advantages > 0)).to(logps.dtype)
    else:
        low = torch.zeros_like(ratio)
        high = ((ratio > eps_high) & (advantages > 0)).to(logps.dtype) if loss_type == "cispo" else low
    with torch.no_grad():
        stats = (None if kl is None else _masked_mean(kl.detach(), mask), _masked_mean(low, mask),
                 _masked_mean(high, mask))
    return GRPOLoss(loss, *stats)
