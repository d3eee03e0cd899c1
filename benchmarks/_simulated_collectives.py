"""Collectives of the fake process group with defined outputs, on every torch version.

``bench_train.py --mode simulate`` runs one rank of a large world on the fake
process group: every collective is skipped. What the skipped collective leaves
in its output differs between torch versions: torch 2.11's fake group leaves
all-to-all, all-gather and reduce-scatter outputs as allocated (stale memory:
zeros, old activations or NaN), later versions copy the input (pytorch #178078,
#182365). A timed step on stale memory measures the wrong thing (a GPU's
matmuls run faster on zeros than on random data) and can turn the loss NaN.

:class:`DefinedCollectives` is a dispatch mode that, after each collective ran,
writes what this rank would receive if every rank held the same data as it:

* all-to-all: its own input, in place (each rank keeps its part);
* all-gather: its input once per rank;
* reduce-scatter: its input's first slice (the simulated process is rank 0 of
  every group it is in), the mean over identical ranks;
* in-place collectives (all-reduce, broadcast) leave the tensor as it was.

The values are realistic (this rank's own activations and gradients), the same
on every torch version, and cost one device copy per collective, about what
the real collective writes. A dispatch mode makes ``torch.compile`` run eagerly,
so compiled simulated steps are left to the fake group (the record says so).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DefinedCollectives", "UndefinedCollectives", "define_output"]

# c10d ops (what torch.distributed.* calls dispatch to): (output argument, input argument).
# Their schemas mark no argument as written, so the table names them.
_C10D = {
    "alltoall_base_": (0, 1),
    "alltoall_": (0, 1),
    "_allgather_base_": (0, 1),
    "allgather_into_tensor_coalesced_": (0, 1),
    "allgather_": (0, 1),
    "_reduce_scatter_base_": (0, 1),
    "reduce_scatter_tensor_coalesced_": (0, 1),
    "reduce_scatter_": (0, 1),
}
# Functional collectives (the Ulysses exchange, DTensor redistributes) return their output.
_FUNCTIONAL = ("all_to_all_single", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced")
_IN_PLACE = ("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "barrier", "monitored_barrier_",
             "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "broadcast",
             "wait_tensor", "_wrap_tensor_autograd")


def define_output(out: torch.Tensor, inp: torch.Tensor) -> None:
    """Write into ``out`` what rank 0 receives when every rank sends ``inp``: a copy of
    ``inp`` (same size: all-to-all), ``inp`` repeated (all-gather), or its first slice
    (reduce-scatter). Sizes in no such relation raise: a collective this table does not know."""
    n_out, n_in = out.numel(), inp.numel()
    if n_out == n_in:
        out.copy_(inp.reshape(out.shape))
    elif n_in and n_out % n_in == 0:
        # Block by block: FSDP2 gathers in place (its input is one block of the output),
        # and a copy must not read what it writes.
        src = inp.reshape(n_in)
        for block in out.view(n_out // n_in, n_in):
            if block.data_ptr() != src.data_ptr():
                block.copy_(src)
    elif n_out and n_in % n_out == 0:
        out.copy_(inp.reshape(n_in // n_out, n_out)[0].reshape(out.shape))
    else:
        raise ValueError(f"collective output of {n_out} elements from an input of {n_in}: neither a copy, "
                         "a gather nor a scatter")


def _pairs(out, inp):
    """(output tensor, input tensor) pairs of a collective's arguments (tensors or nested lists)."""
    if isinstance(out, torch.Tensor):
        if isinstance(inp, torch.Tensor):
            yield out, inp
        else:  # reduce_scatter_: one output from a list of inputs (one per rank): rank 0's
            yield out, inp[0]
        return
    if isinstance(inp, torch.Tensor):  # allgather_: a list of outputs from one input
        for o in out:
            yield from _pairs(o, inp)
        return
    for o, i in zip(out, inp):
        yield from _pairs(o, i)


class DefinedCollectives(TorchDispatchMode):
    """Gives every skipped collective's output a defined value (module docstring).

    ``counts``: collectives whose output was written, by op; ``unknown``: collectives
    this table does not know (their outputs are left as the process group left them)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.unknown: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        namespace = func.namespace
        if namespace not in ("c10d", "_c10d_functional"):
            return result
        name = func._overloadpacket.__name__
        if namespace == "c10d" and name in _C10D:
            o, i = _C10D[name]
            pairs = list(_pairs(args[o], args[i]))
        elif namespace == "_c10d_functional" and name.removesuffix("_out") in _FUNCTIONAL:
            out = kwargs.get("out", result)  # the *_out variants write into ``out=``
            pairs = list(_pairs(out, args[0]))
        else:
            if name not in _IN_PLACE:
                self.unknown[f"{namespace}::{name}"] += 1
            return result
        with torch.no_grad():
            for out, inp in pairs:
                define_output(out, inp)
        self.counts[f"{namespace}::{name}"] += 1
        return result


class UndefinedCollectives(TorchDispatchMode):
    """What torch 2.11's fake process group does, for tests on a torch that copies: every
    all-to-all, all-gather and reduce-scatter output is overwritten with NaN (except the block
    of an in-place gather that is its own input, which no collective writes)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace == "c10d" and name in _C10D:
            pairs = _pairs(args[_C10D[name][0]], args[_C10D[name][1]])
        elif func.namespace == "_c10d_functional" and name.removesuffix("_out") in _FUNCTIONAL:
            pairs = _pairs(kwargs.get("out", result), args[0])
        else:
            return result
        with torch.no_grad():
            for out, inp in pairs:
                n_in = inp.numel()
                if out.numel() > n_in and out.numel() % n_in == 0:
                    for block in out.view(-1, n_in):
                        if block.data_ptr() != inp.data_ptr():
                            block.fill_(float("nan"))
                else:
                    out.fill_(float("nan"))
        return result
