"""Detectors for `runbook.diagnose`: one module per case, named as its case is.

``runbook/detectors/<case>.py`` reads a compiled `runbook._program.Program` (its buffers,
HLO, shardings and aliasing, never the function's name or source text) for the mechanism of
the case ``<case>`` (dashes for underscores) and returns what it recognises, with
``detect(program) -> list[Finding]``. It also declares ``CASE`` (the case's name), ``PATTERN``
(what it finds, in a phrase) and ``rule()`` (how it decides, with its thresholds); a case with
two signs names both in its one module. Every such module is found from the files: a new
case adds its module here and nothing else.

A detector may also say what it saw and did not name: ``near_miss(program) -> NearMiss |
None`` in its module (collected in `NEAR_MISSES`). `near_misses` asks each of them, so that
a diagnosis that names nothing can still say which case comes closest, and why not.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from types import ModuleType

from .._errors import RunbookError
from .._program import Finding, NearMiss, Program

Detector = Callable[[Program], list[Finding]]
NearMissFn = Callable[[Program], NearMiss | None]


def _modules() -> list[ModuleType]:
    found = []
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if m.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{m.name}")
        if module.CASE.replace("-", "_") != m.name:
            raise RunbookError(f"{module.__name__} detects {module.CASE!r}: name it for its case")
        found.append(module)
    return found


MODULES: tuple[ModuleType, ...] = tuple(_modules())
DETECTORS: tuple[Detector, ...] = tuple(m.detect for m in MODULES)
NEAR_MISSES: dict[Detector, NearMissFn] = {
    m.detect: m.near_miss for m in MODULES if hasattr(m, "near_miss")
}


def near_misses(
    program: Program,
    findings: Iterable[Finding] = (),
    detectors: Iterable[Detector] | None = None,
) -> list[NearMiss]:
    """What `detectors` (default: all) saw of their mechanism without naming it, largest
    first, leaving out the cases `findings` already name."""
    named = {f.case for f in findings if not f.informational}
    found = []
    for detect in DETECTORS if detectors is None else detectors:
        explain = NEAR_MISSES.get(detect)
        miss = explain(program) if explain is not None else None
        if miss is not None and miss.case not in named:
            found.append(miss)
    return sorted(found, key=lambda m: -m.bytes)


__all__ = ["DETECTORS", "MODULES", "NEAR_MISSES", "Detector", "NearMissFn", "near_misses"]
