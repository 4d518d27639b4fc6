"""Reading and showing the GPU evidence that ``nox -s gpu`` committed (docs/_data/gpu/*.json)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from .._case import CaseResult, get_case, measure_case
from .._render import Table, fmt_bytes
from ._history import DATA_DIR, Note

HOW_TO_RECORD = (
    "To record it, run `nox -s gpu` on a machine whose Python has a CUDA build of JAX "
    '(`pip install "jax[cuda12]"`) and commit the file it writes to `docs/_data/gpu/`.'
)


@dataclasses.dataclass(frozen=True)
class GpuRecord:
    """One GPU's measurements of one case.

    Attributes:
        scale: the scale run for real (None when none fits), chosen from the prediction.
        compile_time: per scale, the compile-time analysis on the GPU backend (CLI shape).
        runtime: per program: predicted and measured peak bytes per device, or a status.
    """

    case: str
    device_kind: str
    devices_present: int
    devices_needed: int
    bytes_limit: int
    driver: str
    platform_version: str
    jax: str
    jaxlib: str
    generated: str
    scale: str | None
    scale_reason: str
    compile_time: Mapping[str, Any]
    runtime: Sequence[Mapping[str, Any]]

    def label(self) -> str:
        """Device, driver and versions, for captions."""
        driver = f", driver {self.driver}" if self.driver else ""
        runtime = f", {self.platform_version}" if self.platform_version else ""
        return (
            f"{self.device_kind} x{self.devices_present}{driver}{runtime}, "
            f"jax {self.jax} / jaxlib {self.jaxlib}, measured {self.generated}"
        )


def gpu_evidence(
    case: str, *, data_dir: str | pathlib.Path | None = None
) -> list[GpuRecord] | None:
    """The GPU measurements recorded for `case`, one per device kind; None if none recorded.

    Args:
        case: a case name (see `case_names()`).
        data_dir: the folder holding ``gpu/``; defaults to the project's ``docs/_data``.
    """
    get_case(case)  # a bad name is an error, not "no evidence"
    records = []
    for path in sorted((pathlib.Path(data_dir or DATA_DIR) / "gpu").glob("*.json")):
        data = json.loads(path.read_text())
        found = data["cases"].get(case)
        if found is None:
            continue
        records.append(
            GpuRecord(
                case,
                data["device_kind"],
                found["devices_present"],
                found["devices_needed"],
                data["bytes_limit"],
                data.get("driver", ""),
                data.get("platform_version", ""),
                data["jax"],
                data["jaxlib"],
                data["generated"],
                found["scale"],
                found["scale_reason"],
                found["compile_time"],
                found["runtime"],
            )
        )
    return records or None


def _params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def gpu_table(record: GpuRecord, cpu: CaseResult | None = None) -> Table:
    """Per program at the scale run: GPU prediction, GPU measured peak, and the CPU figure.

    Args:
        record: from `gpu_evidence`.
        cpu: the same case measured on CPU at ``record.scale`` (compile time), for a column.
    """
    rows = []
    for peak in record.runtime:
        cpu_total = "-"
        if cpu is not None:
            found = cpu.select(peak["name"], **peak["params"])
            cpu_total = fmt_bytes(found[0].total) if found else "-"
        if peak["status"] == "ok":
            got = [fmt_bytes(peak["predicted"]), fmt_bytes(peak["measured"]),
                   f"{peak['ratio']:.2f}x", "yes" if peak["agrees"] else "no"]  # fmt: skip
            compiling, inputs = peak.get("compile_peak"), peak.get("inputs_peak")
            if compiling is not None and compiling >= peak["measured"]:
                got[1] += " (reached while compiling)"
            elif inputs is not None and inputs >= peak["measured"]:
                got[1] += " (reached while making the inputs)"
        else:
            got = ["-", f"{peak['status']}: {peak['reason']}", "-", "-"]
        deviceless = peak.get("target_predicted")
        target = f"{fmt_bytes(deviceless)} ({peak['target']})" if deviceless is not None else "-"
        rows.append([peak["name"], peak["role"], _params(peak["params"]), cpu_total, target, *got])
    columns = ["variant", "role", "params", "CPU compile-time", "deviceless target prediction",
               "GPU compile-time", "GPU measured peak", "measured / predicted", "agree"]  # fmt: skip
    caption = (
        f"Bytes per device at scale {record.scale!r}. {record.label()}. {record.scale_reason}."
        " A peak reached while compiling (XLA's autotuner trying kernels) or while making "
        "the inputs came before the run: the run itself held no more than that."
    )
    return Table(columns, rows, caption)


def per_device_note(record: GpuRecord, cpu: CaseResult | None = None) -> Note:
    """What a run on fewer devices than the case needs says about the full device count.

    Args:
        record: from `gpu_evidence`.
        cpu: the case on CPU at ``record.scale`` with all its devices: a one-device program
            whose CPU total equals a multi-device variant's is that variant's per-device
            program, so its GPU peak is what each of those devices holds.
    """
    if record.devices_present >= record.devices_needed:
        return Note("")
    case, n = get_case(record.case), record.devices_needed
    lines = [
        (
            f"This GPU run had {record.devices_present} device(s) and `{record.case}` needs "
            f"{n}, so only its one-device programs ran."
        )
    ]
    for peak in (p for p in record.runtime if p["status"] == "ok"):
        same = []
        if cpu is not None:
            mine = cpu.select(peak["name"], **peak["params"])
            same = [
                r.name for r in cpu.select(**peak["params"])
                if mine and r.name != peak["name"] and r.total == mine[0].total
            ]  # fmt: skip
        lines.append(
            f"`{peak['name']}` ({case.variant(peak['name']).summary}; {_params(peak['params'])}) "
            f"peaked at {fmt_bytes(peak['measured'])}."
        )
        if same:
            lines.append(
                f"On CPU it compiles to the same bytes per device as {', '.join(same)}: each of "
                f"their {n} devices would hold about {fmt_bytes(peak['measured'])}, "
                f"{fmt_bytes(n * peak['measured'])} in all."
            )
    return Note(" ".join(lines))


def gpu_summary(case: str, *, data_dir: str | pathlib.Path | None = None) -> Note:
    """One sentence for a case page: which GPUs were measured, or that none has been yet."""
    records = gpu_evidence(case, data_dir=data_dir)
    if not records:
        return Note(f"No GPU evidence has been recorded yet for `{case}`. {HOW_TO_RECORD}")
    kinds = "; ".join(r.label() for r in records)
    return Note(f"GPU evidence for `{case}` recorded on: {kinds}.")


def gpu_report(case: str, *, data_dir: str | pathlib.Path | None = None) -> list[Note | Table]:
    """Everything a case page shows about the GPU, in order, for ``display()`` one by one.

    The summary sentence; then per GPU recorded, its table beside the CPU compile-time
    figures at the same scale (measured now) and, where it had too few devices, what one
    device's peak implies for all of them.
    """
    items: list[Note | Table] = [gpu_summary(case, data_dir=data_dir)]
    for record in gpu_evidence(case, data_dir=data_dir) or []:
        cpu = measure_case(case, record.scale) if record.scale else None
        items.append(gpu_table(record, cpu))
        note = per_device_note(record, cpu)
        if note:
            items.append(note)
    return items
