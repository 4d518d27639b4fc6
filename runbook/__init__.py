"""JAX Memory Runbook: measure what a JAX program needs, find why, and check the fix."""

from __future__ import annotations

from ._quiet import plugin_chatter

with plugin_chatter():  # the GPU compiler plugin, if installed, logs its missing GPU here
    import jax  # noqa: F401

from ._buffers import Buffer
from ._case import Case, CaseResult, Variant, case_names, get_case, measure_case, verify
from ._claims import Claim, claims_table
from ._errors import RunbookError, UnknownNameError, WontFitError
from ._gpu_evidence import (
    GpuRecord,
    gpu_evidence,
    gpu_report,
    gpu_summary,
    gpu_table,
    per_device_note,
)
from ._history import History, Note, ReleaseFigures, history, load_versions
from ._measure import MemoryReport, compile_fn, largest_buffers, measure, xla_usage_report_total
from ._provenance import Provenance
from ._render import (
    Table,
    buffer_table,
    fmt_bytes,
    peak_table,
    plot_reports,
    plot_sweep,
    report_table,
)
from ._runtime import RuntimePeak, agreement, runtime_peak

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Case",
    "CaseResult",
    "Claim",
    "GpuRecord",
    "History",
    "MemoryReport",
    "Note",
    "Provenance",
    "ReleaseFigures",
    "RunbookError",
    "RuntimePeak",
    "Table",
    "UnknownNameError",
    "Variant",
    "WontFitError",
    "__version__",
    "agreement",
    "buffer_table",
    "case_names",
    "claims_table",
    "compile_fn",
    "fmt_bytes",
    "get_case",
    "gpu_evidence",
    "gpu_report",
    "gpu_summary",
    "gpu_table",
    "history",
    "largest_buffers",
    "load_versions",
    "measure",
    "measure_case",
    "peak_table",
    "per_device_note",
    "plot_reports",
    "plot_sweep",
    "report_table",
    "runtime_peak",
    "verify",
    "xla_usage_report_total",
]
