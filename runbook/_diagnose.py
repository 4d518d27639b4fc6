"""`runbook.diagnose`: point it at your own function, get the case that explains it and the fix."""

from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import _targets
from ._errors import DoesNotFitError
from ._measure import MemoryReport
from ._program import Finding, Program
from ._render import Table, fmt_bytes

__all__ = ["Diagnosis", "Finding", "diagnose"]


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What a compiled program needs, and the known mechanisms behind it.

    Attributes:
        report: the program's `MemoryReport` (per device, buffers included).
        findings: each mechanism recognised, largest first (see `Finding`).
        target: the device it was compiled for, or None for this process's backend.
        refused: when the target's compiler refused the program as too large, its figures
            (``needed``, ``limit``, ``what``); the findings then come from this process's
            backend.
        seconds: how long the diagnosis took (compilation included).
    """

    report: MemoryReport
    findings: tuple[Finding, ...]
    target: _targets.Target | None = None
    refused: Mapping[str, Any] | None = None
    seconds: float = 0.0

    @property
    def cases(self) -> list[str]:
        """The cases named by the findings that are not only informational, largest first."""
        return list(dict.fromkeys(f.case for f in self.findings if f.case and not f.informational))

    @property
    def usable(self) -> int | None:
        """The target's usable memory per device (None without a target)."""
        return self.target.usable() if self.target else None

    @property
    def fits(self) -> bool | None:
        """Whether the program fits the target's usable memory (None without a target)."""
        if self.target is None:
            return None
        if self.refused is not None:
            return False
        return self.report.total <= self.target.usable()

    @property
    def margin(self) -> int | None:
        """Usable memory minus what the program needs: negative when it does not fit."""
        if self.target is None:
            return None
        needed = self.refused["needed"] if self.refused else self.report.total
        return self.target.usable() - needed

    def fit_line(self) -> str:
        """Whether it fits the target, in one sentence ("" without a target)."""
        t = self.target
        if t is None:
            return ""
        rule = f"{fmt_bytes(t.usable())} usable ({t.usable_rule()})"
        if self.refused is not None:
            r = self.refused
            return (
                f"Does not fit one {t.label}: its compiler refused the program, needing "
                f"{fmt_bytes(r['needed'])} of {r['what']} where the device allows "
                f"{fmt_bytes(r['limit'])}. The findings below come from this machine's "
                f"{self.report.provenance.backend} compiler."
            )
        margin = self.margin or 0
        if self.fits:
            return (
                f"Fits one {t.label}: {fmt_bytes(self.report.total)} of {rule}, "
                f"{fmt_bytes(margin)} to spare."
            )
        return (
            f"Does not fit one {t.label}: {fmt_bytes(self.report.total)} against {rule}, "
            f"{fmt_bytes(-margin)} too much."
        )

    @property
    def constants(self) -> int:
        """Bytes of constants compiled into the program, which XLA's total leaves out."""
        return sum(b.size for b in self.report.buffers if b.kind == "constant")

    def _share(self, f: Finding) -> str:
        """`f`'s bytes against everything the program holds (its total and its constants)."""
        whole = self.report.total + self.constants
        return f"{f.bytes / whole:.0%}" if whole else "-"

    def table(self) -> Table:
        """The findings as a table: pattern, case, bytes, share of the total, fix."""
        rows = [
            [
                f.pattern + (" (informational)" if f.informational else ""),
                f.case or "-",
                fmt_bytes(f.bytes),
                self._share(f),
                fmt_bytes(f.saving) if f.saving is not None else "-",
                f.fix,
            ]
            for f in self.findings
        ]
        return Table(
            ["finding", "case", "bytes", "of total", "measured saving", "fix"],
            rows,
            self._caption(),
        )

    def _caption(self) -> str:
        r = self.report
        return (
            f"{r.name}: {fmt_bytes(r.total)} per device (arguments {fmt_bytes(r.argument)}, "
            f"temporaries {fmt_bytes(r.temp)}, outputs {fmt_bytes(r.output)}"
            + (f", {fmt_bytes(r.alias)} reused" if r.alias else "")
            + ")"
            + (
                f" and {fmt_bytes(self.constants)} of constants, which XLA's total leaves out"
                if self.constants >= 2**20
                else ""
            )
            + f". {r.provenance.label()}; diagnosed in {self.seconds:.1f} s."
        )

    def __str__(self) -> str:
        lines = [f"Diagnosis of {self._caption()}"]
        if self.target is not None:
            lines.append(self.fit_line())
        if not self.findings:
            lines.append("No known mechanism found. The largest buffers:")
            lines += [f"  {_buffer_line(b)}" for b in self.report.buffers[:5]]
            return "\n".join(lines)
        lines.append("Findings, largest first:")
        for n, f in enumerate(self.findings, 1):
            label = f" [{f.case}]" if f.case else ""
            info = " (informational)" if f.informational else ""
            lines.append(
                f"{n}. {f.pattern}{label}{info}: {fmt_bytes(f.bytes)}, {self._share(f)} of what "
                "the program holds"
            )
            lines.append(f"   seen: {f.detail}")
            lines.append(f"   fix:  {f.fix}")
            lines += [f"     {_buffer_line(b)}" for b in f.evidence[:4]]
            if len(f.evidence) > 4:
                lines.append(f"     ... and {len(f.evidence) - 4} more")
        for c in self.report.caveats:
            lines.append(f"Caveat: {c}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        e = html.escape
        parts = [f'<div class="runbook-diagnosis"><p>{e(self._caption())}</p>']
        if self.target is not None:
            parts.append(f"<p><strong>{e(self.fit_line())}</strong></p>")
        if not self.findings:
            parts.append("<p>No known mechanism found.</p></div>")
            return "".join(parts)
        head = "".join(
            f"<th>{c}</th>"
            for c in ("finding", "case", "bytes", "of total", "measured saving", "seen", "fix")
        )
        rows = []
        for f in self.findings:
            case = (
                f'<a href="{e(f.link)}">{e(f.case)}</a>' if f.link and f.case else e(f.case or "-")
            )
            fix = e(f.fix)
            if f.link:
                fix = fix.replace(e(f.link), f'<a href="{e(f.link)}">{e(f.link)}</a>')
            evidence = "".join(
                f"<li><code>{e(_buffer_line(b))}</code></li>" for b in f.evidence[:6]
            )
            pattern = e(f.pattern) + (" <em>(informational)</em>" if f.informational else "")
            saving = fmt_bytes(f.saving) if f.saving is not None else "-"
            rows.append(
                f"<tr><td>{pattern}</td><td>{case}</td><td>{fmt_bytes(f.bytes)}</td>"
                f"<td>{self._share(f)}</td><td>{saving}</td>"
                f"<td>{e(f.detail)}<details><summary>buffers</summary><ul>{evidence}</ul>"
                f"</details></td><td>{fix}</td></tr>"
            )
        parts.append(
            f'<table class="runbook-table"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>"
        )
        return "".join(parts)

    def to_json(self) -> dict[str, Any]:
        """One JSON-able object: the program's bytes, the fit and every finding."""
        p = self.report.provenance
        return {
            "name": self.report.name,
            "backend": p.backend,
            "device_kind": p.device_kind,
            "devices": p.devices,
            "jax": p.jax,
            "jaxlib": p.jaxlib,
            "bytes": self.report.to_json()["bytes"],
            "target": None
            if self.target is None
            else {
                **self.target.to_json(),
                "usable": self.target.usable(),
                "fits": self.fits,
                "margin": self.margin,
                "refused": dict(self.refused) if self.refused else None,
            },
            "cases": self.cases,
            "findings": [f.to_json() for f in self.findings],
            "caveats": list(self.report.caveats),
            "seconds": round(self.seconds, 3),
        }


def _buffer_line(b: Any) -> str:
    return (
        f"{fmt_bytes(b.size):>10}  {b.shape}  {b.kind}  {b.instruction}  {b.op or '-'}  "
        f"{b.source or '-'}"
    )


def diagnose(
    fn: Callable[..., Any],
    *args: Any,
    target: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    detectors: Sequence[Callable[[Program], list[Finding]]] | None = None,
    measure_fixes: bool = True,
    name: str | None = None,
) -> Diagnosis:
    """Compile `fn` for `args` and name the known memory problems in the compiled program.

    Each detector of `runbook.detectors.DETECTORS` reads the compiled program (its buffers,
    HLO, shardings and aliasing) for one mechanism this runbook has a case for, and says
    how many bytes it accounts for, which buffers show it, and what to change.

    Args:
        fn: a function, or a `jax.jit` / `jax.pmap` object.
        *args: concrete arrays or `jax.ShapeDtypeStruct`s (nothing is allocated).
        target: compile for this device (a name from `runbook.targets()`) and say whether
            the program fits its usable memory.
        compiler_options: XLA options for the compilation. On CPU the diagnosis turns off
            XLA:CPU's YNNPACK fusion, whose working memory the buffer assignment leaves out.
        detectors: the detectors to run (default: all of `runbook.detectors.DETECTORS`).
        measure_fixes: compile mechanical fixes (donating an argument) to measure what
            they save; off, findings carry no measured saving.
        name: a label for the program (default: the function's name).

    Returns:
        A `Diagnosis`: print it, show it in a notebook, or `to_json()` it.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def step(state, grad):
        ...     return state - 0.1 * grad
        >>> x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
        >>> d = diagnose(step, x, x)
        >>> d.cases
        ['donation']
        >>> d.findings[0].bytes == 1024 * 1024 * 4
        True
    """
    from .detectors import DETECTORS

    start = time.perf_counter()
    refused = None
    t = _targets.get_target(target) if target is not None else None
    try:
        program = Program.compile(
            fn,
            *args,
            target=target,
            compiler_options=compiler_options,
            name=name,
            measure_fixes=measure_fixes,
        )
    except DoesNotFitError as e:
        if target is None:
            raise
        refused = {"needed": e.needed, "limit": e.limit, "what": e.what}
        program = Program.compile(
            fn, *args, compiler_options=compiler_options, name=name, measure_fixes=measure_fixes
        )
    findings = [f for detect in (detectors or DETECTORS) for f in detect(program)]
    findings.sort(key=lambda f: -f.bytes)
    return Diagnosis(program.report, tuple(findings), t, refused, time.perf_counter() - start)
