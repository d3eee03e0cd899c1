"""Packing: global batches of fixed-length rows from one or more token streams.

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
"""

from __future__ import annotations

import numpy as np
import torch

from ..loss import IGNORE_INDEX
from .mixture import RowMixture
from .stream import TokenStream

__all__ = ["PackedLoader", "LOADER_STATE_FORMAT"]

LOADER_STATE_FORMAT = "rows/1"


class PackedLoader:
    """Global batches of packed rows; ``next_batch`` returns this dp rank's rows.

    ``streams``: a :class:`TokenStream` or a list of them (a mixture), with
    ``weights`` (default: equal) and ``names`` (for metrics).
    """

    def __init__(self, streams, *, dp_rank: int = 0, dp_size: int = 1, weights=None,
                 names: list[str] | None = None, seed: int = 0):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
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
        self.with_labels = any(s.has_targets for s in self.streams)

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
            starts = self.offsets[0] + (first - j0 + np.arange(local)) * seq_len
            sources = np.zeros(local, dtype=np.int64)
            step_rows = np.array([batch_size])
        else:
            rows = np.concatenate([[j0], np.arange(first, first + local + 1), [j0 + batch_size]])
            taken = self.mixture.taken(rows, w)
            at_start, mine, at_end = taken[0], taken[1:-1], taken[-1]
            sources = np.argmax(np.diff(mine, axis=0), axis=1)
            starts = self.offsets[sources] + (mine[np.arange(local), sources] - at_start[sources]) * seq_len
            step_rows = at_end - at_start
        for i in range(local):
            toks, p, tgt = self.streams[int(sources[i])].read(int(starts[i]), seq_len)
            ids[i], pos[i] = toks, p
            if labels is not None:
                labels[i] = toks if tgt is None else np.where(tgt != 0, toks, IGNORE_INDEX)
        self.offsets = self.offsets + step_rows * seq_len
        self.rows += batch_size
        self.tokens_seen += batch_size * seq_len
        out = {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos)}
        if labels is not None:
            out["labels"] = torch.from_numpy(labels)
        return out

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
        self.rows = int(state["rows"])
        self.tokens_seen = int(state["tokens_seen"])
        self.offsets = np.asarray(state["offsets"], dtype=np.int64)
