"""``python -m ulysses_dtensor.export``: see :func:`ulysses_dtensor.export.main`."""

import sys

from . import main

sys.exit(main())
