"""What the command-line entry points (train, eval) do with an error they can explain.

A bad config, unusable data or a checkpoint that cannot be loaded: exit status
2 and one message per node, no traceback, whichever rank exits first
(:mod:`~ulysses_dtensor.runtime.node_report`: the first rank of a node to reach
the error prints it, the others stay silent). Under torchrun's restarts a
failure that no restart can fix repeats in every attempt: a message an earlier
attempt printed on this node is not printed again, the repeat says so in a few
words. A lost peer rank: status 1 and one line from each rank that saw it, so
that torchrun restarts the job or stops it.

One ``except`` clause per kind of error: a new kind is one clause calling
:func:`_stop` with its label.
"""

from __future__ import annotations

import contextlib
import sys

from ..data import DataError
from ..memory.offload_dir import OffloadDirError
from .checkpoint import CheckpointError
from .config_schema import ConfigError
from ..runtime.lost_peer import PeerLostError
from ..runtime.node_report import message_for_this_attempt, report_once_per_node
from ..runtime.nonfinite import NonFiniteError


@contextlib.contextmanager
def exit_on_known_error():
    """Known failures: one message per node and an exit status, no traceback."""
    try:
        yield
    except ConfigError as e:  # before any process group exists, the same on every rank
        _stop("config error", e)
    except DataError as e:  # rank 0 checked the data and every rank raised its verdict
        _stop("data error", e)
    except CheckpointError as e:  # every rank learnt every rank's verdict
        _stop("checkpoint error", e)
    except OffloadDirError as e:  # memory.offload_dir filled during the run: the last checkpoint stands
        _stop("disk error", e)
    except NonFiniteError as e:
        # Every rank stopped at the same step with the same message. Status 3: the run
        # diverged; a restart from the named checkpoint needs a changed config first.
        _stop("", e, 3)
    except PeerLostError as e:
        # Each rank names its own step and collective: the survivors' lines say where it stopped.
        print(message_for_this_attempt("", e), file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _stop(kind: str, error: Exception, status: int = 2) -> None:
    """Report ``error`` once on this node (the first rank to get here prints) and exit."""
    report_once_per_node(kind, error)
    raise SystemExit(status) from None
