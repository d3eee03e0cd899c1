"""What the command-line entry points (train, eval) do with a user's mistake."""

from __future__ import annotations

import contextlib
import os
import sys

from ..data import DataError
from .config_schema import ConfigError


@contextlib.contextmanager
def exit_on_user_error():
    """A bad config or unusable data: exit status 2 and one message, no traceback."""
    try:
        yield
    except ConfigError as e:
        # Raised before any process group exists, the same way on every rank of
        # a node (files may differ between nodes): one message per node.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"config error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except DataError as e:
        # Rank 0 checked the data and every rank raised its verdict: one message.
        if os.environ.get("RANK", "0") == "0":
            print(f"data error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
