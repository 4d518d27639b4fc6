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


class DoesNotFitError(RunbookError):
    """A target's compiler refused a program too large for one device: a finding, with figures.

    Attributes:
        needed: the bytes the compiler says the program needs (of the kind `what` names).
        limit: the bytes the device allows.
        what: what `needed` counts ("HLO temporaries", or "one buffer" for a single array
            larger than the device).
    """

    def __init__(self, message: str, *, needed: int, limit: int, what: str) -> None:
        super().__init__(message)
        self.needed, self.limit, self.what = needed, limit, what
