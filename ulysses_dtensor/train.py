"""Entry point: ``torchrun --nproc_per_node=N -m ulysses_dtensor.train --config FILE [--section.key value ...]``.

Also runs without torchrun, as a single process (world of one). A bad config
or unusable data exits with status 2 and one message on stderr, before any
dump folder or checkpoint folder is created.
"""

from __future__ import annotations

import sys

from .runtime import exit_process
from .trainer.cli import exit_on_user_error
from .trainer.config import config_help, load_config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(config_help())
        return 0
    with exit_on_user_error():
        cfg = load_config(argv)
        from .trainer.loop import train

        train(cfg)
    return 0


if __name__ == "__main__":
    # A finished rank exits without interpreter teardown (see runtime.exit_process).
    exit_process(main())
