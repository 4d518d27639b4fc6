"""What the runbook's own pages use beyond the public API: claims, history, GPU evidence,
accelerator sections and the tables that compare them.

These renderers exist to build the site; `import runbook` holds the tools for your own
code. They are tested like the rest, but their output may change with the site.

Each case's page has its own module here, ``runbook.site.<case>``: the write-up's claims
and the experiments its page shows. It imports the case (``runbook.cases.<case>``, what a
reader copies); the case never imports it.
"""

from __future__ import annotations

from .._runtime import agreement
from ._accelerator import (
    accelerator_report,
    available_targets,
    buffer_contrast,
    case_table,
    claims_by_target,
    claims_matrix,
    devices_table,
    devices_to_fit,
    fit,
    fusion_table,
    memory_table,
    on_targets,
    recommended,
    target_summary,
    target_table,
    worst_point,
)
from ._claims import Claim, claims_table, verdict
from ._diagnose_cases import case_diagnosis_table, detector_table, diagnose_case
from ._gpu_evidence import (
    GpuRecord,
    gpu_evidence,
    gpu_report,
    gpu_summary,
    gpu_table,
    per_device_note,
)
from ._history import (
    History,
    Note,
    ReleaseFigures,
    claims_by_release,
    history,
    load_versions,
    matrix_time,
    releases_table,
    slowest,
    versions_report,
)
from ._pages import bench_report, compare_variants, fix_table, verify_table, ynn_accounting
from ._timelines import CaseTimelines, case_timelines, timeline_figure

__all__ = [
    "CaseTimelines",
    "Claim",
    "GpuRecord",
    "History",
    "Note",
    "ReleaseFigures",
    "accelerator_report",
    "agreement",
    "available_targets",
    "bench_report",
    "buffer_contrast",
    "case_diagnosis_table",
    "case_table",
    "case_timelines",
    "claims_by_release",
    "claims_by_target",
    "claims_matrix",
    "claims_table",
    "compare_variants",
    "detector_table",
    "devices_table",
    "devices_to_fit",
    "diagnose_case",
    "fit",
    "fix_table",
    "fusion_table",
    "gpu_evidence",
    "gpu_report",
    "gpu_summary",
    "gpu_table",
    "history",
    "load_versions",
    "matrix_time",
    "memory_table",
    "on_targets",
    "per_device_note",
    "recommended",
    "releases_table",
    "slowest",
    "target_summary",
    "target_table",
    "timeline_figure",
    "verdict",
    "verify_table",
    "versions_report",
    "worst_point",
    "ynn_accounting",
]
