"""The token stream of one source: its documents, epoch after epoch, forever.

Each epoch visits every document once in :class:`~.order.EpochOrder`; epochs
have the same number of tokens ``T`` (a permutation keeps the sum), so global
token ``t`` is token ``t mod T`` of epoch ``t // T``. Two ways to read it:

* :meth:`TokenStream.read` ``(start, n)``: random access by global token
  offset. It finds the block and document holding ``start`` from the block
  token totals (one ``searchsorted`` over O(N / block) numbers per epoch, one
  over the block's document lengths) and reads from there: the cost is that
  of the tokens returned, wherever they are. This is what packing uses, so a
  data-parallel rank reads its own rows and nothing else.
* :meth:`TokenStream.take` ``(n)``: the next ``n`` tokens from a cursor,
  walking documents one after another (needs no length index: a text source is
  tokenized only as far as it is read). The evaluation reads held-out rows so.

Both return positions that restart at 0 at every document start and at the
start of the returned span.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

from .errors import DataError
from .order import BLOCK_DOCS, EpochOrder
from .token_docs import as_token_docs

__all__ = ["TokenStream"]


class TokenStream:
    """The global token stream of ``source`` (text documents with ``tokenizer``,
    or tokenized documents such as a prepared store)."""

    def __init__(self, source, tokenizer=None, *, seed=0, shuffle: bool = True, block: int = BLOCK_DOCS):
        self.source = source
        self.tokenizer = tokenizer
        self.docs = as_token_docs(source, tokenizer)
        self.seed = seed
        self.shuffle = shuffle
        self.order = EpochOrder(len(self.docs), seed, shuffle, block)
        # sequential cursor (take)
        self.epoch = 0
        self.doc_index = 0  # position in this epoch's order
        self.doc_offset = 0  # tokens of the current document already consumed
        self.tokens_seen = 0
        self._doc: np.ndarray | None = None
        self._doc_key: tuple[int, int] | None = None
        # random access (read)
        self._block_tokens: np.ndarray | None = None
        self._epoch_cum: tuple[int, np.ndarray] | None = None
        self._block_cum: OrderedDict = OrderedDict()

    @property
    def has_targets(self) -> bool:
        return self.docs.has_targets

    def fingerprint(self) -> str:
        return self.docs.fingerprint()

    # ---------------------------------------------------------------- random access
    @property
    def epoch_tokens(self) -> int:
        return int(self._blocks()[-1]) if self.order.n_blocks else 0

    def _blocks(self) -> np.ndarray:
        """Cumulative tokens at the storage block edges (computed once)."""
        if self._block_tokens is None:
            o = self.order
            edges = np.minimum(np.arange(o.n_blocks + 1, dtype=np.int64) * o.block, o.n)
            self._block_tokens = self.docs.cum_tokens(edges)
        return self._block_tokens

    def _visit_cum(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(blocks in epoch order, tokens before each visited block, with the total last)."""
        blocks, _ = self.order.block_perm(epoch)
        if self._epoch_cum is None or self._epoch_cum[0] != epoch:
            sizes = np.diff(self._blocks())[blocks]
            self._epoch_cum = (epoch, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        return blocks, self._epoch_cum[1]

    def _in_block(self, epoch: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents of block b in epoch order, tokens before each, with the total last)."""
        key = (epoch, b)
        if key not in self._block_cum:
            ids = self.order.block_docs(epoch, b)
            cum = np.concatenate([[0], np.cumsum(self.docs.lengths_at(ids))]).astype(np.int64)
            self._block_cum[key] = (ids, cum)
            if len(self._block_cum) > 4:
                self._block_cum.popitem(last=False)
        return self._block_cum[key]

    def read(self, start: int, n: int):
        """Global tokens ``[start, start + n)``: ``(tokens, positions, targets)``, int64
        arrays and the uint8 target flags (None when the documents have none)."""
        total = self.epoch_tokens
        if total <= 0:
            raise DataError(f"every document of {self.fingerprint()} is empty: no tokens to train on")
        toks = np.empty(n, dtype=np.int64)
        pos = np.empty(n, dtype=np.int64)
        tgt = np.empty(n, dtype=np.uint8) if self.has_targets else None
        epoch, u = divmod(int(start), total)
        blocks, vcum = self._visit_cum(epoch)
        k = int(np.searchsorted(vcum, u, side="right")) - 1
        ids, bcum = self._in_block(epoch, int(blocks[k]))
        rel = u - int(vcum[k])
        j = int(np.searchsorted(bcum, rel, side="right")) - 1
        off = rel - int(bcum[j])
        filled = 0
        while filled < n:
            length = int(bcum[j + 1] - bcum[j])
            k_take = min(length - off, n - filled)
            if k_take > 0:
                doc = int(ids[j])
                toks[filled:filled + k_take] = self.docs.tokens(doc, off, off + k_take)
                pos[filled:filled + k_take] = np.arange(k_take)
                if tgt is not None:
                    tgt[filled:filled + k_take] = self.docs.targets(doc, off, off + k_take)
                filled += k_take
            off = 0
            j += 1
            while j >= len(ids):  # next block, next epoch
                k += 1
                if k == len(blocks):
                    epoch, k = epoch + 1, 0
                    blocks, vcum = self._visit_cum(epoch)
                ids, bcum = self._in_block(epoch, int(blocks[k]))
                j = 0
        return toks, pos, tgt

    # ---------------------------------------------------------------- sequential
    def _current_doc(self) -> np.ndarray:
        key = (self.epoch, self.doc_index)
        if self._doc_key != key:
            doc_id = self.order.doc_at(self.epoch, self.doc_index)
            self._doc = self.docs.tokens(doc_id, 0, sys.maxsize)
            self._doc_key = key
        return self._doc

    def _next_doc(self) -> None:
        self.doc_index += 1
        self.doc_offset = 0
        if self.doc_index >= len(self.docs):
            self.doc_index = 0
            self.epoch += 1

    def take(self, n: int, materialize: bool = True):
        """The next ``n`` tokens as ``(tokens, positions)`` int64 arrays.

        ``positions`` restart at 0 at every document start and at the start of
        the returned span. With ``materialize=False`` the tokens are skipped and
        ``None`` is returned.
        """
        toks = np.empty(n, dtype=np.int64) if materialize else None
        pos = np.empty(n, dtype=np.int64) if materialize else None
        filled = 0
        empty_docs = 0
        while filled < n:
            doc = self._current_doc()
            avail = len(doc) - self.doc_offset
            if avail <= 0:
                empty_docs = empty_docs + 1 if len(doc) == 0 else 0
                if empty_docs > len(self.docs):
                    raise DataError(f"every document of {self.fingerprint()} is empty: no tokens to train on")
                self._next_doc()
                continue
            k = min(avail, n - filled)
            if materialize:
                toks[filled : filled + k] = doc[self.doc_offset : self.doc_offset + k]
                pos[filled : filled + k] = np.arange(k)
            filled += k
            self.doc_offset += k
            if self.doc_offset >= len(doc):
                self._next_doc()
        self.tokens_seen += n
        return (toks, pos) if materialize else None

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "doc_index": self.doc_index,
            "doc_offset": self.doc_offset,
            "tokens_seen": self.tokens_seen,
            "seed": _plain(self.seed),
            "shuffle": self.shuffle,
            "source": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("source") not in (None, self.fingerprint()):
            raise ValueError(
                f"checkpointed data position is for data source {state['source']!r} but this "
                f"run reads {self.fingerprint()!r}; resume with the same data"
            )
        for key in ("seed", "shuffle"):
            if key in state and state[key] != _plain(getattr(self, key)):
                raise ValueError(
                    f"checkpointed data {key}={state[key]!r} differs from this run's "
                    f"{getattr(self, key)!r} (job.seed / data.shuffle); the data position "
                    f"would not continue the same stream"
                )
        self.epoch = int(state["epoch"])
        self.doc_index = int(state["doc_index"])
        self.doc_offset = int(state["doc_offset"])
        self.tokens_seen = int(state["tokens_seen"])
        self._doc_key = None


def _plain(seed):
    return list(seed) if isinstance(seed, (tuple, list)) else seed
