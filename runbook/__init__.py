"""JAX Memory Runbook: measure what a JAX program needs, find why, and check the fix.

The tools for your own code live here; the renderers the site's pages use are in
`runbook.site`.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import warnings as _warnings
from typing import TYPE_CHECKING

from . import _releases

# An unsupported JAX gets one line here, not a traceback from deep inside JAX (pip keeps
# Python below 3.11 out: requires-python).
try:
    _jax_version = _metadata.version("jax")
except _metadata.PackageNotFoundError:
    raise ImportError("runbook needs jax: `pip install jax-memory-runbook` installs it.") from None
if _why := _releases.too_old(_jax_version):
    raise ImportError(f"runbook: {_why}")
if _why := _releases.too_new(_jax_version):
    _warnings.warn(f"runbook: {_why}", RuntimeWarning, stacklevel=2)

from ._quiet import plugin_chatter

with plugin_chatter():  # the GPU compiler plugin, if installed, logs its missing GPU here
    import jax  # noqa: F401

# The public names load on first use, so that `import runbook.cases.<case>` (the file a
# reader copies from) brings in only the case and `runbook._case_types`, not the measuring core.
_PUBLIC = {
    "Buffer": "_buffers",
    "Case": "_case_types",
    "Variant": "_case_types",
    "CaseResult": "_case",
    "case_names": "_case",
    "get_case": "_case",
    "measure_case": "_case",
    "verify": "_case",
    "Watch": "_watch",
    "watch": "_watch",
    "Diagnosis": "_diagnose",
    "Finding": "_diagnose",
    "diagnose": "_diagnose",
    "Explanation": "_explain",
    "Fit": "_fit",
    "fit": "_fit",
    "explain": "_explain",
    "ChildCrashed": "_subprocess",
    "DoesNotFitError": "_errors",
    "RunbookError": "_errors",
    "UnknownNameError": "_errors",
    "WontFitError": "_errors",
    "MemoryReport": "_measure",
    "compile_fn": "_measure",
    "largest_buffers": "_measure",
    "measure": "_measure",
    "xla_usage_report_total": "_measure",
    "Provenance": "_provenance",
    "Table": "_render",
    "buffer_table": "_render",
    "figures_table": "_render",
    "fmt_bytes": "_render",
    "peak_table": "_render",
    "plot_reports": "_render",
    "plot_sweep": "_render",
    "report_table": "_render",
    "RuntimePeak": "_runtime",
    "runtime_peak": "_runtime",
    "Timeline": "_timeline",
    "timeline": "_timeline",
    "Target": "_targets",
    "get_target": "_targets",
    "slice_mesh": "_targets",
    "target_devices": "_targets",
    "targets": "_targets",
}


def __getattr__(name: str) -> object:
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value  # once: later lookups do not come back here
        return value
    raise AttributeError(f"module 'runbook' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


if TYPE_CHECKING:  # what the names above are, for type checkers and editors
    from ._buffers import Buffer
    from ._case import CaseResult, case_names, get_case, measure_case, verify
    from ._case_types import Case, Variant
    from ._diagnose import Diagnosis, Finding, diagnose
    from ._errors import DoesNotFitError, RunbookError, UnknownNameError, WontFitError
    from ._explain import Explanation, explain
    from ._fit import Fit, fit
    from ._measure import MemoryReport, compile_fn, largest_buffers, measure, xla_usage_report_total
    from ._provenance import Provenance
    from ._render import (
        Table,
        buffer_table,
        figures_table,
        fmt_bytes,
        peak_table,
        plot_reports,
        plot_sweep,
        report_table,
    )
    from ._runtime import RuntimePeak, runtime_peak
    from ._subprocess import ChildCrashed
    from ._targets import Target, get_target, slice_mesh, target_devices, targets
    from ._timeline import Timeline, timeline
    from ._watch import Watch, watch

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Case",
    "CaseResult",
    "ChildCrashed",
    "Diagnosis",
    "DoesNotFitError",
    "Explanation",
    "Finding",
    "Fit",
    "MemoryReport",
    "Provenance",
    "RunbookError",
    "RuntimePeak",
    "Table",
    "Target",
    "Timeline",
    "UnknownNameError",
    "Variant",
    "Watch",
    "WontFitError",
    "__version__",
    "buffer_table",
    "case_names",
    "compile_fn",
    "diagnose",
    "explain",
    "figures_table",
    "fit",
    "fmt_bytes",
    "get_case",
    "get_target",
    "largest_buffers",
    "measure",
    "measure_case",
    "peak_table",
    "plot_reports",
    "plot_sweep",
    "report_table",
    "runtime_peak",
    "slice_mesh",
    "target_devices",
    "targets",
    "timeline",
    "verify",
    "watch",
    "xla_usage_report_total",
]
