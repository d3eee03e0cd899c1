"""Teacher-forced scoring of an answer, from the logits that predict it.

The prompt and the answer go through the model in one forward pass. At each
answer position the model's next-token distribution is read: the answer is
*correct* when every answer token is the argmax given the prompt and the answer
tokens before it (that is exactly what greedy decoding would produce), and its
*mean log-probability* is the mean over the answer tokens of
``log_softmax(logits)[token]``. Forward passes only, so the scoring runs under
sequence parallelism unchanged: each rank scores the answer positions it holds
and the per-sample sums are reduced once (see :mod:`.runner`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_stats", "teacher_forced_score"]


def token_stats(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per position: whether ``targets`` is the argmax, and its log-probability.

    ``logits``: ``(n, vocab)``; ``targets``: ``(n,)``. Returns a bool tensor and
    a float64 tensor of shape ``(n,)``. A target tied with another token for the
    maximum counts as correct only when it is the first maximum (torch's
    argmax), as greedy decoding would pick.
    """
    logits = logits.float()
    correct = logits.argmax(dim=-1) == targets
    logprob = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return correct, logprob.double()


def teacher_forced_score(logits: Tensor, answer: Tensor) -> tuple[bool, float]:
    """(all answer tokens are the argmax, mean log-probability of the answer).

    ``logits[i]`` is the model's prediction of ``answer[i]`` (the logits at the
    position just before that token).
    """
    if logits.shape[:-1] != answer.shape or answer.dim() != 1 or answer.numel() == 0:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be (answer tokens, vocab) for an answer of "
            f"shape {tuple(answer.shape)} (at least one token)"
        )
    correct, logprob = token_stats(logits, answer)
    return bool(correct.all()), float(logprob.mean())
