"""The order of documents in each epoch: a seeded two-level shuffle.

Documents are grouped in blocks of ``block`` consecutive documents. Epoch
``e`` visits the blocks in a permutation seeded by ``(seed, e)`` and the
documents of each block in a permutation seeded by ``(seed, e, block)``.
Without ``shuffle`` both are the identity.

Why two levels: locating a token needs the number of tokens before every
document in epoch order. A full permutation of N documents needs O(N) memory
per rank for that (16 bytes per document: 16 GB for a billion documents); here
it is O(N / block) for the block totals of an epoch plus O(block) for the
block being read, whatever the corpus size. Documents of one block stay
within one block of the epoch, in a new order; blocks move anywhere.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

__all__ = ["EpochOrder", "BLOCK_DOCS"]

BLOCK_DOCS = 8192


def _rng(seed, *more) -> np.random.Generator:
    seed = list(seed) if isinstance(seed, (tuple, list)) else [seed]
    return np.random.default_rng([*seed, *more])


class EpochOrder:
    """Which document is at each position of each epoch (no token counts)."""

    def __init__(self, n: int, seed=0, shuffle: bool = True, block: int = BLOCK_DOCS):
        self.n = int(n)
        self.seed = seed
        self.shuffle = shuffle
        self.block = int(block)
        self.n_blocks = -(-self.n // self.block)
        self._perm_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._docs_cache: OrderedDict = OrderedDict()

    def block_range(self, b: int) -> tuple[int, int]:
        return b * self.block, min((b + 1) * self.block, self.n)

    def block_perm(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(blocks in visiting order, first epoch position of each visited block)."""
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            blocks = (_rng(self.seed, epoch).permutation(self.n_blocks) if self.shuffle
                      else np.arange(self.n_blocks))
            sizes = np.minimum((blocks + 1) * self.block, self.n) - blocks * self.block
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            self._perm_cache = (epoch, blocks, starts)
        return self._perm_cache[1], self._perm_cache[2]

    def block_docs(self, epoch: int, b: int) -> np.ndarray:
        """The documents of block ``b`` in epoch ``epoch``'s order."""
        key = (epoch, b)
        if key not in self._docs_cache:
            lo, hi = self.block_range(b)
            ids = np.arange(lo, hi, dtype=np.int64)
            if self.shuffle:
                ids = lo + _rng(self.seed, epoch, b + 1).permutation(hi - lo)
            self._docs_cache[key] = ids
            if len(self._docs_cache) > 4:
                self._docs_cache.popitem(last=False)
        return self._docs_cache[key]

    def docs_between(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        """The documents at positions ``lo .. hi - 1`` (0 <= lo <= hi <= n) of ``epoch``."""
        blocks, starts = self.block_perm(epoch)
        out = []
        k = int(np.searchsorted(starts, lo, side="right")) - 1
        while lo < hi:
            ids = self.block_docs(epoch, int(blocks[k]))
            a = lo - int(starts[k])
            take = ids[a:a + hi - lo]
            out.append(take)
            lo += len(take)
            k += 1
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def doc_at(self, epoch: int, pos: int) -> int:
        """The document at position ``pos`` (0 <= pos < n) of ``epoch``."""
        blocks, starts = self.block_perm(epoch)
        k = int(np.searchsorted(starts, pos, side="right")) - 1
        return int(self.block_docs(epoch, int(blocks[k]))[pos - starts[k]])
