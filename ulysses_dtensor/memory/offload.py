"""Checkpointed blocks whose saved input lives in host memory.

With full activation checkpointing the only activation a block keeps from
forward to backward is its input, ``(batch, seq/sp, dim)``: at 1M tokens on
Llama-3-8B that is 32 layers x 1 GiB (bf16, sp=8). This moves each block
input to pinned CPU memory on a side stream in forward and brings it back in
backward, one block ahead of use, so device memory holds O(1) block inputs.

The block runs under PyTorch's non-reentrant activation checkpointing, with
one change: the function checkpointing replays reads the block input from the
host copy instead of holding the device tensor. Forward is the block's own,
with grad, so everything it returns -- through its outputs or through hooks
(transformers records MoE router logits that way) -- is part of the autograd
graph, every tensor argument that requires grad gets its gradient, and the
parameters get theirs even when the input itself requires none (a frozen
embedding below). Recomputation is exact; for blocks with dropout it replays
forward's RNG state (``preserve_rng_state``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    ActivationWrapper,
)
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from ..runtime.regions import in_region

__all__ = ["HostOffloader", "OffloadedCheckpointBlock"]


class HostOffloader:
    """Owns the host copies of block inputs and the order to prefetch them in.

    One instance is shared by all blocks of a model so that the backward of
    block i can start fetching the input of block i-1.
    """

    def __init__(self, host_device: str | torch.device = "cpu") -> None:
        # "meta" makes host copies free on the traced device: the memory
        # planner uses it under fake tensors to model pinned host memory.
        self.host_device = torch.device(host_device)
        self._slots: list[dict] = []
        self.offloaded_bytes = 0  # bytes moved out in the current step
        self._stream = None

    @property
    def held(self) -> int:
        """Block inputs held on the host now (0 once a step's backward is done)."""
        return sum(1 for s in self._slots if "host" in s)

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    @in_region("offload.copy_out")
    def offload(self, x: Tensor) -> int:
        """Start copying ``x`` to host memory; return a handle."""
        if self._slots and self.held == 0:
            # The previous step's backward consumed every slot: a new step.
            self._slots.clear()
            self.offloaded_bytes = 0
        slot: dict = {"device": x.device}
        stream = self._side_stream(x.device)
        if self.host_device.type == "meta":
            slot["host"] = x.detach().to("meta")
        elif stream is None:
            # CPU compute: the "host copy" is a copy in the same memory; the
            # code path (copy out, copy back, prefetch order) stays the same.
            slot["host"] = x.detach().clone()
        else:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                host.copy_(x.detach(), non_blocking=True)
                slot["event"] = torch.cuda.Event()
                slot["event"].record(stream)
            # The device tensor must outlive the async copy.
            x.record_stream(stream)
            slot["host"] = host
        self.offloaded_bytes += x.numel() * x.element_size()
        self._slots.append(slot)
        return len(self._slots) - 1

    def release(self, handle: int) -> None:
        """Drop a host copy that no backward will fetch (nothing in the block needed grad)."""
        slot = self._slots[handle]
        slot.pop("host", None)
        slot.pop("device_copy", None)

    @in_region("offload.copy_in")
    def _start_fetch(self, handle: int) -> None:
        slot = self._slots[handle]
        if "device_copy" in slot or "host" not in slot:
            return
        stream = self._side_stream(slot["device"])
        if self.host_device.type == "meta":
            slot["device_copy"] = slot["host"].to(slot["device"])
            return
        if stream is None:
            slot["device_copy"] = slot["host"]
            return
        with torch.cuda.stream(stream):
            stream.wait_event(slot["event"])
            slot["device_copy"] = slot["host"].to(slot["device"], non_blocking=True)
            slot["ready"] = torch.cuda.Event()
            slot["ready"].record(stream)

    def fetch(self, handle: int) -> Tensor:
        """Return the block input on its device, and prefetch the previous block's."""
        self._start_fetch(handle)
        slot = self._slots[handle]
        if "device_copy" not in slot:
            raise RuntimeError(
                f"block input {handle} was fetched twice or released: a checkpointed block's "
                "backward ran twice (retain_graph=True is not supported with offload_activations)"
            )
        if "ready" in slot:
            torch.cuda.current_stream(slot["device"]).wait_event(slot["ready"])
            slot["device_copy"].record_stream(torch.cuda.current_stream(slot["device"]))
        if handle > 0:
            self._start_fetch(handle - 1)
        x = slot.pop("device_copy")
        slot.pop("host", None)
        return x


class _BlockInput:
    """What the checkpointed function reads as the block input: the tensor itself
    the first time (forward), the host copy brought back every later time (the
    recomputation in backward). Holding no reference after forward is what lets
    the device tensor go."""

    def __init__(self, x: Tensor, handle: int, offloader: HostOffloader):
        self._x, self._handle, self._offloader = x, handle, offloader
        # The recomputation must save what forward saved, which depends on it.
        self._requires_grad = x.requires_grad

    def get(self) -> Tensor:
        if self._x is not None:
            x, self._x = self._x, None
            return x
        return self._offloader.fetch(self._handle).detach().requires_grad_(self._requires_grad)


def _run_block(block: nn.Module, source: _BlockInput, *args, **kwargs):
    return block(source.get(), *args, **kwargs)


class OffloadedCheckpointBlock(ActivationWrapper):
    """Wrap a block ``forward(x, *args, **kwargs)``: checkpointed, input kept on host.

    ``x`` is the first positional argument (or the keyword ``hidden_states``,
    as transformers' decoder layers name it). Other arguments (rope tables,
    document ids) are small and stay on the device. As an ``ActivationWrapper``
    (the base of PyTorch's ``checkpoint_wrapper``) it keeps parameter and
    state-dict names free of the wrapper, so checkpoints load with or without
    offload.
    """

    def __init__(self, block: nn.Module, offloader: HostOffloader, preserve_rng_state: bool = False):
        super().__init__(block)
        self.offloader = offloader
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args, **kwargs):
        block = self._checkpoint_wrapped_module
        if args:
            x, args = args[0], args[1:]
        elif "hidden_states" in kwargs:
            x = kwargs.pop("hidden_states")
        else:
            raise TypeError(f"{type(block).__name__}: offload_activations needs the block input as the first "
                            "positional argument (or hidden_states=)")
        if not torch.is_grad_enabled():
            return block(x, *args, **kwargs)
        handle = self.offloader.offload(x)
        source = _BlockInput(x, handle, self.offloader)
        del x
        out = checkpoint(_run_block, block, source, *args, use_reentrant=False,
                         preserve_rng_state=self.preserve_rng_state, **kwargs)
        if not any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(out)):
            self.offloader.release(handle)  # no backward will come for it
        return out
