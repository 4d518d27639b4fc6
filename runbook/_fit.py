"""Does a program fit a target? Its bytes per device against the target's usable memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from . import _targets
from ._errors import DoesNotFitError, RunbookError
from ._measure import MemoryReport, measure
from ._render import fmt_bytes


@dataclasses.dataclass(frozen=True)
class Fit:
    """Whether a program fits a target (a device or a slice), per device.

    ``str(fit)`` is one line: ``fits on v5e-16: 3.20 GiB of 15.75 GiB per chip`` or
    ``does not fit on v5e-16: needs 4.10 GiB more per chip``.

    Attributes:
        target: the device or slice compiled for.
        needed: bytes per device the program needs: its report's total or, where the
            target's compiler refused it, what the compiler said it needs.
        usable: bytes a program may use per device (`Target.usable`).
        report: the program's `MemoryReport` (None where the compiler refused it).
        refused: the compiler's refusal (``needed``, ``limit``, ``what``), else None.
    """

    target: _targets.Target
    needed: int
    usable: int
    report: MemoryReport | None = None
    refused: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, report: MemoryReport, target: str | _targets.Target | None = None) -> Fit:
        """The fit of a measured `report` on `target` (default: the one it was compiled for)."""
        name = target or report.provenance.target
        if not name:
            raise RunbookError(
                f"{report.name!r} was measured on this process's backend: give a target"
            )
        t = _targets.get_target(name)
        return cls(t, report.total, t.usable(), report)

    @classmethod
    def refusal(cls, target: _targets.Target, needed: int, limit: int, what: str) -> Fit:
        """The fit of a program `target`'s compiler refused (`DoesNotFitError`'s figures)."""
        refused = {"needed": needed, "limit": limit, "what": what}
        return cls(target, needed, target.usable(), refused=refused)

    @property
    def fits(self) -> bool:
        """Whether the program fits each device's usable memory."""
        return self.refused is None and self.needed <= self.usable

    @property
    def margin(self) -> int:
        """Bytes to spare per device (usable less needed), negative when it does not fit."""
        return self.usable - self.needed

    def __str__(self) -> str:
        t = self.target
        if self.fits:
            return (
                f"fits on {t.name}: {fmt_bytes(self.needed)} of {fmt_bytes(self.usable)} "
                f"per {t.unit}"
            )
        # A refused program needs at least what the compiler named, maybe more.
        more = "at least " if self.refused else ""
        return f"does not fit on {t.name}: needs {more}{fmt_bytes(-self.margin)} more per {t.unit}"

    def sentence(self) -> str:
        """The verdict in a full sentence, with the rule behind the usable memory."""
        t = self.target
        one = f"each {t.unit} of {t.name}" if t.base else f"one {t.label}"
        rule = f"{fmt_bytes(self.usable)} usable ({t.usable_rule()})"
        if self.refused is not None:
            r = self.refused
            return (
                f"Does not fit {one}: its compiler refused the program, needing "
                f"{fmt_bytes(r['needed'])} of {r['what']} where the device allows "
                f"{fmt_bytes(r['limit'])}."
            )
        if self.fits:
            return (
                f"Fits {one}: {fmt_bytes(self.needed)} of {rule}, "
                f"{fmt_bytes(self.margin)} to spare."
            )
        return (
            f"Does not fit {one}: {fmt_bytes(self.needed)} against {rule}, "
            f"{fmt_bytes(-self.margin)} too much."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target.name,
            "devices": self.target.devices,
            "needed": self.needed,
            "usable": self.usable,
            "fits": self.fits,
            "margin": self.margin,
            "refused": dict(self.refused) if self.refused else None,
        }


def fit(
    fn: Callable[..., Any],
    *args: Any,
    target: str | _targets.Target,
    name: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Fit:
    """Compile `fn` for `args` on `target` and say whether it fits, per device.

    For a slice (``"v5e-16"``, ``"h100x8"``), shard the inputs over
    `runbook.slice_mesh(target, ...)` (or a mesh of as many of this process's devices). A
    program the target's compiler refuses as too large is a `Fit` that does not fit, with
    the compiler's figures, not an error.

    Args:
        fn, args, name, compiler_options: as `runbook.measure` takes them.
        target: the device or slice (see `runbook.get_target`).
    """
    t = _targets.require(target)
    try:
        report = measure(fn, *args, target=t, name=name, compiler_options=compiler_options)
    except DoesNotFitError as e:
        return Fit.refusal(t, e.needed, e.limit, e.what)
    return Fit.of(report, t)
