"""Checkpointed blocks whose saved input lives in host memory.

With full activation checkpointing the only activation a block keeps from
forward to backward is its input, ``(batch, seq/sp, dim)``: at 1M tokens on
Llama-3-8B that is 32 layers x 1 GiB (bf16, sp=8). This moves each block
input to pinned CPU memory on a side stream in forward and brings it back in
backward, one block ahead of use, so device memory holds O(1) block inputs.

The block is recomputed in backward from the fetched input (a reentrant-style
checkpoint: the block runs once under no_grad in forward, and again with grad
in backward). Llama blocks have no dropout, so recomputation is exact.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper


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

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def offload(self, x: Tensor) -> int:
        """Start copying ``x`` to host memory; return a handle."""
        if self._slots and all(s.get("fetched") for s in self._slots):
            # The previous step's backward consumed every slot: a new step.
            self._slots.clear()
            self.offloaded_bytes = 0
        slot: dict = {"device": x.device, "shape": x.shape}
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

    def _start_fetch(self, handle: int) -> None:
        slot = self._slots[handle]
        if "device_copy" in slot:
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
        if "ready" in slot:
            torch.cuda.current_stream(slot["device"]).wait_event(slot["ready"])
            slot["device_copy"].record_stream(torch.cuda.current_stream(slot["device"]))
        if handle > 0:
            self._start_fetch(handle - 1)
        x = slot.pop("device_copy")
        slot.pop("host", None)
        slot["fetched"] = True
        return x


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Callable[[Tensor], Tensor], offloader: HostOffloader, x: Tensor) -> Tensor:
        ctx.run, ctx.offloader = run, offloader
        ctx.handle = offloader.offload(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x = ctx.offloader.fetch(ctx.handle).detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.run(x)
        torch.autograd.backward(out, grad_out)
        return None, None, x.grad


class OffloadedCheckpointBlock(ActivationWrapper):
    """Wrap a block ``forward(x, *args, **kwargs)``: checkpointed, input kept on host.

    Extra arguments (rope tables, document ids) are small and stay on the
    device; only ``x`` is offloaded. As an ``ActivationWrapper`` (the base of
    PyTorch's ``checkpoint_wrapper``) it keeps parameter and state-dict names
    free of the wrapper, so checkpoints load with or without offload.
    """

    def __init__(self, block: nn.Module, offloader: HostOffloader):
        super().__init__(block)
        self.offloader = offloader

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        block = self._checkpoint_wrapped_module
        if not torch.is_grad_enabled():
            return block(x, *args, **kwargs)
        return _OffloadedCheckpoint.apply(lambda h: block(h, *args, **kwargs), self.offloader, x)
