"""One message per node for an error the ranks stop on, whichever rank exits first.

Under torchrun the agent stops every other worker with SIGTERM as soon as one
exits (it checks every 0.1 s, ``--monitor-interval``). A message that one chosen
rank prints (local rank 0) is lost whenever another rank exits first: 3 launches
of 4 lost the config error that way (issue 47). So the first rank of a node to
reach its error reports it:

* it claims the report by creating a file exclusively (``O_CREAT | O_EXCL``,
  atomic between the processes of one machine); a rank that finds the claim
  taken exits without a word;
* from before its claim until its message is written it holds SIGTERM: a rank
  that lost the claim may exit at once, and the agent's SIGTERM that follows
  must not cut the message short (the process exits right after anyway);
* under torchrun's restarts, a message an earlier attempt printed becomes a
  short note (:func:`~.restarts.shown_in_earlier_attempt`).

Where the claim lives: the torchrun agent's folder of this attempt (the
``attempt_<k>`` above ``TORCHELASTIC_ERROR_FILE``), which the agent makes afresh
for each attempt inside a run folder new to each launch, so no earlier job or
attempt can have left a claim there. One agent per node: one message per node.
Without that folder (one process; other launchers, or torchrun's ``--log-dir
/dev/null``) every rank prints: a message that repeats, never one that is lost.
(A folder keyed by the launching process would be shared by two jobs one shell
starts one after the other: the second job's message would be lost.)

A test hook forces the order in which ranks report (:data:`ORDER_ENV`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from .restarts import max_restarts, restart_attempt, shown_in_earlier_attempt

__all__ = ["CLAIM_FILE", "ORDER_ENV", "message_for_this_attempt", "report_once_per_node"]

CLAIM_FILE = "ulysses_dtensor_report.claim"

# Test hook, to force the order in which the ranks of a node exit. ``late:R``: rank R
# waits until a peer has claimed, then keeps waiting: the peer reports and exits first,
# and torchrun stops R. ``silent:R``: rank R waits until a peer has claimed, then exits
# first without a word; the claimer writes its message only once the agent's SIGTERM
# has reached it. Each wait ends after _HOOK_WAIT_S at most. Under restarts, one order
# per attempt, comma separated (``late:0,late:1``: the first attempt's, then the next's).
ORDER_ENV = "ULYSSES_DTENSOR_TEST_REPORT_ORDER"
_HOOK_WAIT_S = 120.0


def report_once_per_node(kind: str, error: BaseException | str) -> bool:
    """Print ``kind: error`` on stderr if this rank is the first of its node to report
    (always without torchrun); True if it did. ``kind`` ("config error", ...) also
    names the error in the note that replaces a repeat under torchrun's restarts."""
    claim = _claim_path()
    _test_order("before_claim", claim)
    with _sigterm_held() as terminated:
        if claim is not None and not _claim(claim):
            return False
        _test_order("claimed", claim, terminated)
        print(message_for_this_attempt(kind, error), file=sys.stderr, flush=True)
    return True


def message_for_this_attempt(kind: str, error: BaseException | str) -> str:
    """``kind: error``, or under torchrun's restarts, if an earlier attempt of this node
    printed it, a short note saying so (and this one is recorded for the next)."""
    message = f"{kind}: {error}" if kind else str(error)
    if shown_in_earlier_attempt(message):
        return (f"(torchrun restart {restart_attempt()} of {max_restarts()} ended with the same "
                f"{kind or 'error'} as an earlier attempt, shown above)")
    return message


def _claim_path() -> Path | None:
    """The claim file of this node's ranks of this torchrun launch and attempt, or None."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and Path(error_file).parents[1].name.startswith("attempt_"):
        return Path(error_file).parents[1] / CLAIM_FILE
    return None


def _claim(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:  # the folder is gone or read-only: report (a repeat beats a loss)
        return True
    with os.fdopen(fd, "w") as fh:
        fh.write(f"rank {os.environ.get('RANK', 0)} pid {os.getpid()}\n")
    return True


@contextlib.contextmanager
def _sigterm_held():
    """SIGTERM noted, not acted on, for the body (main thread only: elsewhere Python
    cannot take the signal). Yields the list of SIGTERMs received."""
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    except ValueError:  # not the main thread
        yield received
        return
    try:
        yield received
    finally:  # None: a handler not set from Python, which cannot be put back; the default then
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _test_order(point: str, claim: Path | None, terminated: list[int] | None = None) -> None:
    spec = os.environ.get(ORDER_ENV)
    if not spec or claim is None:
        return
    orders = spec.split(",")
    mode, chosen = orders[min(restart_attempt(), len(orders) - 1)].split(":")
    me = int(os.environ.get("RANK", 0)) == int(chosen)
    if point == "before_claim" and me:
        _wait_until(claim.exists)
        if mode == "late":
            _wait_until(lambda: False)
    elif point == "claimed" and not me and mode == "silent":
        _wait_until(lambda: bool(terminated))


def _wait_until(condition) -> None:
    deadline = time.monotonic() + _HOOK_WAIT_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
