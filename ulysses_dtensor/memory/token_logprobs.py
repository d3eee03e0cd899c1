"""Per-token log-probabilities and entropy of a model's logits, for policy-gradient and
preference losses (GRPO, DPO and their kin), on this rank's slice of the sequence.

What these losses need of a token is not a cross entropy summed into one number but
values per token: the log-probability of the sampled (or chosen) token, the entropy of
the distribution it was drawn from, and for some metrics the mean logit, ``log sum p^2``
and whether the token was the argmax. Each is a function of that token's logits only,
so under sequence parallelism each rank computes them for its own tokens; what joins
them into per-sequence sums, or back into whole sequences, is
:mod:`~ulysses_dtensor.parallel.sequence_values`.

* :func:`token_stats`: the values of some logits (``temperature`` divides them first,
  as sampling at that temperature does);
* :func:`chunked_token_stats`: the same from final hidden states and a head, over
  chunks of the sequence, each chunk's logits recomputed in backward: the logits of
  one chunk are the only ones ever held (the tiled loss's trick, for per-token values).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .tiling import auto_loss_chunks, checkpointed_pieces
from ..parallel.loss import IGNORE_INDEX

__all__ = ["TOKEN_FIELDS", "chunked_token_stats", "token_stats"]

# The per-token values, in the order they are stacked: log p(target), the entropy of
# the distribution, log sum_v p_v^2 (WPO's weights), the mean logit, target == argmax.
TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _check_fields(fields) -> tuple[str, ...]:
    fields = tuple(fields)
    unknown = [f for f in fields if f not in TOKEN_FIELDS]
    if unknown or not fields:
        raise ValueError(f"token fields {list(fields)}: each must be one of {', '.join(TOKEN_FIELDS)}")
    return fields


def _stack(logits: Tensor, targets: Tensor, fields: tuple[str, ...], temperature: float,
           ignore_index: int) -> Tensor:
    """(..., len(fields)) float32 values of ``fields``; 0 where the target is ignored."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    valid = targets != ignore_index
    safe = targets.masked_fill(~valid, 0)
    log_z = torch.logsumexp(z, dim=-1)
    out = []
    for field in fields:
        if field == "log_probs":
            value = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1) - log_z
        elif field == "entropy":
            value = log_z - (torch.softmax(z, dim=-1) * z).sum(-1)
        elif field == "log_sum_sq_probs":
            value = torch.logsumexp(2 * z, dim=-1) - 2 * log_z
        elif field == "mean_logits":
            value = z.mean(-1)
        else:  # is_top1: ties go to the first index, as argmax's
            value = (z.argmax(-1) == safe).float()
        out.append(value.masked_fill(~valid, 0.0))
    return torch.stack(out, dim=-1)


def _unstack(stacked: Tensor, fields: tuple[str, ...]) -> dict[str, Tensor]:
    values = dict(zip(fields, stacked.unbind(-1)))
    if "is_top1" in values:
        values["is_top1"] = values["is_top1"].detach() > 0.5
    for name in ("log_sum_sq_probs", "mean_logits"):  # metrics and weights: no gradient
        if name in values:
            values[name] = values[name].detach()
    return values


def token_stats(logits: Tensor, targets: Tensor, fields=("log_probs",), *, temperature: float = 1.0,
                ignore_index: int = IGNORE_INDEX) -> dict[str, Tensor]:
    """Per-token values of ``logits`` ``(..., vocab)`` at ``targets`` ``(...)`` (shifted:
    ``targets[t]`` is the token position t predicts), one tensor ``(...)`` per field of
    :data:`TOKEN_FIELDS` asked for; 0 (False) where the target is ``ignore_index``.
    ``log_probs`` and ``entropy`` carry gradients; the others are metrics and weights."""
    fields = _check_fields(fields)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits must "
                         "be targets.shape + (vocab,)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    return _unstack(_stack(logits, targets, fields, float(temperature), ignore_index), fields)


def chunked_token_stats(hidden: Tensor, head: Callable[[Tensor], Tensor], targets: Tensor, fields=("log_probs",),
                        *, temperature: float = 1.0, chunks: int | None = None, vocab: int | None = None,
                        ignore_index: int = IGNORE_INDEX) -> dict[str, Tensor]:
    """:func:`token_stats` of ``head(hidden)`` without ever holding more than one chunk's logits.

    ``hidden`` ``(B, S, dim)``, ``targets`` ``(B, S)``; ``head`` maps hidden states to
    logits (the model's output layer with its logit transforms). The sequence is cut into
    ``chunks`` pieces (None: from the shapes, as the tiled loss cuts it, with ``vocab``
    the head's output size); with grad each piece is checkpointed, its logits recomputed
    in backward."""
    fields = _check_fields(fields)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    seq = hidden.shape[1]
    if chunks is None:
        if vocab is None:
            raise ValueError("chunked_token_stats: give chunks, or vocab for a count from the shapes")
        chunks = auto_loss_chunks(hidden.shape[0] * seq, vocab)
    n = max(1, min(int(chunks), seq))
    step = math.ceil(seq / n) if seq else 1
    starts = list(range(0, seq, step))

    def piece_values(h: Tensor, t: Tensor) -> Tensor:
        return _stack(head(h), t, fields, float(temperature), ignore_index)

    def piece(i: int):
        a = starts[i]
        return hidden[:, a:a + step], targets[:, a:a + step]

    if len(starts) <= 1:
        stacked = piece_values(hidden, targets)
    elif torch.is_grad_enabled():
        parts = list(checkpointed_pieces(piece_values, len(starts), piece, lambda out, k: out.new_zeros(
            (out.shape[0], k * out.shape[1], *out.shape[2:]))))
        stacked = torch.cat(parts, dim=1)
    else:
        stacked = torch.cat([piece_values(*piece(i)) for i in range(len(starts))], dim=1)
    return _unstack(stacked, fields)
