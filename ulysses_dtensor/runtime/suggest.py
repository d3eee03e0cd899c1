""""Did you mean ...?" for the error messages that reject a name."""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["did_you_mean", "unknown_name"]


def did_you_mean(name, choices: Iterable, cutoff: float = 0.6) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices``, else ``""``."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name(what: str, name, choices: Iterable) -> str:
    """``"unknown <what> 'name'; valid: a, b (did you mean 'a'?)"``."""
    choices = [str(c) for c in choices]
    return f"unknown {what} {name!r}; valid: {', '.join(choices)}{did_you_mean(name, choices)}"
