"""Best-fit decreasing packing: whole samples into rows, over a bounded window.

The stream packing of :mod:`.loader` cuts a row every ``seq_len`` tokens, so the
sample that crosses a row end goes on in the next row as a new document, its
second half trained without its first (an answer without its prompt). Here a
sample is never split unless it alone is longer than a row:

* the samples of one source are taken in its epoch order (:class:`~.order.EpochOrder`)
  in windows of ``window`` consecutive samples, so memory and work per window are
  bounded whatever the store's size (a store of millions is never sorted whole);
* each window is packed by best-fit decreasing: longest sample first, each into
  the row it fills the most (ties: the earliest row), a new row when none has
  room (TRL's ``packing_strategy="bfd"`` is the same rule over its whole dataset);
* the window's rows are shuffled (seeded by the run seed, the epoch and the
  window), so rows of long samples do not come first in every window, and
  emitted one after another; a row's unused tail is padding (its labels are
  ignored, its positions restart at 0: a document of its own that no sample
  attends to).

Samples longer than a row follow ``overlong`` (:data:`OVERLONG`): ``error`` (the
trainer refuses them before it starts), ``truncate`` (the first ``seq_len``
tokens: the prompt, and the answer cut at its end), ``split`` (pieces of
``seq_len`` tokens, each its own document: the stream packing's behaviour for
that sample) or ``drop`` (counted).

Everything is a function of the lengths, the seed and the cursor, so every
data-parallel rank computes the same rows (each then reads the tokens of its
own rows only) and a checkpointed cursor resumes exactly. The cursor is (epoch,
window, row of that window's packing); when the row length changes at a
context stage boundary inside a window, the window's rows not yet emitted are
repacked at the new length (their pieces carried in the cursor).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from .errors import DataError
from .order import _rng

__all__ = ["OVERLONG", "BestFitRows", "best_fit_decreasing", "sample_pieces"]

OVERLONG = ("error", "truncate", "split", "drop")

# Salt of the seeded shuffle of a window's rows (other seeds of the run use (seed, epoch, ...)).
_ROW_SHUFFLE = 0xBFD


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Rows (lists of item indices) holding every item of ``lengths`` (each <= ``capacity``):
    items longest first (ties: lower index first), each into the row whose room is the
    smallest that still takes it (ties: the earliest row), else into a new row."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row) sorted: the best fit is the first >= length
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        k = bisect_left(room, (n, -1))
        if k < len(room):
            free, row = room.pop(k)
        else:
            free, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if free - n > 0:
            insort(room, (free - n, row))
    return rows


def sample_pieces(start: int, stop: int, seq_len: int, overlong: str) -> list[tuple[int, int]]:
    """The spans ``[a, b)`` of tokens ``[start, stop)`` of a sample that go into rows."""
    n = stop - start
    if n <= seq_len:
        return [(start, stop)] if n > 0 else []
    if overlong == "truncate":
        return [(start, start + seq_len)]
    if overlong == "split":
        return [(a, min(a + seq_len, stop)) for a in range(start, stop, seq_len)]
    if overlong == "drop":
        return []
    raise ValueError(f"overlong={overlong!r} has no pieces; valid: truncate, split, drop")


class BestFitRows:
    """The rows of one token stream, best-fit packed window by window.

    ``take(n, seq_len)`` returns the next ``n`` rows, each a list of pieces
    ``(document, start, stop)``, and moves the cursor past them. ``state_dict()``
    is the cursor and the counters (JSON-able); every rank holds the same.
    """

    def __init__(self, stream, *, window: int = 4096, overlong: str = "error"):
        if window < 1:
            raise ValueError(f"data.packing_window={window} must be >= 1")
        if overlong not in OVERLONG:
            raise ValueError(f"data.overlong={overlong!r}; valid: {', '.join(OVERLONG)}")
        self.stream = stream
        self.window = int(window)
        self.overlong = overlong
        self.epoch = 0
        self.window_index = 0
        self.seq_len: int | None = None  # the length the current window was packed at
        self.row = 0  # rows of the current packing already emitted
        self.items: list[list[int]] | None = None  # the window's pieces when repacked; None: its samples
        self.dropped = 0  # samples (or pieces) dropped, truncated, split so far
        self.truncated = 0
        self.split = 0
        self._rows: list[list[tuple[int, int, int]]] | None = None

    # ------------------------------------------------------------ packing
    def _window_items(self) -> list[list[int]]:
        """The current window's samples as [document, 0, length], in epoch order."""
        n = len(self.stream.docs)
        lo = self.window_index * self.window
        ids = self.stream.order.docs_between(self.epoch, lo, min(lo + self.window, n))
        lengths = self.stream.docs.lengths_at(ids)
        return [[int(d), 0, int(n_tok)] for d, n_tok in zip(ids, lengths)]

    def _pack(self, items: list[list[int]], seq_len: int, count: bool) -> list[list[tuple[int, int, int]]]:
        pieces = []
        for doc, start, stop in items:
            if self.overlong == "error" and stop - start > seq_len:  # the trainer checks stores before it starts
                raise DataError(
                    f"{self.stream.fingerprint()}: sample {self.stream.docs.doc_key(doc)} has {stop - start:,} tokens, "
                    f"more than a row of seq_len {seq_len:,}, and data.overlong='error'; set data.overlong to "
                    f"truncate, split or drop, or raise the sequence length")
            spans = sample_pieces(start, stop, seq_len, self.overlong)
            if count and stop - start > seq_len:
                if not spans:
                    self.dropped += 1
                elif self.overlong == "truncate":
                    self.truncated += 1
                else:
                    self.split += 1
            pieces.extend((doc, a, b) for a, b in spans)
        rows = best_fit_decreasing([b - a for _, a, b in pieces], seq_len)
        order = range(len(rows))
        if self.stream.shuffle:
            order = _rng(self.stream.seed, self.epoch, self.window_index, _ROW_SHUFFLE).permutation(len(rows)).tolist()
        return [[pieces[i] for i in sorted(rows[r])] for r in order]

    def _current(self, seq_len: int) -> list[list[tuple[int, int, int]]]:
        """The current window's rows at ``seq_len`` (repacking the rest at a new length)."""
        if self._rows is not None and self.seq_len == seq_len:
            return self._rows
        if self.seq_len is not None and self.seq_len != seq_len:
            # A stage boundary inside the window: what is left of it, packed at the new length.
            rest = self._rows_of_cursor()[self.row:]
            self.items = [list(p) for row in rest for p in row]
            self.row = 0
            self._rows = self._pack(self.items, seq_len, count=True)
        else:  # the window packed from its samples (or from a checkpoint's cursor)
            fresh = self.items is None
            self._rows = self._pack(self.items if not fresh else self._window_items(), seq_len,
                                    count=fresh and self.row == 0)
        self.seq_len = seq_len
        return self._rows

    def _rows_of_cursor(self) -> list[list[tuple[int, int, int]]]:
        if self._rows is None:
            items = self.items if self.items is not None else self._window_items()
            self._rows = self._pack(items, self.seq_len, count=False)
        return self._rows

    def _next_window(self) -> None:
        self.window_index += 1
        self.row, self.items, self._rows, self.seq_len = 0, None, None, None
        if self.window_index * self.window >= len(self.stream.docs):
            self.epoch, self.window_index = self.epoch + 1, 0

    def take(self, n: int, seq_len: int) -> list[list[tuple[int, int, int]]]:
        """The next ``n`` rows at ``seq_len`` tokens."""
        out: list = []
        empty = 0
        while len(out) < n:
            rows = self._current(seq_len)
            got = rows[self.row:self.row + n - len(out)]
            out.extend(got)
            self.row += len(got)
            if self.row >= len(rows):
                empty = empty + 1 if not rows else 0
                if empty > -(-len(self.stream.docs) // self.window):
                    raise DataError(f"{self.stream.fingerprint()}: no sample fits a row of {seq_len:,} tokens "
                                    f"(data.overlong={self.overlong!r}): nothing to train on")
                self._next_window()
        return out

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "window": self.window_index, "seq_len": self.seq_len, "row": self.row,
                "items": self.items, "dropped": self.dropped, "truncated": self.truncated, "split": self.split,
                "window_size": self.window, "overlong": self.overlong}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("window_size", self.window), ("overlong", self.overlong)):
            if state[key] != mine:
                name = "packing_window" if key == "window_size" else key
                raise ValueError(f"checkpointed data.{name}={state[key]!r} differs from this run's {mine!r}: the "
                                 f"rows would not continue the same packing; resume with the same value")
        self.epoch, self.window_index = int(state["epoch"]), int(state["window"])
        self.seq_len = None if state["seq_len"] is None else int(state["seq_len"])
        self.row, self.items = int(state["row"]), state["items"]
        self.dropped, self.truncated, self.split = int(state["dropped"]), int(state["truncated"]), int(state["split"])
        self._rows = None
