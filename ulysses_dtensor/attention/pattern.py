"""Which (query, key) pairs attend, and how their scores are shaped.

Positions are indices of the full (local) sequence, i.e. GLOBAL positions
after the Ulysses exchange. Query i may attend to key j when

* ``causal``: ``j <= i``;
* ``window`` W: ``i - j < W`` (with causal: the W most recent keys, the query
  itself included), transformers' ``sliding_window`` semantics;
* packed documents: i and j lie in the same run of equal document ids.

Scores are ``q.k * scale`` (``scale`` default ``1/sqrt(head_dim)``), then
``softcap * tanh(scores / softcap)`` with soft-capping. ``sinks`` (one logit
per query head) join the softmax denominator only: with ``Z`` the sum of the
exponentiated scores of a query, its weights become ``exp(s_j) / (Z +
exp(sink))``, i.e. the sink-free output times ``sigmoid(lse - sink)`` with
``lse = log Z``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Pattern", "dense_mask"]


@dataclass(frozen=True)
class Pattern:
    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def features(self) -> frozenset:
        names = [n for n, on in (("window", self.window is not None), ("softcap", self.softcap is not None),
                                 ("sinks", self.sinks)) if on]
        return frozenset(names)


def check_pattern(causal: bool, window, softcap, sinks: Tensor | None, heads: int) -> Pattern:
    """Validate the pattern arguments of :func:`~.local.local_attention`."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be a positive int (keys a query sees, itself included) or None")
        if not causal:
            raise ValueError(f"window={window} needs causal=True: a sliding window here looks back only")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap={softcap!r} must be a positive finite float or None")
    if sinks is not None:
        if not isinstance(sinks, Tensor) or tuple(sinks.shape) != (heads,) or not sinks.is_floating_point():
            shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise ValueError(
                f"sinks must be a float tensor of shape (query heads,) = ({heads},), one logit per head; got {shape}"
            )
    return Pattern(causal, window, None if softcap is None else float(softcap), sinks is not None)


def dense_mask(seg: Tensor | None, pattern: Pattern, s: int, device: torch.device) -> Tensor | None:
    """Boolean (B or 1, 1, S, S) mask of allowed pairs; None for plain causal or full attention."""
    if seg is None and pattern.window is None:
        return None
    allowed = None
    if pattern.causal:
        i = torch.arange(s, device=device)
        rel = i[:, None] - i[None, :]
        allowed = rel >= 0
        if pattern.window is not None:
            allowed &= rel < pattern.window
        allowed = allowed[None]
    if seg is not None:
        same = seg[:, :, None] == seg[:, None, :]
        allowed = same if allowed is None else same & allowed
    return allowed[:, None]
