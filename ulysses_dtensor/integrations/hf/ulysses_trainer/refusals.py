"""``UlyssesTrainerError``: what UlyssesHFTrainer cannot run with, said once per node.

Its refusals of arguments, a model whose weights differ between ranks, a batch
it cannot split, a checkpoint it cannot resume from: each is a
:class:`UlyssesTrainerError` (a ``ValueError``) whose message names the value
and what would run. The script that meets one is the user's, with its own
``main``; uncaught, Python would print a traceback on every rank (a wall of
them under ``torchrun --nproc_per_node=8``), and torchrun stops the slower ranks
before theirs is written. So the first such error a process creates installs a
``sys.excepthook``: when the error ends the script, the first rank of the node
prints ``UlyssesHFTrainer error: <message>`` and the others nothing
(:func:`~ulysses_dtensor.runtime.node_report.report_once_per_node`); the exit
status stays Python's 1. A run stopped for non-finite steps
(:class:`~ulysses_dtensor.runtime.nonfinite.NonFiniteError`) is reported the same
way, its message unprefixed; a library version it cannot run with
(:class:`~ulysses_dtensor.integrations.versions.UntestedVersionError`) like a refusal.
Any other exception goes to the hook that was there before; an error the script
catches is the script's.
"""

from __future__ import annotations

import sys

from ulysses_dtensor.runtime.node_report import report_once_per_node
from ulysses_dtensor.runtime.nonfinite import NonFiniteError

from ...versions import UntestedVersionError

__all__ = ["UlyssesTrainerError", "install_report_hook"]

KIND = "UlyssesHFTrainer error"


class UlyssesTrainerError(ValueError):
    """A setting, model, batch or checkpoint UlyssesHFTrainer cannot run with (see the module doc)."""

    def __init__(self, *args):
        super().__init__(*args)
        install_report_hook()


_previous_hook = None


def install_report_hook() -> None:
    """Report an uncaught UlyssesTrainerError, UntestedVersionError or NonFiniteError once per
    node (idempotent)."""
    global _previous_hook
    if _previous_hook is None:
        _previous_hook, sys.excepthook = sys.excepthook, _report_hook


def _report_hook(exc_type, exc, tb) -> None:
    if isinstance(exc, (UlyssesTrainerError, UntestedVersionError)):
        report_once_per_node(KIND, exc)
    elif isinstance(exc, NonFiniteError):
        report_once_per_node("", exc)
    else:
        _previous_hook(exc_type, exc, tb)
