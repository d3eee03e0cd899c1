"""Batches by step: read ahead in a background thread, or on the calling thread.

:class:`Prefetcher` runs a loader in a thread, ``depth`` batches ahead of the
training loop, following a plan (step -> batch size, sequence length,
weights). Reading a prepared store is memory copies (numpy releases the GIL),
so the thread overlaps the step's compute.

Exact resume: every batch travels with the loader's state *after* it, and
``state_dict()`` is the state after the last batch the loop took, so a
batch read ahead but not trained on is neither lost nor repeated when a run
resumes from a checkpoint. ``wait_seconds`` is how long the loop waited for
its last batch (the data wait logged per step); ``batch_stats()`` the loader's
figures of that batch (padding share of best-fit rows).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable

__all__ = ["Prefetcher", "StepLoader"]

_STOP = object()


def _read_ahead(loader, plan, step: int, last_step: int, out: queue.Queue, halt: threading.Event) -> None:
    try:
        while step <= last_step and not halt.is_set():
            batch = loader.next_batch(*plan(step))
            item = (step, batch, loader.state_dict(), loader.tokens_seen, loader.source_tokens(),
                    loader.batch_stats())
            while not halt.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1
    except BaseException as e:  # surfaced in the training thread
        while not halt.is_set():
            try:
                out.put((_STOP, e), timeout=0.1)
                return
            except queue.Full:
                continue


class Prefetcher:
    """``loader``'s batches for steps ``first_step .. last_step``, read ahead in a thread."""

    def __init__(self, loader, plan: Callable[[int], tuple], first_step: int, last_step: int, depth: int = 1):
        if depth < 1:
            raise ValueError(f"prefetch depth={depth} must be >= 1")
        self.loader = loader
        self.plan = plan
        self.next_step = first_step
        self.last_step = last_step
        self._state = loader.state_dict()
        self._tokens_seen = loader.tokens_seen
        self._sources = loader.source_tokens()
        self._stats: dict = {}
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._halt = threading.Event()
        # The thread holds no reference to this object: when a failed run drops it,
        # the finalizer stops the thread.
        self._thread = threading.Thread(
            target=_read_ahead, args=(loader, plan, first_step, last_step, self._queue, self._halt),
            name="data-prefetch", daemon=True)
        weakref.finalize(self, self._halt.set)
        self._thread.start()

    def batch_for(self, step: int):
        """The batch of ``step`` (steps are taken in order)."""
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds = time.perf_counter() - t0
        if item[0] is _STOP:
            raise item[1]
        got, batch, self._state, self._tokens_seen, self._sources, self._stats = item
        if got != step:
            raise RuntimeError(f"prefetched batch for step {got}, the loop asked for step {step}")
        self.next_step = step + 1
        return batch

    @property
    def tokens_seen(self) -> int:
        return self._tokens_seen

    def source_tokens(self) -> dict[str, int]:
        return dict(self._sources)

    def batch_stats(self) -> dict:
        return dict(self._stats)

    def state_dict(self) -> dict:
        return self._state

    def close(self) -> None:
        self._halt.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)


class StepLoader:
    """The same interface without a thread: each batch is read when asked for."""

    def __init__(self, loader, plan: Callable[[int], tuple]):
        self.loader = loader
        self.plan = plan
        self.wait_seconds = 0.0

    def batch_for(self, step: int):
        t0 = time.perf_counter()
        batch = self.loader.next_batch(*self.plan(step))
        self.wait_seconds = time.perf_counter() - t0
        return batch

    @property
    def tokens_seen(self) -> int:
        return self.loader.tokens_seen

    def source_tokens(self) -> dict[str, int]:
        return self.loader.source_tokens()

    def batch_stats(self) -> dict:
        return self.loader.batch_stats()

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def close(self) -> None:
        pass
