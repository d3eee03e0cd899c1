"""Next-token loss in log-spaced position buckets.

Average perplexity barely tells whether a model uses long context: the
long-range tokens are few and diluted by the many that need little context.
Splitting the loss by the position of the predicting token inside its document
(``position_ids``: how much context it has) shows it: a model that uses the
context has a lower loss in the far buckets.

Buckets double in width: ``[0, f), [f, 2f), [2f, 4f), ...`` up to the eval
length, with ``f`` = length / 128 rounded down to a power of two (8 buckets: for
128K tokens ``0-1K, 1K-2K, ..., 64K-128K``; for 256 tokens ``0-2, 2-4, ...``).

Each rank sums the losses of the positions it holds into the buckets (a loss
sum and a token count per bucket, float64 / exact counts); one all-reduce at
the end gives the global sums, whatever the sp / dp split.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["bucket_edges", "BucketSums"]


def bucket_edges(length: int, first: int | None = None) -> list[int]:
    """Edges ``[0, f, 2f, 4f, ..., length]`` of the position buckets."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if first is None:
        first = 1 << max(0, (length // 128).bit_length() - 1) if length >= 128 else 1
    edges, edge = [0], first
    while edge < length:
        edges.append(edge)
        edge *= 2
    edges.append(length)
    return edges


class BucketSums:
    """This rank's loss sums and token counts per position bucket (float64)."""

    def __init__(self, edges: list[int], device: torch.device | str = "cpu"):
        self.edges = list(edges)
        self._inner = torch.tensor(self.edges[1:-1], dtype=torch.int64, device=device)
        self.loss_sum = torch.zeros(len(edges) - 1, dtype=torch.float64, device=device)
        self.count = torch.zeros(len(edges) - 1, dtype=torch.float64, device=device)

    def add(self, nll: Tensor, positions: Tensor) -> None:
        """Add per-token losses ``nll`` at document ``positions`` (same shape, valid tokens only)."""
        bucket = torch.bucketize(positions.reshape(-1), self._inner, right=True)
        self.loss_sum.index_add_(0, bucket, nll.reshape(-1).double())
        self.count.index_add_(0, bucket, torch.ones_like(bucket, dtype=torch.float64))

    def pack(self) -> Tensor:
        return torch.cat([self.loss_sum, self.count])

    def rows(self, packed: Tensor) -> list[dict]:
        """Per bucket ``start, end, tokens, loss`` (null loss for an empty bucket) from
        the reduced :meth:`pack` tensor."""
        n = len(self.edges) - 1
        sums, counts = packed[:n].tolist(), packed[n:].tolist()
        return [
            {"start": self.edges[b], "end": self.edges[b + 1], "tokens": int(round(counts[b])),
             "loss": sums[b] / counts[b] if counts[b] else None}
            for b in range(n)
        ]
