"""What the command-line entry points (train, eval) do with an error they can explain.

A bad config, unusable data or a checkpoint that cannot be loaded: exit status
2 and one message, no traceback. A lost peer rank: status 1 and one line from
each rank that saw it, so that torchrun restarts the job or stops it. Under
torchrun's restarts a failure that no restart can fix repeats in every attempt:
a message an earlier attempt printed on this node is not printed again, the
repeat says so in a few words.
"""

from __future__ import annotations

import contextlib
import os
import sys

from ..data import DataError
from .checkpoint import CheckpointError
from .config_schema import ConfigError
from ..runtime.lost_peer import PeerLostError
from ..runtime.nonfinite import NonFiniteError
from ..runtime.restarts import max_restarts, restart_attempt, shown_in_earlier_attempt


@contextlib.contextmanager
def exit_on_known_error():
    """Known failures: one message and an exit status, no traceback."""
    first_rank = os.environ.get("RANK", "0") == "0"
    try:
        yield
    except ConfigError as e:
        # Raised before any process group exists, the same way on every rank of
        # a node (files may differ between nodes): one message per node.
        _report("config error", e, show=os.environ.get("LOCAL_RANK", "0") == "0")
        raise SystemExit(2) from None
    except DataError as e:
        # Rank 0 checked the data and every rank raised its verdict: one message.
        _report("data error", e, show=first_rank)
        raise SystemExit(2) from None
    except CheckpointError as e:
        # Every rank learnt every rank's verdict: one message.
        _report("checkpoint error", e, show=first_rank)
        raise SystemExit(2) from None
    except NonFiniteError as e:
        # Every rank stopped at the same step with the same message: one message, status 3
        # (the run diverged; a restart from the named checkpoint needs a changed config).
        _report("", e, show=first_rank)
        raise SystemExit(3) from None
    except PeerLostError as e:
        # Each rank names its own step and collective: the survivors' lines say where it stopped.
        _report("", e, show=True)
        raise SystemExit(1) from None


def _report(kind: str, error: Exception, *, show: bool) -> None:
    if not show:
        return
    message = f"{kind}: {error}" if kind else str(error)
    if shown_in_earlier_attempt(message):
        message = (f"(torchrun restart {restart_attempt()} of {max_restarts()} ended with the same "
                   f"{kind or 'error'} as an earlier attempt, shown above)")
    print(message, file=sys.stderr, flush=True)
