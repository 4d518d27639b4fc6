"""A case's reproduction against its recommended fix over program order: each program's
`runbook.timeline` (the bytes live at each position of its compiled schedule), stacked on
one scale, with a table and a sentence. One call on a case page (`case_timelines`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import _cache, _subprocess, _targets
from .._case import _CASES, _needs_child, get_case, measure_case
from .._errors import RunbookError
from .._program import Program
from .._provenance import label_of
from .._render import Table, fmt_bytes
from .._timeline import Timeline, of_program
from ._accelerator import recommended, worst_point
from ._history import Note

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


@dataclasses.dataclass(frozen=True)
class CaseTimelines:
    """A case's reproduction and its recommended fix over program order, at one grid point.

    Attributes:
        case: the case's name.
        scale: the scale both programs were compiled at.
        params: the grid point (by default where the reproduction needs the most memory:
            the point the page's fix table compares the fixes at).
        programs: ``(role, timeline)``: the reproduction, then the fix (none where this JAX
            cannot build one; `missing` says why).
        missing: why no fix is drawn, or "".
        elsewhere: why the programs were compiled on this machine's backend rather than
            for the target asked for, or "".
    """

    case: str
    scale: str
    params: Mapping[str, Any]
    programs: tuple[tuple[str, Timeline], ...]
    missing: str = ""
    elsewhere: str = ""

    @property
    def reproduction(self) -> Timeline:
        return self.programs[0][1]

    @property
    def fix(self) -> Timeline | None:
        return self.programs[1][1] if len(self.programs) > 1 else None

    def label(self) -> str:
        """What compiled the programs: the backend, its devices, the JAX version."""
        return label_of([(t.name, t.provenance) for _, t in self.programs])

    def figure(self) -> Figure:
        """The timelines stacked, one above the other, on one y-scale, so that the heights
        compare; each titled with its role, its name and what compiled it."""
        import matplotlib.pyplot as plt

        top = max(max(t.total, t.peak) for _, t in self.programs)
        fig, axes = plt.subplots(
            len(self.programs), 1, figsize=(8, 3.7 * len(self.programs)), squeeze=False
        )
        for ax, (role, t) in zip(axes[:, 0], self.programs, strict=True):
            t.plot(ax=ax, title=f"{role}: {t.name}, scale {self.scale!r}", top=top)
        fig.tight_layout()
        return fig

    def table(self) -> Table:
        """Per program: its peak, its compiled total, where the peak is and what is largest
        there (and the constants compiled into it, where they count: in neither)."""
        # Shown where they are a share of a program's memory (a folded or captured array),
        # not for the few bytes of scalars every program holds.
        constants = any(t.constants * 100 >= t.total for _, t in self.programs)
        rows = []
        for role, t in self.programs:
            b = t.at_peak[0] if t.at_peak else None
            rows.append(
                [
                    t.name,
                    role,
                    fmt_bytes(t.peak),
                    fmt_bytes(t.total),
                    f"{t.position} of {len(t.instructions)}: {t.peak_instruction}",
                    f"{fmt_bytes(b.size)} {b.shape}, {b.op or b.instruction}" if b else "-",
                    *([fmt_bytes(t.constants)] if constants else []),
                ]
            )
        return Table(
            ["program", "role", "peak", "compiled total", "peak at position",
             "largest at the peak", *(["constants"] if constants else [])],
            rows,
            f"Scale {self.scale!r} ({_params(self.params)}), the reproduction's worst grid "
            "point. Peak: the most bytes live at one position of the compiled schedule; "
            "compiled total: argument + output + temp - alias, every allocation reserved for "
            "the whole run"
            + ("; constants: compiled into the executable, in neither" if constants else "")
            + f". {self.missing + ' ' if self.missing else ''}"
            f"{self.elsewhere + ' ' if self.elsewhere else ''}{self.label()}.",
        )  # fmt: skip

    def note(self) -> Note:
        """A sentence: where each program's peak is and what is live there."""
        r = self.reproduction
        parts = [
            f"At scale {self.scale!r} the reproduction, `{r.name}`, peaks at "
            f"{fmt_bytes(r.peak)} at position {r.position} of {len(r.instructions)}" + _largest(r)
        ]
        f = self.fix
        if f is not None:
            who = "the smallest fix measured" if self.missing else "the recommended fix"
            parts.append(
                f"{who}, `{f.name}`, peaks at {fmt_bytes(f.peak)} "
                f"({_against(f.peak, r.peak)}) at position {f.position} of "
                f"{len(f.instructions)}" + _largest(f)
            )
        return Note(
            "; ".join(parts) + ". What is live at the peak is what to shrink, free sooner or "
            "never make: memory held only before or after the peak does not raise it."
            + (f" {self.missing}" if self.missing else "")
            + (f" {self.elsewhere}" if self.elsewhere else "")
        )


def _against(peak: int, reference: int) -> str:
    """`peak` against the reproduction's `reference`, in words."""
    if abs(peak - reference) <= reference / 200:
        return "about the reproduction's"
    if peak < reference:
        return f"{reference / peak:.2f}x lower"
    return f"{peak / reference:.2f}x the reproduction's"


def _largest(t: Timeline) -> str:
    if not t.at_peak:
        return ""
    b = t.at_peak[0]
    what = f"{fmt_bytes(b.size)} (`{b.shape}`, `{b.op or b.instruction}`)"
    if len(t.at_peak) == 1:
        return f", where the one buffer live is {what}"
    return f", where the largest of the {len(t.at_peak)} buffers live is {what}"


def case_timelines(
    case: str,
    scale: str = "seed",
    at: Mapping[str, Any] | None = None,
    target: str | None = None,
) -> CaseTimelines:
    """The timelines of `case`'s reproduction and recommended fix, on this process's backend
    or compiled for `target` without its device.

    Both are compiled at the grid point `at` (default: where the reproduction needs the most
    memory on that compiler, `worst_point`): here with the case's own compiler options, in a
    child process with forced host devices for a case that needs more devices than this
    process has; for a target on its compile-only devices. Cached (`runbook._cache`) with
    the case's measurements: a page built again compiles nothing.

    Args:
        case: a case name.
        scale: the scale (default: the write-up's).
        at: the grid point, or part of it (the reproduction's worst point among those that
            match).
        target: a compile target (`runbook.targets()`), for a case whose problem only that
            kind of compiler shows (`Case.shown_on`). Where this machine cannot compile for
            it, the programs are compiled here and `elsewhere` says why.
    """
    c = get_case(case)
    elsewhere = ""
    if target is not None and (why := _targets.unavailable(target)):
        elsewhere = f"Compiled here, not for the {target}: {why}."
        target = None
    result = measure_case(case, scale, target=target)
    point = dict(at) if at is not None else worst_point(result)
    repros = result.select(role="reproduction", **point)
    if not repros:
        raise RunbookError(f"{case}: no reproduction was measured at {point}")
    repro = max(repros, key=lambda r: r.total)
    params = dict(repro.params)
    fix = recommended(result, params)
    missing = ""
    if fix is None:
        fixes = result.select(role="fix", **params)
        fix = min(fixes, key=lambda r: r.total) if fixes else None
        why = next(
            (s["reason"] for s in result.skipped if s["name"] == c.recommended), "not measured"
        )
        missing = f"The recommended fix, `{c.recommended}`, is not drawn ({why})" + (
            f"; the smallest fix measured, `{fix.name}`, is." if fix else "."
        )
    names = [repro.name] + ([fix.name] if fix is not None else [])
    records = _cached_records(case, scale, params, names, target)
    roles = ["reproduction", "fix"]
    programs = tuple(
        (role, Timeline.from_record(rec)) for role, rec in zip(roles, records, strict=False)
    )
    return CaseTimelines(case, scale, params, programs, missing, elsewhere)


def timeline_figure(
    case: str,
    scale: str = "seed",
    at: Mapping[str, Any] | None = None,
    target: str | None = None,
) -> Figure:
    """`case_timelines(case, scale, at, target).figure()`: the reproduction's timeline
    above the recommended fix's."""
    return case_timelines(case, scale, at, target).figure()


def _cached_records(
    case: str,
    scale: str,
    params: Mapping[str, Any],
    variants: Sequence[str],
    target: str | None = None,
) -> list[dict[str, Any]]:
    """The timelines' records, from the cache, else compiled here, in a child or for the
    target."""
    c = get_case(case)
    request = {
        "kind": "case-timelines", "case": case, "scale": scale, "params": dict(params),
        "variants": list(variants), "options": dict(c.options()),
    }  # fmt: skip
    if target is not None:  # keyed as before for this backend: its cache entries stay valid
        request["target"] = _targets.require(target).name

    def compute() -> list[dict[str, Any]]:
        if target is not None:
            return _records(case, scale, dict(params), list(variants), target)
        if _needs_child(c):
            found: list[dict[str, Any]] = _subprocess.call(
                "runbook.site._timelines:_records",
                devices=c.devices,
                case=case,
                scale=scale,
                params=dict(params),
                variants=list(variants),
            )
            return found
        return _records(case, scale, dict(params), list(variants))

    records: list[dict[str, Any]] = _cache.cached(request, compute, module=_CASES[case])
    return records


def _records(
    case: str,
    scale: str,
    params: dict[str, Any],
    variants: list[str],
    target: str | None = None,
) -> list[dict[str, Any]]:
    """Each variant compiled with the case's options (for a target: as `runbook.measure`
    compiles for it), its timeline as a record."""
    c = get_case(case)
    size = c.scale(scale)
    t = _targets.resolve(target)
    out = []
    for name in variants:
        v = c.variant(name)
        # a fix that donates what no output reuses warns
        with _targets.compiling_for(t), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            program = Program.compile(
                v.program(params),
                *c.inputs(v, size, params, False),
                target=t,
                compiler_options=c.options() if t is None else None,
                name=v.name,
                measure_fixes=False,
            )
        found = of_program(program)
        # The devices the program runs on, as `runbook.measure` counts them (the process
        # may have more: a child's forced host devices).
        report = found.report
        provenance = dataclasses.replace(report.provenance, devices=program.devices)
        found = dataclasses.replace(
            found, report=dataclasses.replace(report, provenance=provenance)
        )
        out.append(found.to_record())
    return out
