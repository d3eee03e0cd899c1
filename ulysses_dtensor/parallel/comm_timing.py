"""Time spent in the Ulysses exchanges, forward and backward, per step.

The sp all-to-alls are the one cost sequence parallelism adds to a step, so
their share of the step time is worth watching as its own metric. While an
:class:`ExchangeTimer` is active (``with timer.active():``), every exchange of
:mod:`ulysses_dtensor.parallel.ulysses` runs through a timed path:

* CUDA: two events recorded on the current stream around the collective and its
  wait (the stream then waits for the NCCL kernel, so the end event fires when
  the exchanged data is usable). Nothing synchronises in the step: the events
  are read by :meth:`ExchangeTimer.read`, at log time, after the step's loss was
  fetched anyway.
* CPU (gloo is synchronous): wall clock around the collective and its wait.

Either way the time includes waiting for the slowest peer of the sp group: it
is what the step spends in the exchange, not the wire time alone.

With no timer active the exchange takes the plain functional collective with
autograd, exactly as before; the only cost is one module-global lookup per
exchange. The timed path is eager only: ``torch.compile`` cannot trace host
clocks or events inside a ``fullgraph`` block, so the trainer leaves the timer
off with ``training.compile``.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

__all__ = ["ExchangeTimer", "active_timer", "exchange_metrics", "timed_all_to_all"]

_ACTIVE: "ExchangeTimer | None" = None


def active_timer() -> "ExchangeTimer | None":
    return _ACTIVE


class ExchangeTimer:
    """Accumulates exchange durations per step; ``read()`` returns and clears them."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # CUDA: (kind, start event, end event) not yet read; CPU: seconds per kind.
        self._pending: list[tuple[str, object, object]] = []
        self._seconds = {"forward": 0.0, "backward": 0.0}
        self._calls = {"forward": 0, "backward": 0}

    @contextlib.contextmanager
    def active(self):
        """Time every Ulysses exchange inside this block (not reentrant across timers)."""
        global _ACTIVE
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous

    @contextlib.contextmanager
    def span(self, kind: str):
        self._calls[kind] += 1
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((kind, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds[kind] += time.perf_counter() - t0

    def read(self) -> dict:
        """Seconds and calls since the last read, by direction; clears them.

        On CUDA this reads the recorded events (waiting only for the last one,
        which has normally completed by log time).
        """
        if self._pending:
            self._pending[-1][2].synchronize()
            for kind, start, end in self._pending:
                self._seconds[kind] += start.elapsed_time(end) / 1e3
            self._pending.clear()
        out = {
            "forward_s": self._seconds["forward"],
            "backward_s": self._seconds["backward"],
            "calls": self._calls["forward"] + self._calls["backward"],
        }
        out["total_s"] = out["forward_s"] + out["backward_s"]
        self._seconds = {"forward": 0.0, "backward": 0.0}
        self._calls = {"forward": 0, "backward": 0}
        return out


def _exchange(x: Tensor, group) -> Tensor:
    out = funcol.all_to_all_single(x.contiguous(), None, None, group)
    if isinstance(out, funcol.AsyncCollectiveTensor):
        return out.wait()
    return funcol.wait_tensor(out)


class _TimedAllToAll(torch.autograd.Function):
    """An equal-split all-to-all whose forward and backward exchanges are timed.

    The backward of an equal-split all-to-all is the same all-to-all of the
    gradient (chunk i goes back to rank i), as in the functional version.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group, timer: ExchangeTimer) -> Tensor:
        ctx.group, ctx.timer = group, timer
        with timer.span("forward"):
            return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        with ctx.timer.span("backward"):
            return _exchange(grad, ctx.group), None, None


def timed_all_to_all(x: Tensor, group, timer: ExchangeTimer) -> Tensor:
    """``all_to_all_single_autograd(x, None, None, group)`` with both directions timed."""
    return _TimedAllToAll.apply(x, group, timer)


def exchange_metrics(reading: dict, step_seconds: float) -> dict:
    """Metric fields of one step from :meth:`ExchangeTimer.read`: milliseconds forward,
    backward and total, and the share of the step's wall time."""
    return {
        "exchange_ms": reading["total_s"] * 1e3,
        "exchange_fwd_ms": reading["forward_s"] * 1e3,
        "exchange_bwd_ms": reading["backward_s"] * 1e3,
        "exchange_share": reading["total_s"] / step_seconds if step_seconds > 0 else None,
    }
