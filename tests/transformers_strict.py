"""Load with transformers while failing on any warning it gives.

transformers warns through Python's ``warnings`` and, for most config problems
(a rope it does not like, unknown keys), through its own ``logging`` loggers.
Both count here: ``warnings`` become errors, and a record at WARNING or above
on the ``transformers`` logger fails the block.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

__all__ = ["no_transformers_warnings"]


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def no_transformers_warnings():
    from transformers.utils import logging as hf_logging

    handler = _Collect()
    root = logging.getLogger("transformers")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(min(verbosity, logging.WARNING))  # warnings are emitted
    root.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield handler.messages
    finally:
        root.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert not handler.messages, f"transformers logged warnings: {handler.messages}"
