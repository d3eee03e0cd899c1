"""Attention as the memory planner traces it: the kernel a target GPU would run.

The planner (``estimate/``) traces a training step on CPU fake tensors, where
the GPU kernels cannot run, and what it needs of them is their memory, not
their numbers. While :func:`planning_for` is active, every
:func:`~.local.local_attention` call asks the kernel table which kernel the
TARGET machine would run for its case (``auto``), or checks that the named
backend runs there, and stands in for it on the CPU with a call of the same
memory class (:data:`~.kernel_table.MEMORY`):

* ``lse`` (cuDNN, FlashAttention 2/4, varlen, flex, SDPA without a mask): SDPA's
  CPU flash kernel on the plain causal pattern keeps what they keep, the output
  and one log-sum-exp per query; a window, a soft-cap or sinks change no
  tensor's size there, and documents are ``cu_seqlens`` or a block mask;
* ``dense_mask``: the ``sdpa`` path with its (B, 1, S, S) mask;
* ``dense_scores``: the ``sdpa`` path's explicit (B, H, S, S) scores.

So a sliding-window family planned for an H100 is planned with the O(S)
kernel ``auto`` runs there, not with a dense mask that a CPU run would build.
Each call's choice is counted, so the plan says what it planned.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from torch import Tensor

from .capabilities import Capabilities
from .dense import sdpa_attention
from .kernel_table import Case, Choice, auto_choice, cudnn_refusal, fa4_refusal, memory_class
from .pattern import Pattern
from .select import FEATURES, SUPPORTS, kernel_refusal

__all__ = ["PlannedKernelError", "count_planned", "default_target", "planned_attention", "planned_choice",
           "planning_for", "planning_target"]

class PlannedKernelError(ValueError):
    """A named backend that cannot run a call's case on the machine planned for."""


def default_target(device: str) -> Capabilities:
    """The machine a plan for ``device`` ("cuda" or "cpu") is for, when none is named:
    this machine's GPU when it has one, else an H100 with this torch's version (and
    the cuDNN its CUDA 13 wheels ship); the CPU for "cpu"."""
    import torch

    if device == "cpu":
        return Capabilities.read("cpu")
    if torch.cuda.is_available():
        return Capabilities.probe("cuda")
    return Capabilities.target("H100", torch.__version__)


# (target machine, counts of the choices made) while planning; None otherwise.
_TARGET: tuple[Capabilities, Counter] | None = None


@contextlib.contextmanager
def planning_for(caps: Capabilities) -> Iterator[Counter]:
    """Attention calls inside plan for ``caps``; yields the counts of
    :class:`~.kernel_table.Choice` made (one per call)."""
    global _TARGET
    previous, counts = _TARGET, Counter()
    _TARGET = (caps, counts)
    try:
        yield counts
    finally:
        _TARGET = previous


def planning_target() -> Capabilities | None:
    """The machine attention is being planned for, or None (it runs)."""
    return None if _TARGET is None else _TARGET[0]


def count_planned(choice: Choice) -> None:
    """Count one call planned as ``choice`` (callers that run the planned kernel themselves:
    head chunks, :mod:`ulysses_dtensor.parallel.head_chunk_kernels`)."""
    if _TARGET is not None:
        _TARGET[1][choice] += 1


def planned_choice(backend: str, case: Case, caps: Capabilities) -> Choice:
    """What runs ``case`` on ``caps``: ``auto``'s row, or the named ``backend`` if it
    can run there (:class:`PlannedKernelError` naming the backend, the machine and the reason if not)."""
    if backend == "auto":
        return auto_choice(case, caps)
    features = {f for f in FEATURES if getattr(case, f)}
    why = None
    if not features <= SUPPORTS[backend]:
        why = f"its kernel cannot apply {FEATURES[sorted(features - SUPPORTS[backend])[0]]}"
    why = why or kernel_refusal(backend, caps.device_type, case.dtype, case.head_dim, case.dv)
    if not why and backend == "cudnn":
        why = cudnn_refusal(case, caps, auto=False)
    elif not why and backend == "fa4":
        why = fa4_refusal(case, caps, auto=False)
    elif not why and backend == "flash_attn" and not caps.flash_attn:
        why = "the flash-attn package is not on it"
    elif not why and backend == "varlen" and not (caps.varlen and (caps.varlen_window or not case.window)):
        why = "its torch has no varlen_attn" + (" with window_size" if caps.varlen else "")
    if why:
        raise PlannedKernelError(f"attention backend {backend!r} cannot run {case.name()} on the planned machine "
                         f"({caps.describe()}): {why}")
    return Choice(backend, case.name(), "named in the config", "named", memory_class(backend, case))


def planned_attention(q: Tensor, k: Tensor, v: Tensor, backend: str, pattern: Pattern, seg, scale,
                      sinks: Tensor | None) -> Tensor:
    """The stand-in :func:`~.local.local_attention` runs while planning: the memory of
    the kernel the target machine runs for this call."""
    caps, counts = _TARGET
    case = Case(q.dtype, q.shape[3], v.shape[3], documents=seg is not None, window=pattern.window is not None,
                softcap=pattern.softcap is not None, sinks=pattern.sinks)
    choice = planned_choice(backend, case, caps)
    counts[choice] += 1
    if choice.memory == "lse":
        return sdpa_attention(q, k, v, Pattern(causal=pattern.causal), None, scale, None)
    if choice.memory == "dense_mask":
        return sdpa_attention(q, k, v, Pattern(pattern.causal, pattern.window), seg, scale, None)
    return sdpa_attention(q, k, v, pattern, seg, scale, sinks)
