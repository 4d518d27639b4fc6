"""JAX Memory Runbook: measure what a JAX program needs, find why, and check the fix."""

from __future__ import annotations

from ._buffers import Buffer
from ._case import Case, CaseResult, Variant, case_names, get_case, measure_case, verify
from ._errors import RunbookError, UnknownNameError, WontFitError
from ._measure import MemoryReport, compile_fn, largest_buffers, measure
from ._provenance import Provenance
from ._runtime import RuntimePeak, runtime_peak

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Case",
    "CaseResult",
    "MemoryReport",
    "Provenance",
    "RunbookError",
    "RuntimePeak",
    "UnknownNameError",
    "Variant",
    "WontFitError",
    "__version__",
    "case_names",
    "compile_fn",
    "get_case",
    "largest_buffers",
    "measure",
    "measure_case",
    "runtime_peak",
    "verify",
]
