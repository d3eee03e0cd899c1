"""Named regions of a training step, for ``torch.profiler``.

The library marks where its work happens -- the attention kernel, the Ulysses
exchange and its layout copies, projections, MLP, norms, the loss, offload
copies, the trainer's backward / clip / optimizer -- so that a profile of a
step can be cut into those parts (``benchmarks/gpu_perf.py`` does; see
docs/benchmarks.md). A region is a ``torch.profiler.record_function`` named
``ud.<name>``, or ``ud.<name>.recompute`` when it is entered while autograd
runs a backward: forward code re-run by activation checkpointing in backward
lands in its own rows. Backward kernels carry no region; a profile attributes
them through autograd's sequence numbers to the forward op that made them.

Cost: with no profiler running a region is one check of a module flag (and, for
``with region(...)``, a shared no-op context): 0.4-0.7 microseconds on a busy CPU
(benchmarks/README.md, "Reading the region table"). Inside ``torch.compile`` a region is a no-op context too (no
graph break, no guard on the profiler's state): compiled code shows up in a
profile under the compiled graph's own names instead.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd import profiler as _profiler
from torch.compiler import is_compiling

__all__ = ["PREFIX", "RECOMPUTE_SUFFIX", "REGIONS", "in_region", "region", "split_region_name"]

PREFIX = "ud."
RECOMPUTE_SUFFIX = ".recompute"

# Every region the library marks, and what runs inside it.
REGIONS = {
    "attention": "the local attention kernel over the full sequence (attention/local.py)",
    "ulysses.layout": "the exchange's reshapes, permutes and contiguous copies around the all-to-all",
    "ulysses.all_to_all": "the Ulysses all-to-all itself",
    "hf.attention": "the transformers attention function around the exchange (layout transposes, copies)",
    "proj.qkv": "q, k, v projections",
    "proj.o": "the output projection",
    "rope": "rotary embedding of q and k",
    "norm": "RMSNorms (block norms, q/k norms, final norm)",
    "mlp": "the MLP (each tile, when tiled)",
    "embedding": "the token embedding lookup",
    "loss": "output head and cross entropy (each chunk, when tiled)",
    "offload.copy_out": "a checkpointed block input copied to host memory",
    "offload.copy_in": "a block input brought back from host memory (in backward)",
    "step.forward": "the trainer's forward call (the model regions nest inside)",
    "step.backward": "the trainer's backward call",
    "step.clip": "gradient-norm clipping",
    "step.optimizer": "the optimizer step and zero_grad",
}


class _NoRegion:
    """The context a region is when nothing records it: no state, shared."""

    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_REGION = _NoRegion()


def _recorded(name: str):
    if torch._C._current_graph_task_id() != -1:  # inside a backward: recomputed forward code
        return _profiler.record_function(PREFIX + name + RECOMPUTE_SUFFIX)
    return _profiler.record_function(PREFIX + name)


def region(name: str):
    """A context manager marking ``name`` (a key of :data:`REGIONS`) for the profiler.

    A no-op unless a profiler is recording; inside ``torch.compile`` always a no-op.
    """
    if is_compiling():
        # Checked first, so that dynamo never reads (and guards on) the profiler flag.
        return contextlib.nullcontext()
    if not _profiler._is_profiler_enabled:
        return _NO_REGION
    return _recorded(name)


def in_region(name: str):
    """Decorator form of :func:`region`: the function's body runs inside region ``name``."""

    def wrap(fn):
        @functools.wraps(fn)
        def marked(*args, **kwargs):
            if is_compiling() or not _profiler._is_profiler_enabled:  # no context to enter: cheaper
                return fn(*args, **kwargs)
            with _recorded(name):
                return fn(*args, **kwargs)

        return marked

    return wrap


def split_region_name(event_name: str) -> tuple[str, bool] | None:
    """``("attention", True)`` for ``"ud.attention.recompute"``; None for a name that is no region."""
    if not event_name.startswith(PREFIX):
        return None
    name = event_name[len(PREFIX):]
    if name.endswith(RECOMPUTE_SUFFIX):
        return name[: -len(RECOMPUTE_SUFFIX)], True
    return name, False
