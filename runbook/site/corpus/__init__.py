"""An evaluation corpus for `runbook.diagnose`: user-like programs and clean ones.

Programs written differently from the cases' own (pytrees, dicts, nested functions,
`fori_loop` against Python loops, checkpoints in the wrong place, several mechanisms at
once), each drawn from a public report of its mechanism, and clean programs that are
memory-heavy for good reasons. `evaluate()` diagnoses each; `table()` counts per mechanism
what the diagnosis names, misses and raises as a false alarm.
"""

from __future__ import annotations

from ._entry import Entry
from .evaluate import (
    Outcome,
    counts,
    entries,
    evaluate,
    false_alarms,
    get,
    misses,
    program_table,
    table,
)

__all__ = [
    "Entry",
    "Outcome",
    "counts",
    "entries",
    "evaluate",
    "false_alarms",
    "get",
    "misses",
    "program_table",
    "table",
]
