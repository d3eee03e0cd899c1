"""``python -m ulysses_dtensor.estimate``: see :mod:`ulysses_dtensor.estimate.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
