"""Weighted mixtures of sources: which source each global row comes from.

A global batch of ``B`` rows is rows ``j0 .. j0 + B - 1`` of the run (``j0``:
the rows of all earlier steps). Row ``j`` comes whole from one source: long
documents stay contiguous, and a row's source follows from ``j`` alone. The
split is a fixed, seeded sequence with exact counts in closed form:

    source 0 takes ``floor(n * p0 + phase0)`` of the first ``n`` rows, with
    ``p0 = w0 / (w0 + w1 + ...)``; source 1 takes the same share ``p1 = w1 /
    (w1 + w2 + ...)`` of the rows source 0 left, and so on; the last source
    takes the rest.

Each count grows by 0 or 1 per row, so any ``n`` consecutive rows give source
``k`` ``n * w_k / sum(w)`` rows within about ``k + 1`` rows (the realised
share is within 1% of the weight after a few hundred rows). A rank computes
the counts at its own first row (O(sources), no walk over the other rows), and
from them where in each source's stream its rows start. Weights may change
from one context stage to the next (``weight = [w_stage0, w_stage1, ...]``):
each step uses its stage's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["SourceSpec", "RowMixture"]

_GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class SourceSpec:
    """One ``[[data.sources]]`` entry."""

    path: str
    weight: float | tuple[float, ...] = 1.0  # one weight, or one per context stage
    upsample_min_tokens: int = 0  # documents longer than this ...
    upsample_factor: float = 1.0  # ... appear this many times per epoch
    name: str = ""  # for metrics and messages (default: the path's name)

    @property
    def label(self) -> str:
        return self.name or Path(self.path).name or str(self.path)

    def weight_at(self, stage: int) -> float:
        if isinstance(self.weight, (tuple, list)):
            return float(self.weight[stage])
        return float(self.weight)

    @property
    def upsampled(self) -> bool:
        return self.upsample_factor != 1.0


@dataclass
class RowMixture:
    """The seeded row -> source split of ``n_sources`` sources."""

    n_sources: int
    seed: int = 0
    phase: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        k = np.arange(self.n_sources, dtype=np.float64)
        self.phase = ((int(self.seed) % 1000003) * self.n_sources + k + 1) * _GOLDEN % 1.0

    def taken(self, rows, weights) -> np.ndarray:
        """``out[i, k]``: how many of rows ``[0, rows[i])`` source ``k`` takes under ``weights``."""
        rows = np.asarray(rows, dtype=np.int64)
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (self.n_sources,) or not (w > 0).all():
            raise ValueError(f"mixture weights {list(w)} must be {self.n_sources} positive numbers")
        out = np.empty((len(rows), self.n_sources), dtype=np.int64)
        rest = rows.copy()
        tail = np.cumsum(w[::-1])[::-1]  # w_k + w_k+1 + ...
        for k in range(self.n_sources - 1):
            out[:, k] = np.floor(rest * (w[k] / tail[k]) + self.phase[k]).astype(np.int64)
            rest = rest - out[:, k]
        out[:, -1] = rest
        return out

    def sources(self, first: int, n: int, weights) -> np.ndarray:
        """The source of each of rows ``first .. first + n - 1``."""
        t = self.taken(np.arange(first, first + n + 1), weights)
        return np.argmax(np.diff(t, axis=0), axis=1)
