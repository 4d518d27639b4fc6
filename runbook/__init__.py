"""JAX Memory Runbook: measure what a JAX program needs, find why, and check the fix.

The tools for your own code live here; the renderers the site's pages use are in
`runbook.site`.
"""

from __future__ import annotations

from ._quiet import plugin_chatter

with plugin_chatter():  # the GPU compiler plugin, if installed, logs its missing GPU here
    import jax  # noqa: F401

from ._buffers import Buffer
from ._case import Case, CaseResult, Variant, case_names, get_case, measure_case, verify
from ._diagnose import Diagnosis, Finding, diagnose
from ._errors import DoesNotFitError, RunbookError, UnknownNameError, WontFitError
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
from ._targets import Target, get_target, target_devices, targets

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Case",
    "CaseResult",
    "Diagnosis",
    "DoesNotFitError",
    "Finding",
    "MemoryReport",
    "Provenance",
    "RunbookError",
    "RuntimePeak",
    "Table",
    "Target",
    "UnknownNameError",
    "Variant",
    "WontFitError",
    "__version__",
    "buffer_table",
    "case_names",
    "compile_fn",
    "diagnose",
    "figures_table",
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
    "target_devices",
    "targets",
    "verify",
    "xla_usage_report_total",
]
