"""Packing: global batches of fixed-length rows from one or more token streams.

Two ways to fill a row (``packing``): ``"stream"`` (below, for pretraining text)
cuts the source's token stream every ``S`` tokens; ``"bfd"`` places whole
samples into rows by best-fit decreasing over a window of samples and pads the
rest of the row (:mod:`.bestfit`, for SFT data: no sample is split unless it
alone is longer than a row). Both give every rank the same global batch whatever
the mesh, and both resume exactly from ``state_dict()``.

A global batch of ``B`` rows of ``S`` tokens is rows ``j0 .. j0 + B - 1`` of the
run. Row ``j`` comes from source ``s(j)`` (:class:`~.mixture.RowMixture`; always
0 for one source) and is the next ``S`` tokens of that source's stream: the
source's rows follow each other without a gap or an overlap, so no token is
dropped, repeated or padded, and a document cut by a row boundary continues at
the start of that source's next row, where its positions restart at 0 (the two
parts are trained as two documents).

Data parallelism. Rank ``r`` of ``dp`` takes the contiguous rows
``[r*B/dp, (r+1)*B/dp)`` of each global batch, so the global batch, and the
loss, are the same whatever the mesh. A rank computes where its first row
starts in each stream from the run's row count and each stream's offset at the
step start (closed-form mixture counts, O(sources)), then reads only its own
rows (:meth:`~.stream.TokenStream.read`): nothing of the other ranks' rows is
read or tokenized, and a step costs the same at dp 1 and dp 1000.

State. ``state_dict()`` is the whole position: rows so far, tokens taken from
each stream, and the streams' fingerprints and seeds (a checkpoint stores it;
resuming needs no replay). It is the same on every rank.

Best-fit rows. Every rank walks each source's packing (lengths only, a window
at a time) and reads the tokens of its own rows; padding has the label
``IGNORE_INDEX`` and positions restarting at 0 (a document of its own), so it is
neither trained on nor attended to by a sample. :meth:`PackedLoader.batch_stats`
gives the step's share of padded tokens (over the whole global batch: every rank
knows every row's layout) and the overlong samples dropped / truncated / split so far.
"""

from __future__ import annotations

import numpy as np
import torch

from ..parallel.loss import IGNORE_INDEX
from .bestfit import BestFitRows
from .mixture import RowMixture
from .stream import TokenStream

__all__ = ["PackedLoader", "LOADER_STATE_FORMAT", "PACKINGS"]

LOADER_STATE_FORMAT = "rows/1"
PACKINGS = ("stream", "bfd")


