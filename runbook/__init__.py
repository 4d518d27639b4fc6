"""JAX Memory Runbook: measure what a JAX program needs, find why, and check the fix.

The tools for your own code live here; the renderers the site's pages use are in
`runbook.site`.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import warnings as _warnings

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
