"""`runbook.diagnose`: point it at your own function, get the case that explains it and the fix."""

from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from . import _targets
from ._buffers import Buffer
from ._errors import DoesNotFitError
from ._fit import Fit
from ._locator import call_located
from ._measure import MemoryReport
from ._program import Finding, NearMiss, Program
from ._render import Table, buffer_line, buffer_table, fmt_bytes
from ._timeline import of_program

__all__ = ["Diagnosis", "Dominant", "Finding", "diagnose"]


@dataclasses.dataclass(frozen=True)
class Dominant:
    """The buffers one JAX operation made at one source line, added up.

    Attributes:
        op: the JAX operation XLA recorded (for an input, its argument path), or "-".
        source: the source line, or "-" where XLA recorded none.
        count: how many buffers.
        bytes: their sizes added up (buffers that reuse memory count each time).
        shape: the largest one's shape.
        kinds: their kinds (argument, output, temp, constant).
        steps: where they are stacked per step of a while loop (a scan, a fori_loop): the
            loop's number of steps, else None.
    """

    op: str
    source: str
    count: int
    bytes: int
    shape: str
    kinds: tuple[str, ...]
    steps: int | None = None

    @staticmethod
    def group(
        buffers: Iterable[Buffer],
        op: Callable[[Buffer], str],
        steps: Callable[[Buffer], int | None] = lambda b: None,
    ) -> list[Dominant]:
        """`buffers` grouped by `op(buffer)` and source line, largest group first; `steps`
        says where a loop stacks a buffer per step."""
        groups: dict[tuple[str, str], list[Buffer]] = {}
        for b in buffers:
            groups.setdefault((op(b), b.source or "-"), []).append(b)
        found = []
        for (name, source), members in groups.items():
            members.sort(key=lambda b: -b.size)
            stacked = [n for b in members if (n := steps(b)) is not None]
            found.append(
                Dominant(
                    name,
                    source,
                    len(members),
                    sum(b.size for b in members),
                    members[0].shape,
                    tuple(dict.fromkeys(b.kind or "-" for b in members)),
                    max(stacked) if stacked else None,
                )
            )
        return sorted(found, key=lambda g: -g.bytes)

    def describe(self, whole: int) -> str:
        share = f"{min(self.bytes / whole, 1.0):.0%} " if whole else ""
        many = f"{self.count} buffers, largest " if self.count > 1 else ""
        stacked = f"; stacked per step of a {self.steps}-step loop" if self.steps else ""
        made = f"{self.op}  {self.source}"
        if self.op == "-" and self.source == "-":
            made = "no JAX operation recorded (made by the compiler: copies, initial values)"
        return (
            f"{fmt_bytes(self.bytes):>10} {share}({many}{self.shape} {'/'.join(self.kinds)})  "
            f"{made}{stacked}"
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What a compiled program needs, and the known mechanisms behind it.

    Attributes:
        report: the program's `MemoryReport` (per device, buffers included).
        findings: each mechanism recognised, largest first (see `Finding`).
        target: the device it was compiled for, or None for this process's backend.
        refused: when the target's compiler refused the program as too large, its figures
            (``needed``, ``limit``, ``what``). The report and findings are then those of the
            program it wrote before refusing, or, where it wrote none, of this process's
            backend (the report's provenance says which).
        seconds: how long the diagnosis took (compilation included).
        stacked: buffers a while loop writes one step at a time (HLO instruction name ->
            the loop's steps; see `Program.stacked_per_step`).
        near_misses: mechanisms the detectors saw part of without naming them, largest
            first (cases the findings name left out); see `closest`.
        peak: the most bytes live at one point of the compiled schedule (`runbook.timeline`;
            None where the compiler wrote no live ranges).
        at_peak: the memory live at that point, largest first, each with the JAX operation
            and source line that made it.
        peak_instruction: the instruction at that point, with what made it.
    """

    report: MemoryReport
    findings: tuple[Finding, ...]
    target: _targets.Target | None = None
    refused: dict[str, Any] | None = None
    seconds: float = 0.0
    stacked: Mapping[str, int] = dataclasses.field(default_factory=dict)
    near_misses: tuple[NearMiss, ...] = ()
    peak: int | None = None
    at_peak: tuple[Buffer, ...] = ()
    peak_instruction: str = ""

    @property
    def closest(self) -> NearMiss | None:
        """The case that comes closest among those not named, and why it was not (its
        ``case`` and ``reason``); None when no detector saw part of its mechanism."""
        return self.near_misses[0] if self.near_misses else None

    @property
    def cases(self) -> list[str]:
        """The cases named by the findings that are not only informational, largest first."""
        return list(dict.fromkeys(f.case for f in self.findings if f.case and not f.informational))

    @property
    def usable(self) -> int | None:
        """The target's usable memory per device (None without a target)."""
        return self.target.usable() if self.target else None

    @property
    def fit(self) -> Fit | None:
        """Whether the program fits the target, per device (None without a target)."""
        if self.target is None:
            return None
        if self.refused is not None:
            return Fit.refusal(self.target, **self.refused)
        return Fit.of(self.report, self.target)

    @property
    def fits(self) -> bool | None:
        """Whether the program fits the target's usable memory (None without a target)."""
        return None if self.fit is None else self.fit.fits

    @property
    def margin(self) -> int | None:
        """The usable memory minus what the program needs (negative when it does not fit)."""
        return None if self.fit is None else self.fit.margin

    def fit_line(self) -> str:
        """Whether it fits the target, in one sentence ("" without a target)."""
        if self.fit is None:
            return ""
        line = self.fit.sentence()
        if self.refused is not None and not self.report.provenance.target:
            line += (
                f" The findings below come from this machine's "
                f"{self.report.provenance.backend} compiler."
            )
        return line

    @property
    def constants(self) -> int:
        """Bytes of constants compiled into the program, which XLA's total leaves out."""
        return sum(b.size for b in self.report.buffers if b.kind == "constant")

    @property
    def explained(self) -> int:
        """Bytes the findings (not the informational ones) account for, at most the total.

        Findings may share buffers, so this is an upper estimate of what they explain.
        """
        found = sum(f.bytes for f in self.findings if not f.informational)
        return min(found, self.report.total + self.constants)

    def unexplained(self, count: int = 5) -> list[Buffer]:
        """The largest buffers that no finding names as evidence."""
        named = {b.instruction for f in self.findings for b in f.evidence}
        rest = [
            b
            for b in self.report.buffers
            if b.instruction not in named and b.kind in ("argument", "output", "temp")
        ]
        return rest[:count]

    def dominant(self, count: int = 5) -> list[Dominant]:
        """What dominates the program: the memory live at its peak (`at_peak`) grouped by
        the JAX operation and source line that made it, largest first, each marked where a
        loop stacks it per step. Each piece of memory counts once, so the groups never sum
        past the total. Where the compiler wrote no live ranges: every buffer, grouped."""
        if self.peak is not None:
            kept = list(self.at_peak)
        else:
            kept = [
                b
                for b in self.report.buffers
                if b.kind in ("argument", "output", "temp", "constant")
            ]
        groups = Dominant.group(kept, lambda b: b.op or "-", lambda b: self.stacked.get(_name(b)))
        return groups[:count]

    def _nothing_found(self) -> list[str]:
        """The text for a program no detector recognised: what dominates, and what comes
        closest (where the diagnosis carries a ``closest`` explanation)."""
        whole = self.report.total + self.constants
        lines = [
            (
                "No known mechanism found. What dominates at the peak, by the JAX operation "
                "and source line that made it (bytes, share of the total):"
            )
        ]
        lines += [f"  {g.describe(whole)}" for g in self.dominant()]
        lines += [f"  {line}" for line in _closest_lines(self)]
        lines.append("The largest buffers:")
        lines += [f"  {buffer_line(b)}" for b in self.report.buffers[:3]]
        return lines + self._peak_lines()

    def _peak_heading(self) -> str:
        return (
            f"Live at the peak, {fmt_bytes(self.peak or 0)} at {self.peak_instruction} "
            f"(runbook.timeline draws the whole schedule); the largest:"
        )

    def _peak_lines(self, count: int = 5) -> list[str]:
        """The memory live at the schedule's peak, largest first ([] without live ranges)."""
        if self.peak is None:
            return []
        lines = [self._peak_heading()]
        lines += [f"  {buffer_line(b)}" for b in self.at_peak[:count]]
        if len(self.at_peak) > count:
            lines.append(f"  ... and {len(self.at_peak) - count} more")
        return lines

    def _peak_html(self) -> str:
        if self.peak is None:
            return ""
        table = buffer_table(self.at_peak[:10])._repr_html_()
        return f"<details><summary>{html.escape(self._peak_heading())}</summary>{table}</details>"

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
            lines += self._nothing_found()
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
            lines += [f"     {buffer_line(b)}" for b in f.evidence[:4]]
            if len(f.evidence) > 4:
                lines.append(f"     ... and {len(f.evidence) - 4} more")
        whole = self.report.total + self.constants
        if whole and self.explained < 0.9 * whole:
            lines.append(
                f"The findings account for {fmt_bytes(self.explained)} of "
                f"{fmt_bytes(whole)}; the largest buffers outside them:"
            )
            lines += [f"  {buffer_line(b)}" for b in self.unexplained(3)]
        lines += self._peak_lines()
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
            whole = self.report.total + self.constants
            table = "".join(
                f"<tr><td>{fmt_bytes(g.bytes)}</td>"
                f"<td>{min(g.bytes / whole, 1.0) if whole else 0:.0%}</td>"
                f"<td>{g.count}</td><td><code>{e(g.shape)}</code></td><td>{e(g.op)}</td>"
                f"<td>{e(g.source)}</td><td>{f'{g.steps}-step loop' if g.steps else '-'}</td></tr>"
                for g in self.dominant()
            )
            head = "".join(
                f"<th>{c}</th>"
                for c in ("bytes", "of total", "buffers", "largest", "JAX operation", "source",
                          "stacked per step of")
            )  # fmt: skip
            closest = "".join(f"<p>{e(line)}</p>" for line in _closest_lines(self))
            parts.append(
                "<p>No known mechanism found. What dominates at the peak, by the JAX operation "
                f'and source line that made it:</p><table class="runbook-table"><thead><tr>{head}</tr>'
                f"</thead><tbody>{table}</tbody></table>{closest}{self._peak_html()}</div>"
            )
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
            evidence = "".join(f"<li><code>{e(buffer_line(b))}</code></li>" for b in f.evidence[:6])
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
            f"<tbody>{''.join(rows)}</tbody></table>{self._peak_html()}</div>"
        )
        return "".join(parts)

    def to_record(self) -> dict[str, Any]:
        """Everything, buffers included, as JSON-able data (`from_record` reads it back)."""
        return {
            "report": self.report.to_record(),
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "target": self.target.name if self.target else None,
            "refused": dict(self.refused) if self.refused else None,
            "seconds": self.seconds,
            "stacked": dict(self.stacked),
            "near_misses": [dataclasses.asdict(m) for m in self.near_misses],
            "peak": self.peak,
            "at_peak": [dataclasses.asdict(b) for b in self.at_peak],
            "peak_instruction": self.peak_instruction,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Diagnosis:
        findings = []
        for f in record["findings"]:
            fields = dict(f)
            fields["evidence"] = tuple(Buffer(**b) for b in fields["evidence"])
            findings.append(Finding(**fields))
        target = record.get("target")
        return cls(
            MemoryReport.from_record(record["report"]),
            tuple(findings),
            _targets.get_target(target) if target else None,
            dict(record["refused"]) if record.get("refused") else None,
            record.get("seconds", 0.0),
            dict(record.get("stacked", {})),
            tuple(NearMiss(**m) for m in record.get("near_misses", ())),
            record.get("peak"),
            tuple(Buffer(**b) for b in record.get("at_peak", ())),
            record.get("peak_instruction", ""),
        )

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
            "dominant": [g.to_json() for g in self.dominant()] if not self.findings else [],
            **({"closest": _closest_json(self)} if not self.findings else {}),
            "peak": None
            if self.peak is None
            else {
                "bytes": self.peak,
                "instruction": self.peak_instruction,
                "live": [dataclasses.asdict(b) for b in self.at_peak],
            },
        }


def _name(b: Buffer) -> str:
    """A buffer's HLO instruction name (its `instruction` is ``"name (opcode)"``, or
    ``"name{index} (opcode)"`` for an element of a tuple: the index kept)."""
    return b.instruction.split(" (")[0]


def _closest_lines(d: Diagnosis) -> list[str]:
    """The case that comes closest and why it was not named (nothing where no detector saw
    part of its mechanism)."""
    c = d.closest
    if c is None:
        return []
    return [f"Closest: {c.case} ({c.pattern}), {fmt_bytes(c.bytes)}: {c.reason}"]


def _closest_json(d: Diagnosis) -> dict[str, Any] | None:
    return d.closest.to_json() if d.closest else None


def diagnose(
    fn: Callable[..., Any],
    *args: Any,
    target: str | _targets.Target | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    detectors: Sequence[Callable[[Program], list[Finding]]] | None = None,
    measure_fixes: bool = False,
    name: str | None = None,
) -> Diagnosis:
    """Compile `fn` for `args` and name the known memory problems in the compiled program.

    Each detector of `runbook.detectors.DETECTORS` reads the compiled program (its buffers,
    HLO, shardings and aliasing) for one mechanism this runbook has a case for, and says
    how many bytes it accounts for, which buffers show it, and what to change.

    Args:
        fn: a function, a `jax.jit` / `jax.pmap` object, an `equinox.filter_jit`
            function, or a module called as one (equinox, flax NNX).
        *args: concrete arrays or `jax.ShapeDtypeStruct`s (nothing is allocated), in any
            pytrees; leaves that are not arrays are static, as `equinox.filter_jit` has it.
        target: compile for this device (a name from `runbook.targets()`) and say whether
            the program fits its usable memory.
        compiler_options: XLA options for the compilation. On CPU the diagnosis turns off
            XLA:CPU's YNNPACK fusion, whose working memory the buffer assignment leaves out.
        detectors: the detectors to run (default: all of `runbook.detectors.DETECTORS`).
        measure_fixes: also compile the mechanical fixes the findings name (donating
            arguments) and measure what each saves: one more compile each. Off (the
            default), the program is compiled once, and findings carry no measured saving.
        name: a label for the program (default: the function's name).

    Returns:
        The `Diagnosis`, to print, to show in a notebook or to turn into JSON.

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
    from .detectors import DETECTORS, near_misses

    start = time.perf_counter()
    refused = None
    t = _targets.resolve(target)  # once: everything below takes the Target
    try:  # a program the target refuses: the one its compiler wrote before refusing
        program = Program.compile(
            fn,
            *args,
            target=t,
            compiler_options=compiler_options,
            name=name,
            measure_fixes=measure_fixes,
            keep_refused=True,
        )
        refused = program.refused
    except DoesNotFitError as e:  # refused, with nothing written: as this machine compiles it
        if t is None:
            raise
        refused = {"needed": e.needed, "limit": e.limit, "what": e.what}
        program = Program.compile(
            fn, *args, compiler_options=compiler_options, name=name, measure_fixes=measure_fixes
        )
    findings = [f for detect in (detectors or DETECTORS) for f in detect(program)]
    findings.sort(key=lambda f: -f.bytes)
    misses = tuple(near_misses(program, findings, detectors))
    peak = _peak(program)
    seconds = time.perf_counter() - start
    return Diagnosis(
        program.report,
        tuple(findings),
        t,
        refused,
        seconds,
        program.stacked_per_step(),
        misses,
        *peak,
    )


def _peak(program: Program) -> tuple[int | None, tuple[Buffer, ...], str]:
    """The schedule's peak, what is live at it and where (nothing without live ranges)."""
    if not program.schedule:
        return None, (), ""
    found = program.shared(of_program)  # the detectors' `at_peak` reads the same one
    return found.peak, found.at_peak, found.peak_instruction


# --- the command line: `python -m runbook diagnose file.py:function --args file.py:make_args`


def diagnose_locator(
    locator: str,
    args_locator: str | None = None,
    *,
    target: str | None = None,
    measure_fixes: bool = False,
) -> Diagnosis:
    """`diagnose` for a locator ``file.py:function``, its arguments from the locator
    ``file.py:make_args`` (called with no arguments).

    `make_args` returns the arguments as a tuple (anything else is the one argument); give
    `jax.ShapeDtypeStruct`s to allocate nothing. Every failure of the user's code (import,
    `make_args`, tracing) is a `RunbookError` with a one-line message.
    """
    return call_located(
        locator,
        args_locator,
        lambda fn, args, name: diagnose(
            fn, *args, target=target, name=name, measure_fixes=measure_fixes
        ),
    )