class PackedLoader:
    """Global batches of packed rows; ``next_batch`` returns this dp rank's rows.

    ``streams``: a :class:`TokenStream` or a list of them (a mixture), with
    ``weights`` (default: equal) and ``names`` (for metrics). ``packing``:
    ``"stream"`` or ``"bfd"`` (with ``window`` samples per packing and the
    ``overlong`` rule of :mod:`.bestfit`).
    """

    def __init__(self, streams, *, dp_rank: int = 0, dp_size: int = 1, weights=None,
                 names: list[str] | None = None, seed: int = 0, packing: str = "stream",
                 window: int = 4096, overlong: str = "error"):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if packing not in PACKINGS:
            raise ValueError(f"data.packing={packing!r}; valid: {', '.join(PACKINGS)}")
        self.streams: list[TokenStream] = [streams] if isinstance(streams, TokenStream) else list(streams)
        k = len(self.streams)
        self.names = list(names) if names is not None else [f"source{i}" for i in range(k)]
        self.weights = list(weights) if weights is not None else [1.0] * k
        self.mixture = RowMixture(k, seed)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.rows = 0
        self.offsets = np.zeros(k, dtype=np.int64)  # tokens taken from each stream
        self.tokens_seen = 0
        self.packing = packing
        self.packers = ([BestFitRows(s, window=window, overlong=overlong) for s in self.streams]
                        if packing == "bfd" else None)
        # Padding must be ignored by the loss: best-fit rows always carry labels.
        self.with_labels = self.packers is not None or any(s.has_targets for s in self.streams)
        self._pad_share = 0.0

    @property
    def stream(self) -> TokenStream:
        return self.streams[0]

    def next_batch(self, batch_size: int, seq_len: int, weights=None) -> dict[str, torch.Tensor]:
        """This rank's rows of the next global batch: ``input_ids``, ``position_ids``
        (and ``labels`` with target masks: ignored where a token is no target)."""
        if batch_size % self.dp_size:
            raise ValueError(
                f"global batch of {batch_size} sequences is not divisible by dp={self.dp_size}"
            )
        w = self.weights if weights is None else list(weights)
        local = batch_size // self.dp_size
        j0 = self.rows
        first = j0 + self.dp_rank * local
        ids = np.empty((local, seq_len), dtype=np.int64)
        pos = np.empty((local, seq_len), dtype=np.int64)
        labels = np.empty((local, seq_len), dtype=np.int64) if self.with_labels else None
        if len(self.streams) == 1:
            index = first - j0 + np.arange(local)  # each of my rows' place among its source's rows of this step
            sources = np.zeros(local, dtype=np.int64)
            step_rows = np.array([batch_size])
        else:
            rows = np.concatenate([[j0], np.arange(first, first + local + 1), [j0 + batch_size]])
            taken = self.mixture.taken(rows, w)
            at_start, mine, at_end = taken[0], taken[1:-1], taken[-1]
            sources = np.argmax(np.diff(mine, axis=0), axis=1)
            index = mine[np.arange(local), sources] - at_start[sources]
            step_rows = at_end - at_start
        if self.packers is None:
            starts = self.offsets[sources] + index * seq_len
            for i in range(local):
                toks, p, tgt = self.streams[int(sources[i])].read(int(starts[i]), seq_len)
                ids[i], pos[i] = toks, p
                if labels is not None:
                    labels[i] = toks if tgt is None else np.where(tgt != 0, toks, IGNORE_INDEX)
            self.offsets = self.offsets + step_rows * seq_len
        else:
            layouts = [packer.take(int(n), seq_len) for packer, n in zip(self.packers, step_rows)]
            for i in range(local):
                s = int(sources[i])
                _fill_row(self.streams[s].docs, layouts[s][int(index[i])], ids[i], pos[i], labels[i])
            used = np.array([sum(b - a for row in rows for _, a, b in row) for rows in layouts], dtype=np.int64)
            self._pad_share = 1.0 - int(used.sum()) / (batch_size * seq_len)
            self.offsets = self.offsets + used
        self.rows += batch_size
        self.tokens_seen += batch_size * seq_len
        out = {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos)}
        if labels is not None:
            out["labels"] = torch.from_numpy(labels)
        return out

    def preview(self, plan) -> dict:
        """``batch_stats`` over the global batches of ``plan`` (one ``(batch_size, seq_len,
        weights)`` per step) from the current position, from the lengths alone: nothing is
        read and the loader does not move. ``pad_share`` is over all of them."""
        if self.packers is None:
            return {}
        packers = []
        for p in self.packers:
            copy = BestFitRows(p.stream, window=p.window, overlong=p.overlong)
            copy.load_state_dict(p.state_dict())
            packers.append(copy)
        rows, used, total = self.rows, 0, 0
        for batch_size, seq_len, weights in plan:
            taken = self.mixture.taken([rows, rows + batch_size], self.weights if weights is None else weights)
            for packer, n in zip(packers, taken[1] - taken[0]):
                used += sum(b - a for row in packer.take(int(n), seq_len) for _, a, b in row)
            rows += batch_size
            total += batch_size * seq_len
        return {"pad_share": 1.0 - used / max(total, 1), "samples_dropped": sum(p.dropped for p in packers),
                "samples_truncated": sum(p.truncated for p in packers), "samples_split": sum(p.split for p in packers)}

    def batch_stats(self) -> dict:
        """Of the last batch (best-fit rows only): ``pad_share``, the share of its global
        batch's tokens that are padding; and overlong samples handled so far:
        ``samples_dropped``, ``samples_truncated``, ``samples_split``."""
        if self.packers is None:
            return {}
        return {"pad_share": self._pad_share,
                "samples_dropped": sum(p.dropped for p in self.packers),
                "samples_truncated": sum(p.truncated for p in self.packers),
                "samples_split": sum(p.split for p in self.packers)}

    def source_tokens(self) -> dict[str, int]:
        """Tokens taken from each source so far (all ranks together)."""
        return {n: int(t) for n, t in zip(self.names, self.offsets)}

    def state_dict(self) -> dict:
        fps = [s.fingerprint() for s in self.streams]
        return {
            "format": LOADER_STATE_FORMAT,
            "rows": self.rows,
            "tokens_seen": self.tokens_seen,
            "offsets": [int(x) for x in self.offsets],
            "names": list(self.names),
            "sources": fps,
            "source": fps[0] if len(fps) == 1 else "mixture(" + ", ".join(fps) + ")",
            "seed": [s.state_dict()["seed"] for s in self.streams],
            "shuffle": [s.shuffle for s in self.streams],
            "packing": self.packing,
            **({"packers": [p.state_dict() for p in self.packers]} if self.packers is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != LOADER_STATE_FORMAT:
            raise ValueError(
                "the checkpointed data position is of an older format (a sequential cursor: "
                f"{sorted(state)}); this version packs rows by global offset ({LOADER_STATE_FORMAT}): "
                "resume it with the version that wrote it, or start a new run"
            )
        mine = self.state_dict()
        if state["sources"] != mine["sources"]:
            raise ValueError(
                f"checkpointed data position is for data source(s) {state['sources']} but this run "
                f"reads {mine['sources']}; resume with the same data (data.path / data.sources, "
                f"data.max_corpus_mb, up-sampling)"
            )
        for key in ("seed", "shuffle"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"checkpointed data {key}={state[key]!r} differs from this run's {mine[key]!r} "
                    f"(job.seed / data.shuffle); the data position would not continue the same stream"
                )
        packing = state.get("packing", "stream")  # written before best-fit packing: the stream's
        if packing != self.packing:
            raise ValueError(f"checkpointed data position is of data.packing={packing!r} and this run packs "
                             f"with {self.packing!r}: the rows would not continue; resume with the same packing")
        self.rows = int(state["rows"])
        self.tokens_seen = int(state["tokens_seen"])
        self.offsets = np.asarray(state["offsets"], dtype=np.int64)
        for packer, packer_state in zip(self.packers or [], state.get("packers", [])):
            packer.load_state_dict(packer_state)


def _fill_row(docs, pieces, ids: np.ndarray, pos: np.ndarray, labels: np.ndarray) -> None:
    """One best-fit row in place: its pieces one after another, each its own document
    (positions from 0), then padding (token 0, label ignored, positions from 0)."""
    at = 0
    for doc, a, b in pieces:
        n = b - a
        toks = docs.tokens(doc, a, b)
        ids[at:at + n] = toks
        pos[at:at + n] = np.arange(n)
        tgt = docs.targets(doc, a, b)
        labels[at:at + n] = toks if tgt is None else np.where(tgt != 0, toks, IGNORE_INDEX)
        at += n
    ids[at:] = 0
    pos[at:] = np.arange(len(ids) - at)
    labels[at:] = IGNORE_INDEX
