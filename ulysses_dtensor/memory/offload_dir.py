"""The directory of the disk tier (``offload_dir``): checked before the first byte, and
files in it that cannot outlive the process.

Every refusal is one :class:`OffloadDirError` whose message names the setting, what is
wrong, the bytes needed and the bytes free (:func:`space_message`).
"""

from __future__ import annotations

import errno
import os
import tempfile

__all__ = ["OffloadDirError", "check_offload_dir", "free_bytes", "open_unlinked", "space_message"]


class OffloadDirError(OSError):
    """``offload_dir`` cannot hold the offloaded activations: unusable, too little free
    space, or filled during the run. The message names the setting, the bytes needed and
    the bytes free."""


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still use on the file system of ``directory`` (or
    of its nearest existing parent, when it does not exist)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _gib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


def space_message(key: str, directory: str, problem: str, needed: int, free: int | None) -> str:
    """The one message of every refusal: the setting, what is wrong, needed and free bytes."""
    have = f"{_gib(free)} are free" if free is not None else "free space unknown"
    return (f"{key}={directory!r}: {problem}; the offloaded activations need {_gib(needed)} there, {have} "
            f"(leave {key} unset to keep them in host memory)")


def open_unlinked(directory: str) -> int:
    """A read-write file descriptor of a file in ``directory`` that has no name: it is gone
    when the descriptor closes, also when the process is killed."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError) as e:
        # No O_TMPFILE here (file system or platform): a named file, unlinked at once.
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, path = tempfile.mkstemp(dir=directory, prefix=".ulysses_offload_")
    os.unlink(path)
    return fd


def check_offload_dir(directory: str, needed: int, key: str = "offload_dir") -> int | None:
    """Refuse (:class:`OffloadDirError`) a ``directory`` that is missing, not a directory,
    where no file can be made, or with fewer than ``needed`` bytes free; else return the
    free bytes. Makes (and drops) one unlinked file: the real test of writability."""
    free = None
    try:
        free = free_bytes(directory)
    except OSError:
        pass
    problem = None
    if not os.path.exists(directory):
        problem = "no such directory"
    elif not os.path.isdir(directory):
        problem = "not a directory"
    else:
        try:
            os.close(open_unlinked(directory))
        except OSError as e:
            problem = f"cannot create a file there ({e.strerror or e})"
    if problem is None and free is not None and free < needed:
        problem = "too little free space"
    if problem is not None:
        raise OffloadDirError(space_message(key, directory, problem, needed, free))
    return free
