"""Offloaded activations on a local disk (``offload_dir``), through a bounded staging area.

With ``offload_activations`` and ``offload_dir``, the tensors
:class:`~ulysses_dtensor.memory.offload.HostOffloader` moves out of the device (each
checkpointed block input, and with ``save_attention`` the kept attention outputs) go to
one file in that directory instead of host memory. Host memory then holds only the
staging area: :data:`STAGING_LAYERS` layers' worth of pinned memory (a layer: its input
and the outputs kept beside it), cut into chunks (:func:`staging_chunk`,
:func:`staging_size`), through which every tensor streams chunk by chunk, however large.

* **Forward**: the calling thread copies a tensor's bytes device -> staging chunk (on the
  offloader's side stream on CUDA) and queues the chunk; one I/O thread writes it to the
  file (``os.pwrite``) and frees the chunk. The forward goes on while the disk writes;
  it waits only for a free chunk, when the staging area is full.
* **Backward**: a read is queued when the offloader prefetches a block (one block ahead,
  as for host memory); the I/O thread reads each chunk into staging (``os.preadv``) and
  copies it staging -> device on the side stream. One thread and one queue, in order:
  a read always follows the writes queued before it.
* **The file**: opened with ``O_TMPFILE`` (no name at all; else created and unlinked at
  once), so it is gone when the process ends on any path, SIGKILL included. Each step
  writes from offset 0 again: the file's size is one step's offloaded bytes.
* **Refusals**: the directory is checked (exists, is a directory, a file can be made
  there, enough free space by ``os.statvfs``) before the first byte is written; a disk
  that fills during the run (``ENOSPC``) stops it. Both raise :class:`OffloadDirError`,
  one message naming the setting, the bytes needed and the bytes free.

Nothing here touches the disk until the first real tensor is written: the memory
planner builds the same offloader and traces with fake tensors or ``host_device="meta"``,
which only count bytes (:attr:`DiskStore.disk_bytes`, :attr:`DiskStore.staging_bytes`).
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .offload_dir import OffloadDirError, check_offload_dir, free_bytes, open_unlinked, space_message

__all__ = ["CHUNK_BYTES", "STAGING_LAYERS", "DiskStore", "staging_chunk", "staging_size"]

# Layers' worth of staging (a layer: its input and the outputs kept beside it): one being
# written while the next layer's forward copies out another (in backward: one read ahead
# while the other is copied in). The planner's rule too (ulysses_dtensor/estimate/disk.py).
STAGING_LAYERS = 2
# The largest chunk (one pwrite / preadv and one copy each): small enough that the copy
# of one chunk overlaps the I/O of the previous, large enough that syscalls are few.
CHUNK_BYTES = 64 << 20
_MIN_CHUNKS = 4


def staging_chunk(input_bytes: int) -> int:
    """The staging area's chunk, from the first block input: a power of two of at least 64
    bytes, at most :data:`CHUNK_BYTES`, about 4 chunks to :data:`STAGING_LAYERS` block
    inputs. (Powers of two: CUDA's pinned allocator rounds a size up to one.)"""
    per_chunk = -(-STAGING_LAYERS * max(1, input_bytes) // _MIN_CHUNKS)
    return min(CHUNK_BYTES, max(64, 1 << (per_chunk - 1).bit_length()))


def staging_size(layer_bytes: int, chunk: int) -> int:
    """Bytes of a staging area of :data:`STAGING_LAYERS` layers of ``layer_bytes`` (a block
    input and what is kept beside it), in whole chunks."""
    return chunk * -(-STAGING_LAYERS * layer_bytes // chunk)


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory (any dimension order)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _bytes_of(t: Tensor) -> Tensor:
    """The memory of a dense tensor as flat bytes, in memory order (its layout kept)."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


@dataclass
class DiskRecord:
    """Where one tensor is in the file, and what it was."""

    offset: int
    nbytes: int
    shape: torch.Size
    stride: tuple
    dtype: torch.dtype


@dataclass
class PendingRead:
    """A read under way: ``tensor`` is filled once ``done`` is set; ``event`` (CUDA) marks
    its last copy on the side stream."""

    tensor: Tensor
    done: threading.Event = field(default_factory=threading.Event)
    event: object = None


class _Staging:
    """The staging area: chunks of ``chunk`` bytes of (pinned) host memory, added in groups
    (one allocation each) as a larger layer asks for more; never fewer."""

    def __init__(self, chunk: int, pinned: bool):
        self.chunk, self.pinned = chunk, pinned
        self.tensors: list[Tensor] = []
        self.arrays: list = []  # the same memory as numpy arrays, for os.pwrite / os.preadv
        self.events: list = []  # a copy still reading the chunk (CUDA)
        self.free: list[int] = []
        self.allocated = 0  # bytes

    def grow(self, count: int) -> None:
        while count:
            # Groups of a power of two of chunks: each allocation a power of two, none rounded up.
            group_count = 1 << (count.bit_length() - 1)
            group = torch.empty(group_count * self.chunk, dtype=torch.uint8, pin_memory=self.pinned)
            array = group.numpy()
            for j in range(group_count):
                self.free.append(len(self.tensors))
                self.tensors.append(group[j * self.chunk:(j + 1) * self.chunk])
                self.arrays.append(array[j * self.chunk:(j + 1) * self.chunk])
                self.events.append(None)
            self.allocated += group_count * self.chunk
            count -= group_count

    def tensor(self, i: int, n: int) -> Tensor:
        return self.tensors[i][:n]

    def array_view(self, i: int, n: int):
        return self.arrays[i][:n]


class _IO:
    """The I/O thread and what it shares with the calling thread: the file, the staging
    area's free chunks, the queue, the first error. Holds no reference to the
    :class:`DiskStore`, so that the store's collection can stop it."""

    def __init__(self, fd: int, staging: _Staging):
        self.fd = fd
        self.staging = staging
        self.cv = threading.Condition()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0  # jobs not finished
        self.reads = 0  # reads among them
        self.error: BaseException | None = None
        self.in_use = 0  # staging bytes held by chunks now
        self.peak = 0  # the most staging bytes ever held at once
        self.written = self.read = 0  # bytes, in total
        self.thread = threading.Thread(target=self._run, name="ulysses-offload-io", daemon=True)
        self.thread.start()

    # -- the staging area's chunks (either thread) -------------------------------------
    def acquire(self) -> int:
        with self.cv:
            while not self.staging.free and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise _Failed()
            i = self.staging.free.pop()
            self.in_use += self.staging.chunk
            self.peak = max(self.peak, self.in_use)
            event, self.staging.events[i] = self.staging.events[i], None
        if event is not None:
            event.synchronize()  # the last copy out of this chunk is done
        return i

    def release(self, i: int, event=None) -> None:
        with self.cv:
            self.staging.free.append(i)
            self.staging.events[i] = event
            self.in_use -= self.staging.chunk
            self.cv.notify_all()

    def grow(self, nbytes: int) -> None:
        """Add chunks until the staging area holds ``nbytes``."""
        with self.cv:
            missing = -(-(nbytes - self.staging.allocated) // self.staging.chunk)
            if missing > 0:
                self.staging.grow(missing)
                self.cv.notify_all()

    def submit(self, job) -> None:
        with self.cv:
            self.queued += 1
            self.reads += isinstance(job, _Read)
        self.jobs.put(job)

    def drain(self, reads_only: bool = False) -> None:
        """Wait until every queued job (or every read) is done."""
        with self.cv:
            while self.reads if reads_only else self.queued:
                self.cv.wait()

    def stop(self) -> None:
        """End the thread after the queued jobs; it closes the file."""
        self.jobs.put(None)

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                os.close(self.fd)
                return
            try:
                job(self)
            except _Failed:
                pass  # an earlier job failed: this one only gave its chunks back
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                with self.cv:
                    if self.error is None:
                        self.error = e
            finally:
                with self.cv:
                    self.queued -= 1
                    self.reads -= isinstance(job, _Read)
                    self.cv.notify_all()

    def pwrite(self, data, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n
            self.written += n

    def preadv(self, data, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.preadv(self.fd, [view], offset)
            if n == 0:
                raise OSError(errno.EIO, f"offload file ends at byte {offset}, before the data written there")
            view, offset = view[n:], offset + n
            self.read += n


class _Failed(Exception):
    """Raised in either thread once the I/O thread has failed (the error is in ``_IO.error``)."""


@dataclass
class _Write:
    chunk: int
    nbytes: int
    offset: int
    event: object  # the device -> staging copy (CUDA), None once done

    def __call__(self, io: _IO) -> None:
        try:
            if io.error is not None:
                raise _Failed()
            if self.event is not None:
                self.event.synchronize()
            io.pwrite(io.staging.array_view(self.chunk, self.nbytes), self.offset)
        finally:
            io.release(self.chunk)


@dataclass
class _Read:
    record: DiskRecord
    target: Tensor  # the destination's bytes
    stream: object
    pending: PendingRead

    def __call__(self, io: _IO) -> None:
        try:
            chunk = io.staging.chunk
            for a in range(0, self.record.nbytes, chunk):
                n = min(chunk, self.record.nbytes - a)
                i = io.acquire()
                event = None
                try:
                    io.preadv(io.staging.array_view(i, n), self.record.offset + a)
                    src, dst = io.staging.tensor(i, n), self.target[a:a + n]
                    if self.stream is None:
                        dst.copy_(src)
                    else:
                        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
                            dst.copy_(src, non_blocking=True)
                            event = torch.cuda.Event()
                            event.record(self.stream)
                        self.pending.event = event
                finally:
                    io.release(i, event)
        finally:
            self.pending.done.set()


class DiskStore:
    """One file in ``directory`` holding a step's offloaded tensors, and its staging area.

    ``staging_bytes``: the staging area's size (None: :data:`STAGING_LAYERS` layers of
    the largest seen, a layer being a block input and what :meth:`reserve` adds beside
    it). ``key``: the setting's name in messages (the trainer sets ``memory.offload_dir``).

    What the memory planner reads (exact after a traced step, real or fake):
    :attr:`staging_bytes` (host memory of the staging area) and :attr:`disk_bytes`
    (bytes on disk: the largest step's offloaded bytes).
    """

    def __init__(self, directory: str, staging_bytes: int | None = None, key: str = "offload_dir"):
        self.directory = str(directory)
        self.key = key
        self._fixed = staging_bytes is not None
        self._chunk = self._size = 0
        if staging_bytes is not None:
            self._chunk = 1 << (max(1, min(CHUNK_BYTES, staging_bytes // _MIN_CHUNKS)).bit_length() - 1)
            self._size = self._chunk * (staging_bytes // self._chunk)
        self.disk_bytes = 0
        self._offset = 0  # where the step's next tensor goes
        self._expected = 0  # bytes a step needs, as far as known (the check before the first write)
        self._io: _IO | None = None
        self._closer = None

    # -- what the planner and the banner read ---------------------------------------------
    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging area (what it holds once real tensors came; planned the
        same way for fake ones)."""
        return self._size

    @property
    def staging_peak_bytes(self) -> int:
        """The most staging bytes ever held at once (0 before the first write)."""
        return self._io.peak if self._io is not None else 0

    @property
    def bytes_written(self) -> int:
        return self._io.written if self._io is not None else 0

    @property
    def bytes_read(self) -> int:
        return self._io.read if self._io is not None else 0

    # -- steps ----------------------------------------------------------------------------
    def new_step(self, input_bytes: int, expected_bytes: int) -> None:
        """A step's first tensor comes next: write from offset 0 again. ``input_bytes``: its
        first block input (the staging area's chunk, and a first size); ``expected_bytes``:
        what the step needs at least (the free-space check before the first write)."""
        self._raise_error()
        self._offset = 0
        self._expected = max(self._expected, expected_bytes)
        if not self._chunk:
            self._chunk = staging_chunk(input_bytes)
        self.reserve(input_bytes)

    def reserve(self, layer_bytes: int) -> None:
        """Make the staging area :data:`STAGING_LAYERS` layers of ``layer_bytes`` at least
        (a layer's input with what is kept beside it, known once its forward ran)."""
        if self._fixed:
            return
        self._size = max(self._size, staging_size(layer_bytes, self._chunk))
        if self._io is not None:
            self._io.grow(self._size)

    def put(self, x: Tensor, stream=None, io: bool = True) -> DiskRecord:
        """Start writing ``x`` to the file; return where it goes. ``stream``: the CUDA side
        stream of the copy out (None on CPU). ``io=False`` (the planner's fake or meta
        tensors): count the bytes, touch nothing."""
        x = x.detach()
        if not _dense(x):
            x = x.contiguous()
        n = x.numel() * x.element_size()
        record = DiskRecord(self._offset, n, x.shape, x.stride(), x.dtype)
        self._offset += n
        self.disk_bytes = max(self.disk_bytes, self._offset)
        if not self._chunk:  # a store used before new_step
            self.new_step(n, n)
        if not io or n == 0:
            return record
        self._open(x.is_cuda)
        # A read still queued (a prefetch no backward used) would wait for chunks that only
        # the writes queued behind it free: let it finish first.
        self._io.drain(reads_only=True)
        self._raise_error()
        flat = _bytes_of(x)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(x.device))
        chunk = self._chunk
        try:
            for a in range(0, n, chunk):
                m = min(chunk, n - a)
                i = self._io.acquire()  # waits while the staging area is full
                dst, event = self._io.staging.tensor(i, m), None
                if stream is None:
                    dst.copy_(flat[a:a + m])
                else:
                    with torch.cuda.stream(stream):
                        dst.copy_(flat[a:a + m], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(stream)
                self._io.submit(_Write(i, m, record.offset + a, event))
        except _Failed:
            self._raise_error()
        if stream is not None:
            x.record_stream(stream)  # the device memory outlives the asynchronous copies
        return record

    def get(self, record: DiskRecord, device: torch.device, stream=None, io: bool = True) -> PendingRead:
        """Start reading ``record`` back into a new tensor on ``device`` (allocated on
        ``stream``, the side stream, on CUDA)."""
        if stream is not None:
            with torch.cuda.stream(stream):
                out = torch.empty_strided(record.shape, record.stride, dtype=record.dtype, device=device)
        else:
            out = torch.empty_strided(record.shape, record.stride, dtype=record.dtype, device=device)
        pending = PendingRead(out)
        if not io or record.nbytes == 0:
            pending.done.set()
            return pending
        self._raise_error()
        self._io.submit(_Read(record, _bytes_of(out), stream, pending))
        return pending

    def wait(self, pending: PendingRead) -> tuple[Tensor, object]:
        """The tensor of a read, once its bytes are in (on CUDA: once its copies are queued;
        the returned event marks their end)."""
        pending.done.wait()
        self._raise_error()
        return pending.tensor, pending.event

    def sync(self, fsync: bool = True, drop_cache: bool = False) -> None:
        """Wait for the queued writes; with ``fsync`` until they are on the disk; with
        ``drop_cache`` also ask the kernel to drop the file's cached pages, so that the next
        reads come from the disk. (For measuring the disk: a step needs none of it.)"""
        if self._io is None:
            return
        self._io.drain()
        self._raise_error()
        if not fsync:
            return
        os.fsync(self._io.fd)
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._io.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Stop the I/O thread once its queue is done; the file goes with its descriptor."""
        if self._closer is not None:
            self._closer()

    # -- inside -----------------------------------------------------------------------------
    def _open(self, pinned: bool) -> None:
        if self._io is not None:
            return
        check_offload_dir(self.directory, self._expected, self.key)
        fd = open_unlinked(self.directory)
        self._io = _IO(fd, _Staging(self._chunk, pinned and torch.cuda.is_available()))
        self._io.grow(self._size)
        # The thread holds only _IO: collecting the store (the model) ends it and closes the file.
        self._closer = weakref.finalize(self, _IO.stop, self._io)

    def _raise_error(self) -> None:
        error = self._io.error if self._io is not None else None
        if error is None:
            return
        if isinstance(error, OSError):
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                problem = "the disk filled during the run (No space left on device)"
            else:
                problem = f"reading or writing the offload file failed ({error.strerror or error})"
            try:
                free = free_bytes(self.directory)
            except OSError:
                free = None
            raise OffloadDirError(space_message(self.key, self.directory, problem,
                                                max(self._expected, self.disk_bytes), free)) from error
        raise RuntimeError(f"{self.key}={self.directory!r}: the offload I/O thread failed: {error!r}") from error
