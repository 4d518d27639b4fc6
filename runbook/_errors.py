"""The one exception family the runbook raises for bad input."""

from __future__ import annotations


class RunbookError(Exception):
    """Base class: a problem the caller can fix (bad name, bad scale, untraceable function)."""


class UnknownNameError(RunbookError, KeyError):
    """A case or variant name that does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class WontFitError(RunbookError):
    """A real execution was refused because the prediction exceeds the memory available."""
