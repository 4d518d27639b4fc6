"""The runbook's own cases as `runbook.diagnose` sees them, and what each detector looks for:
the diagnose page's tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import _cache, _subprocess, _targets
from .._diagnose import Diagnosis, diagnose
from .._render import Table, fmt_bytes


def detector_table() -> Table:
    """What each detector of `runbook.detectors.DETECTORS` looks for, and its thresholds."""
    import sys

    from .._case import case_names
    from ..detectors import DETECTORS

    rows = []
    for detect in DETECTORS:
        module = sys.modules[detect.__module__]
        case = getattr(module, "CASE", None)
        exists = case in case_names()
        rows.append(
            [
                getattr(module, "PATTERN", detect.__module__),
                case if exists else f"{case} (case to come)",
                module.rule() if hasattr(module, "rule") else "",
            ]
        )
    return Table(["finding", "case", "how it is recognised in the compiled program"], rows)


def diagnose_case(
    name: str,
    variant: str | None = None,
    *,
    scale: str = "seed",
    at: Mapping[str, Any] | None = None,
    target: str | None = None,
) -> Diagnosis:
    """Diagnose one program of a case (default: its reproduction at its worst grid point).

    Compiled the way `runbook.measure_case` compiles it (a case that needs more devices
    than this process has runs in a child process with simulated devices), for `target`,
    else for the target whose compiler shows the case (`Case.shown_on`), else here.
    Cached like the pages' measurements (`runbook._cache`): a page that shows it again,
    or the pre-pass before it, reads it back.
    """
    from .._case import _CASES, _needs_child, get_case, measure_case
    from ._accelerator import worst_point

    case = get_case(name)
    t = _targets.resolve(target or case.shown_on)
    chosen = (
        case.variant(variant)
        if variant
        else next(v for v in case.variants if v.role == "reproduction")
    )
    if at is None:
        repro = next(v for v in case.variants if v.role == "reproduction")
        at = worst_point(measure_case(name, scale, variants=[repro.name], target=t))
    point = dict(at)

    def compute() -> dict[str, Any]:
        if t is None and _needs_child(case):
            record: dict[str, Any] = _subprocess.call(
                "runbook.site._diagnose_cases:_diagnosis_record",
                devices=case.devices,
                name=name,
                variant=chosen.name,
                scale=scale,
                at=point,
            )
            return record
        return _diagnosis_record(name, chosen.name, scale, point, t)

    # Cached as a measurement of this machine (the detectors read it), whatever it was
    # compiled for: "compiled_for", not "target", which would make it a compile-only entry.
    request = {"kind": "case-diagnosis", "case": name, "variant": chosen.name, "scale": scale,
               "at": point, "compiled_for": t.name if t else None}  # fmt: skip
    return Diagnosis.from_record(_cache.cached(request, compute, module=_CASES[name]))


def _diagnosis_record(
    name: str,
    variant: str,
    scale: str,
    at: dict[str, Any],
    target: _targets.Target | None = None,
) -> dict[str, Any]:
    """`diagnose` of one program of a case, compiled for `target` (None: here)."""
    from .._case import get_case

    case = get_case(name)
    chosen = case.variant(variant)
    with _targets.compiling_for(target):
        return diagnose(
            chosen.program(at),
            *case.inputs(chosen, case.scale(scale), at, False),
            target=target,
            compiler_options=case.options() if target is None else None,
            name=chosen.name,
        ).to_record()


def case_diagnoses(scale: str = "seed") -> list[tuple[str, str, Diagnosis]]:
    """Every compile-time case's reproduction and recommended fix, diagnosed at the
    reproduction's worst point: ``(case, variant, diagnosis)`` (runtime cases are
    `runbook.watch`'s)."""
    from .._case import case_names, get_case, measure_case
    from ._accelerator import recommended, worst_point

    out = []
    for name in [n for n in case_names() if not get_case(n).runtime]:
        result = measure_case(name, scale)
        at = worst_point(result)
        repro = next(r for r in result.select(role="reproduction", **at))
        fix = recommended(result, at)
        for report in (repro, fix):
            if report is not None:
                out.append(
                    (name, report.name, diagnose_case(name, report.name, scale=scale, at=at))
                )
    return out


def case_diagnosis_table(scale: str = "seed") -> Table:
    """Each case's reproduction and recommended fix as `diagnose` sees them (a site table)."""
    rows, labels = [], []
    for name, variant, d in case_diagnoses(scale):
        labels.append(d.report.provenance.label())
        named = [f for f in d.findings if f.case == name]
        own = max((f.bytes for f in named), default=0)
        others = [f"{f.case or f.pattern} ({d._share(f)})" for f in d.findings if f.case != name]
        rows.append(
            [
                name,
                variant,
                fmt_bytes(d.report.total),
                f"{fmt_bytes(own)} ({own / d.report.total:.0%})" if named else "none",
                ", ".join(others) or "none",
                f"{d.seconds:.1f} s",
            ]
        )
    return Table(
        ["case", "program", "total", "finding of its own case", "other findings", "diagnosed in"],
        rows,
        f"Each case's reproduction and recommended fix at the reproduction's worst point, "
        f"scale {scale!r}. " + "; ".join(dict.fromkeys(labels)) + ".",
    )
