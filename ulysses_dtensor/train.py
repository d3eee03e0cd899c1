"""Entry point: ``torchrun --nproc_per_node=N -m ulysses_dtensor.train --config FILE [--section.key value ...]``.

Also runs without torchrun, as a single process (world of one). A bad config
or unusable data exits with status 2 and one message on stderr, before any
dump folder or checkpoint folder is created.
"""

from __future__ import annotations

import os
import sys

from .data import DataError
from .runtime import exit_process
from .trainer.config import ConfigError, config_help, load_config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(config_help())
        return 0
    try:
        cfg = load_config(argv)
        from .trainer.loop import train

        train(cfg)
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
    return 0


if __name__ == "__main__":
    # A finished rank exits without interpreter teardown (see runtime.exit_process).
    exit_process(main())
