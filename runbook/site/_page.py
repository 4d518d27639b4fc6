"""The page-module protocol: what a case's page module (``runbook/site/<case>.py``) gives the
site, and the one lookup of it.

Every page module has `CasePage`'s ``claims``. A page that quotes public reports beside its
own figures has `CitedPage`'s ``REPORTS`` and ``reports_table``; the page of a case with
real-run figures (``Case.figures``) has `FiguresPage`'s names; the page of a runtime case
(``Case.runtime``, named by `runbook.watch`) has `WatchedPage`'s loop. ``tests/test_layout.py``
checks every case's page against the protocols its case calls for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from .._case import _CASES, get_case
from ._claims import Claim


@runtime_checkable
class CasePage(Protocol):
    """Every page module: the write-up's claims, each decided by a measurement."""

    def claims(self, *args: Any, target: str | None = None, scale: str = "seed") -> list[Claim]:
        """Each claim's verdict on this backend, or compiled for `target` at `scale`; the
        positional arguments are measurements the page already holds (measured when not
        given)."""
        ...


@runtime_checkable
class CitedPage(CasePage, Protocol):
    """A page that quotes what public reports measured, beside its own figures."""

    REPORTS: Mapping[str, str]  # "owner/repo#N" -> what that report saw

    def reports_table(self, *args: Any) -> Any:
        """One row per report of `REPORTS`, in its order, with the figure measured here."""
        ...


@runtime_checkable
class FiguresPage(CitedPage, Protocol):
    """The page of a case whose problem shows in a real run's figures (``Case.figures``)."""

    FIGURES: Mapping[str, str]  # figure name -> what it measures
    KEY_FIGURE: str  # the figure that shows the problem
    RECOMMENDED: str  # the fix the page recommends


@runtime_checkable
class WatchedPage(FiguresPage, Protocol):
    """The page of a runtime case: its loops, run under `runbook.watch`."""

    WATCH_STEPS: int  # steps each loop is watched for, past the watch's warm-up
    watched_loop: Callable[[str, int, Callable[[], None]], None]


def page_module(name: str) -> ModuleType:
    """Case `name`'s page module, ``runbook.site.<case>``: its claims and its page's experiments."""
    get_case(name)  # an unknown name gets the one clear error
    return importlib.import_module(_CASES[name].replace(".cases.", ".site.", 1))


def protocols(name: str) -> list[type]:
    """The protocols case `name`'s page module must satisfy (see the module docstring)."""
    case = get_case(name)
    module = page_module(name)
    found: list[type] = [CasePage]
    if hasattr(module, "REPORTS"):
        found.append(CitedPage)
    if case.figures is not None:
        found.append(FiguresPage)
    if case.runtime:
        found.append(WatchedPage)
    return found
