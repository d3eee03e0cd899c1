"""The one error type of unusable training data."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Unusable training data; the message names the file (and line) and what is wrong."""
