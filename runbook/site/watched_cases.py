"""`runbook.watch` on the runbook's own runtime cases: each reproduction's loop, and its
recommended fix's, watched in a fresh process (the watch page's table and its test).

A fresh process per loop: the resident-set peak a compile raises, and the compile cache,
start from nothing, as they do in a reader's script.
"""

from __future__ import annotations

import functools
from typing import Any

from .. import _cache, _subprocess
from .._case import case_names, get_case
from .._render import Table
from ._page import page_module

# The runtime cases, with the steps each loop is watched for (past the watch's warm-up): its
# page module's `WATCH_STEPS`.
CASES = {
    name: int(page_module(name).WATCH_STEPS) for name in case_names() if get_case(name).runtime
}


def _watch_json(case: str, variant: str, steps: int) -> dict[str, Any]:
    """In the child: `variant`'s loop of `case` under `runbook.watch`; the watch's summary."""
    import runbook

    page = page_module(case)
    with runbook.watch() as w:
        page.watched_loop(variant, steps, w.step)
    return {
        "cases": w.cases,
        "steps": w.steps,
        "compiles": len(w.compiles),
        "patterns": [f.pattern for f in w.findings],
        "copy": [f.copy for f in w.findings],
    }


def watched(case: str, variant: str) -> dict[str, Any]:
    """`_watch_json` for one loop, in a fresh process, cached like the pages' measurements."""
    steps = CASES[case]
    page = page_module(case).__name__  # the loop's page and case modules
    request = {"kind": "watched-case", "case": case, "variant": variant, "steps": steps,
               "watcher": _cache.module_hash(__name__)}  # fmt: skip
    got: dict[str, Any] = _cache.cached(
        request,
        functools.partial(
            _subprocess.call,
            "runbook.site.watched_cases:_watch_json",
            case=case,
            variant=variant,
            steps=steps,
        ),
        module=page,
    )
    return got


def loops() -> list[dict[str, Any]]:
    """Each runtime case's reproduction and recommended fix, watched: what the watch named."""
    rows = []
    for case in CASES:
        c = get_case(case)
        repro = next(v for v in c.variants if v.role == "reproduction")
        for v in (repro, c.variant(c.recommended or "")):
            rows.append({"case": case, "variant": v.name, "role": v.role, **watched(case, v.name)})
    return rows


def loops_table() -> Table:
    """`loops()` as a table: the case each loop should draw, and what the watch named."""
    from .._provenance import Provenance

    rows = [
        [r["case"], r["variant"], r["role"], str(r["steps"]), str(r["compiles"]),
         ", ".join(r["cases"]) or "no finding", ", ".join(c for c in r["copy"] if c) or "-"]
        for r in loops()
    ]  # fmt: skip
    return Table(
        ["case", "loop", "role", "steps", "compiles", "the watch names", "fix to copy"],
        rows,
        "Each runtime case's reproduction and recommended fix, run by its page module's "
        "watched_loop under runbook.watch() with the default thresholds, each in a fresh "
        f"process. {Provenance.current().label()}.",
    )
