"""Entry point: ``torchrun --nproc_per_node=N -m ulysses_dtensor.train --config FILE [--section.key value ...]``.

Also runs without torchrun, as a single process (world of one). A bad config
or unusable data exits with status 2 and one message on stderr, before any
dump folder or checkpoint folder is created; so does a checkpoint that cannot be
loaded. A rank whose peer died or went silent (``[comm]`` timeouts) exits with
status 1 and one line naming the step and the collective, for torchrun to
restart the job (``--max_restarts``; it resumes from the newest complete
checkpoint) or stop it.
"""

from __future__ import annotations

import sys

from .runtime.allocator import apply_allocator_default

# Before torch is imported (it reads the allocator's settings then): expandable segments
# unless PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF is set (runtime/allocator.py).
apply_allocator_default()

from .trainer.known_errors import exit_on_known_error  # noqa: E402
from .runtime.process_group import exit_process  # noqa: E402
from .trainer.config import config_help, load_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(config_help())
        return 0
    with exit_on_known_error():
        cfg = load_config(argv)
        from .trainer.loop import train

        train(cfg)
    return 0


if __name__ == "__main__":
    # A finished rank, or one that reported why it stops, exits without interpreter
    # teardown (see runtime.exit_process; after a lost peer the teardown only adds noise).
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    exit_process(code)
