"""Checkpointed blocks whose saved input lives in host memory.

With full activation checkpointing the only activation a block keeps from
forward to backward is its input, ``(batch, seq/sp, dim)``: at 1M tokens on
Llama-3-8B that is 32 layers x 1 GiB (bf16, sp=8). This moves each block
input to pinned CPU memory on a side stream in forward and brings it back in
backward, one block ahead of use, so device memory holds O(1) block inputs.

When the step's attention ran in head chunks (long context:
:mod:`ulysses_dtensor.parallel.head_chunks`), the previous block's input comes
back once this block's attention backward is done, not as this block's backward
starts: the attention backward is the peak of a block's backward, and the
input arriving early would add its size to it. A layer's backward at those
lengths takes seconds; the copy, a fraction of one.

With ``offload_dir`` the copies go to a file on a local disk through a bounded
staging area instead of host memory (:mod:`.disk_offload`); the order of copies
out, prefetches and waits is the same.

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

import functools

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    ActivationWrapper,
)
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from ..parallel.head_chunks import after_chunked_backward, chunked_calls
from ..runtime.regions import in_region
from .disk_offload import DiskStore
from .saved_attention import AttentionKeeping, KeptOutputs, take_kept_outputs

__all__ = ["HostOffloader", "OffloadedCheckpointBlock", "make_offloader"]


def make_offloader(memory) -> "HostOffloader | None":
    """The offloader a model's :class:`~ulysses_dtensor.memory.options.MemoryOptions` asks for
    (None: nothing offloaded); with ``offload_dir``, to a file there. Touches no disk: the
    directory is checked before the first write."""
    if not memory.offload_activations:
        return None
    return HostOffloader(disk=DiskStore(memory.offload_dir) if memory.offload_dir is not None else None)


class HostOffloader:
    """Owns the host copies of block inputs and the order to prefetch them in.

    One instance is shared by all blocks of a model so that the backward of
    block i can start fetching the input of block i-1. A slot holds a block's
    input and, with ``save_attention``, the attention outputs its checkpoint
    kept (:meth:`add`); they come back together.

    ``disk``: a :class:`~.disk_offload.DiskStore`: the copies go to its file through its
    staging area instead of host memory. The planner's fake tensors and
    ``host_device="meta"`` write nothing; :attr:`staging_bytes` and :attr:`disk_bytes`
    count what a real step would hold.
    """

    def __init__(self, host_device: str | torch.device = "cpu", disk: DiskStore | None = None) -> None:
        # "meta" makes host copies free on the traced device: the memory
        # planner uses it under fake tensors to model pinned host memory.
        self.host_device = torch.device(host_device)
        self.disk = disk
        self.blocks = 0  # blocks wrapped with this offloader (the disk's space check before a write)
        self._slots: list[dict] = []
        self.offloaded_bytes = 0  # bytes moved out in the current step
        self._stream = None
        self._chunked_at_start = 0  # chunked attention calls counted when the step's forward began

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the disk tier's staging area (0 without ``disk``)."""
        return self.disk.staging_bytes if self.disk is not None else 0

    @property
    def disk_bytes(self) -> int:
        """Bytes the disk tier's file holds: the largest step's offloaded bytes (0 without ``disk``)."""
        return self.disk.disk_bytes if self.disk is not None else 0

    def close(self) -> None:
        """End the disk tier's I/O thread and drop its file (also done when collected)."""
        if self.disk is not None:
            self.disk.close()

    def _real(self, x: Tensor) -> bool:
        # The planner's traces: host copies counted, never made.
        return self.host_device.type != "meta" and x.device.type != "meta" and not is_fake(x)

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
    def _copy_out(self, slot: dict, x: Tensor) -> None:
        if self.disk is not None:
            real = slot["real"] = self._real(x)
            stream = self._side_stream(x.device) if real else None
            slot["host"].append((self.disk.put(x, stream, io=real), None))
            self.offloaded_bytes += x.numel() * x.element_size()
            return
        stream = self._side_stream(x.device)
        if self.host_device.type == "meta":
            host, event = x.detach().to("meta"), None
        elif stream is None:
            # CPU compute: the "host copy" is a copy in the same memory; the
            # code path (copy out, copy back, prefetch order) stays the same.
            host, event = x.detach().clone(), None
        else:
            host = torch.empty_like(x, device="cpu", pin_memory=True)  # x's layout, as the disk keeps it
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                host.copy_(x.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            # The device tensor must outlive the async copy.
            x.record_stream(stream)
        slot["host"].append((host, event))
        self.offloaded_bytes += x.numel() * x.element_size()

    def offload(self, x: Tensor) -> int:
        """Start copying ``x`` to host memory; return a handle."""
        if self._slots and self.held == 0:
            # The previous step's backward consumed every slot: a new step.
            self._slots.clear()
            self.offloaded_bytes = 0
        if not self._slots:
            self._chunked_at_start = chunked_calls()
            if self.disk is not None:
                # The first block input sizes the staging area's chunks; a step needs one per block at least.
                nbytes = x.numel() * x.element_size()
                self.disk.new_step(nbytes, max(1, self.blocks) * nbytes)
        slot: dict = {"device": x.device, "host": []}
        self._copy_out(slot, x)
        self._slots.append(slot)
        return len(self._slots) - 1

    def add(self, handle: int, tensors: list[Tensor]) -> None:
        """Start copying ``tensors`` (on the block input's device) to host memory with
        the block input of ``handle``; :meth:`fetch_all` returns them after it."""
        slot = self._slots[handle]
        if self.disk is not None:  # a layer's worth is known now: the staging area holds STAGING_LAYERS of them
            self.disk.reserve(sum(r.nbytes for r, _ in slot["host"]) + sum(t.numel() * t.element_size()
                                                                           for t in tensors))
        for t in tensors:
            if t.device != slot["device"]:
                raise RuntimeError(f"a kept tensor on {t.device} beside a block input on {slot['device']}")
            self._copy_out(slot, t)

    def release(self, handle: int) -> None:
        """Drop a host copy that no backward will fetch (nothing in the block needed grad)."""
        slot = self._slots[handle]
        slot.pop("host", None)
        slot.pop("device_copy", None)
        slot.pop("pending", None)

    @in_region("offload.copy_in")
    def _start_fetch(self, handle: int) -> None:
        slot = self._slots[handle]
        if "device_copy" in slot or "pending" in slot or "host" not in slot:
            return
        device = slot["device"]
        if self.disk is not None:
            real = slot["real"]
            stream = self._side_stream(device) if real else None
            slot["pending"] = [self.disk.get(record, device, stream, io=real) for record, _ in slot["host"]]
            return
        stream = self._side_stream(device)
        if self.host_device.type == "meta":
            slot["device_copy"] = [h.to(device) for h, _ in slot["host"]]
            return
        if stream is None:
            slot["device_copy"] = [h for h, _ in slot["host"]]
            return
        with torch.cuda.stream(stream):
            copies = []
            for host, event in slot["host"]:
                stream.wait_event(event)
                copies.append(host.to(device, non_blocking=True))
            slot["device_copy"] = copies
            slot["ready"] = torch.cuda.Event()
            slot["ready"].record(stream)

    def fetch_all(self, handle: int) -> list[Tensor]:
        """The block input and what :meth:`add` put beside it, on their device; the
        previous block's start coming back."""
        self._start_fetch(handle)
        slot = self._slots[handle]
        ready = [slot.pop("ready")] if "ready" in slot else []
        if "pending" in slot:
            reads = [self.disk.wait(p) for p in slot.pop("pending")]
            slot["device_copy"] = [t for t, _ in reads]
            ready = [event for _, event in reads if event is not None]
        if "device_copy" not in slot:
            raise RuntimeError(
                f"block input {handle} was fetched twice or released: a checkpointed block's "
                "backward ran twice (retain_graph=True is not supported with offload_activations)"
            )
        if ready:
            current = torch.cuda.current_stream(slot["device"])
            for event in ready:
                current.wait_event(event)
            for t in slot["device_copy"]:
                t.record_stream(current)
        if handle > 0:
            if chunked_calls() != self._chunked_at_start:
                # Past this block's attention backward (its peak), not before it.
                after_chunked_backward(self, functools.partial(self._start_fetch, handle - 1))
            else:
                self._start_fetch(handle - 1)
        out = slot.pop("device_copy")
        slot.pop("host", None)
        return out

    def fetch(self, handle: int) -> Tensor:
        """Return the block input on its device, and prefetch the previous block's."""
        return self.fetch_all(handle)[0]


class _BlockInput:
    """What the checkpointed function reads as the block input: the tensor itself
    the first time (forward), the host copy brought back every later time (the
    recomputation in backward). Holding no reference after forward is what lets
    the device tensor go. With ``save_attention`` it also brings back the
    attention outputs the checkpoint kept, into the checkpoint's storage."""

    def __init__(self, x: Tensor, handle: int, offloader: HostOffloader):
        self._x, self._handle, self._offloader = x, handle, offloader
        # The recomputation must save what forward saved, which depends on it.
        self._requires_grad = x.requires_grad
        self._fetched: Tensor | None = None
        self.kept: KeptOutputs | None = None  # set after forward with save_attention

    def fetch(self) -> None:
        """Bring the block input (and the kept outputs) back from the host."""
        if self._fetched is None:
            x, *kept = self._offloader.fetch_all(self._handle)
            if self.kept is not None:
                self.kept.put_back(kept)
            self._fetched = x.detach().requires_grad_(self._requires_grad)

    def get(self) -> Tensor:
        if self._x is not None:
            x, self._x = self._x, None
            return x
        self.fetch()
        x, self._fetched = self._fetched, None
        return x


class _FetchFirst:
    """The recompute context of a checkpoint that keeps attention outputs: the host
    copies come back BEFORE torch's recompute mode is entered, for that mode would
    take the copies themselves for ops of the block, and reads the kept outputs."""

    def __init__(self, replay, source: _BlockInput):
        self._replay, self._source = replay, source

    def __enter__(self):
        self._source.fetch()
        return self._replay.__enter__()

    def __exit__(self, *exc):
        return self._replay.__exit__(*exc)


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

    ``keep``: an :class:`~.saved_attention.AttentionKeeping` (``save_attention``):
    the attention kernels' outputs are kept from forward, not recomputed, and
    offloaded with the block input.
    """

    def __init__(self, block: nn.Module, offloader: HostOffloader, preserve_rng_state: bool = False,
                 keep: AttentionKeeping | None = None):
        super().__init__(block)
        self.offloader = offloader
        offloader.blocks += 1
        self.preserve_rng_state = preserve_rng_state
        self.keep = keep

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
        options = {}
        modes: list = []
        kept_before = self.keep.kept if self.keep is not None else 0
        if self.keep is not None:
            def contexts():
                keep_mode, replay = self.keep.contexts()
                modes.append(keep_mode)
                return keep_mode, _FetchFirst(replay, source)

            options["context_fn"] = contexts
        out = checkpoint(_run_block, block, source, *args, use_reentrant=False,
                         preserve_rng_state=self.preserve_rng_state, **options, **kwargs)
        if not any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(out)):
            self.offloader.release(handle)  # no backward will come for it
        elif modes:
            # What the checkpoint kept goes to the host with the block input.
            kept = take_kept_outputs(modes[0].storage)
            if kept.entries != self.keep.kept - kept_before:
                raise RuntimeError(
                    f"save_attention with offload_activations: the checkpoint kept {self.keep.kept - kept_before} "
                    f"attention outputs, of which {kept.entries} were found in its storage: torch "
                    f"{torch.__version__} keeps them in a layout ulysses_dtensor.memory.saved_attention does not "
                    "read. Run without offload_activations, or without save_attention")
            source.kept = kept
            self.offloader.add(handle, kept.hand_over())
        return out
