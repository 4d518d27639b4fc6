"""Across JAX releases: where each problem appears, from the files ``nox -s versions`` wrote.

Each release's file (``docs/_data/versions/<jax>.json``) holds every case measured there;
this module compares, per release, the reproduction with the best fix that release can run.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from .._case import CaseResult
from .._errors import RunbookError
from .._releases import release_key
from .._render import Table, _unit, fmt_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

DATA_DIR = pathlib.Path(__file__).resolve().parents[2] / "docs" / "_data"
# The reproduction needing at least this many times the best fix's bytes counts as the
# problem being present; both cases sit far above it wherever they reproduce.
PROBLEM_RATIO = 1.25


class Note(str):
    """A sentence that renders as Markdown in a notebook and prints as itself."""

    def _repr_markdown_(self) -> str:
        return str(self)


def load_versions(data_dir: str | pathlib.Path | None = None) -> list[dict[str, Any]]:
    """Every committed release file, oldest release first.

    Args:
        data_dir: the folder holding ``versions/``; defaults to the project's ``docs/_data``.
    """
    folder = pathlib.Path(data_dir or DATA_DIR) / "versions"
    files = sorted(folder.glob("*.json"))
    if not files:
        raise RunbookError(f"no release files in {folder}: run `nox -s versions` to make them.")
    return sorted((json.loads(f.read_text()) for f in files), key=lambda d: release_key(d["jax"]))


@dataclasses.dataclass(frozen=True)
class ReleaseFigures:
    """One release's figures for one case, at one grid point.

    Attributes:
        totals: total bytes per variant, or its status ("failed", "timeout", ...).
        notes: the reason per variant that has no total.
        compile_seconds: compile time per variant (the limit, for a timeout).
    """

    jax: str
    jaxlib: str
    generated: str
    roles: Mapping[str, str]
    totals: Mapping[str, int | str]
    notes: Mapping[str, str]
    compile_seconds: Mapping[str, float | None]

    def _measured(self, role: str) -> dict[str, int]:
        return {
            n: t for n, t in self.totals.items() if self.roles[n] == role and isinstance(t, int)
        }

    @property
    def reproduction(self) -> int | None:
        """The reproduction's total bytes, None when it could not be measured."""
        return next(iter(self._measured("reproduction").values()), None)

    @property
    def reproduction_name(self) -> str:
        return next(n for n, r in self.roles.items() if r == "reproduction")

    @property
    def best_fix(self) -> str | None:
        """The measured fix with the fewest bytes."""
        fixes = self._measured("fix")
        return min(fixes, key=fixes.__getitem__) if fixes else None

    @property
    def best_fix_bytes(self) -> int | None:
        return self.totals[self.best_fix] if self.best_fix else None  # type: ignore[return-value]

    @property
    def ratio(self) -> float | None:
        """reproduction / best fix, None when either is missing."""
        if self.reproduction is None or not self.best_fix_bytes:
            return None
        return self.reproduction / self.best_fix_bytes

    @property
    def present(self) -> bool | None:
        """Whether the problem shows in this release; None when it could not be measured."""
        return None if self.ratio is None else self.ratio >= PROBLEM_RATIO


def _params_label(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _figures(release: Mapping[str, Any], case: str, params: Mapping[str, Any]) -> ReleaseFigures:
    data = release["cases"][case]
    roles, totals, notes, seconds = {}, {}, {}, {}
    for entry in [*data["variants"], *data["skipped"]]:
        if dict(entry["params"]) != dict(params):
            continue
        name = entry["name"]
        roles[name] = entry["role"]
        if entry.get("status", "ok") == "ok":
            totals[name] = entry["bytes"]["total"]
            seconds[name] = entry["compile_seconds"]
        else:
            totals[name] = entry["status"]
            notes[name] = entry["reason"]
            seconds[name] = entry["seconds"] if entry["status"] == "timeout" else None
    return ReleaseFigures(release["jax"], release["jaxlib"], release["generated"], roles, totals,
                          notes, seconds)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class History:
    """One case across every committed release, compared at one grid point.

    Attributes:
        params: the grid point: where the newest measured reproduction needs the most bytes.
        provenance: backend, device and machine of the runs, for captions.
    """

    case: str
    params: Mapping[str, Any]
    releases: tuple[ReleaseFigures, ...]
    provenance: str
    raw: tuple[Mapping[str, Any], ...] = dataclasses.field(default=(), repr=False)

    @property
    def first(self) -> str:
        return self.releases[0].jax

    @property
    def last(self) -> str:
        return self.releases[-1].jax

    def statement(self) -> Note:
        """Since when the problem exists and whether a release fixed it, from the data.

        A `Note`: a string that a notebook cell renders as a sentence.
        """
        measured = [r for r in self.releases if r.present is not None]
        unmeasured = [r.jax for r in self.releases if r.present is None]
        where = f"{self.case} ({_params_label(self.params)})"
        if not measured:
            return Note(f"{where}: no release measured both the reproduction and a fix.")
        present = [r.jax for r in measured if r.present]
        if not present:
            text = f"{where}: absent from every measured release, jax {measured[0].jax} to {measured[-1].jax}"
        elif measured[-1].present:
            since, oldest = present[0], ""
            if since == self.releases[0].jax:
                oldest = " (the oldest release measured)"
            elif since == measured[0].jax:
                oldest = " (the first release that could compile both)"
            gaps = [
                r.jax for r in measured if not r.present and release_key(r.jax) > release_key(since)
            ]
            text = f"{where}: present in jax {since}{oldest} and every measured release after it"
            text += f" except {', '.join(gaps)}" if gaps else ""
            text += f", up to {measured[-1].jax}; no release fixed it"
        else:
            last_present = present[-1]
            fixed = next(r.jax for r in measured if release_key(r.jax) > release_key(last_present))
            text = f"{where}: present from jax {present[0]} to {last_present}; fixed in {fixed}"
        if unmeasured:
            text += f" (not measurable in {', '.join(unmeasured)}: see the table)"
        return Note(text + ".")

    def live(self, result: CaseResult) -> ReleaseFigures:
        """This environment's figures (from `measure_case`) at the same grid point."""
        p = result.provenance
        chosen = result.select(**self.params)
        return ReleaseFigures(
            f"{p.jax} (this build)", p.jaxlib, p.date, {r.name: r.role for r in chosen},
            {r.name: r.total for r in chosen}, {}, {r.name: r.compile_seconds for r in chosen},
        )  # fmt: skip

    def table(self, live: CaseResult | None = None) -> Table:
        """Per release: the reproduction, the best fix it can run, and their ratio.

        Args:
            live: this environment's `measure_case` result, shown as a last row.
        """
        rows = []
        for r in [*self.releases, *([self.live(live)] if live else [])]:
            repro = r.totals.get(r.reproduction_name, "-")
            repro = fmt_bytes(repro) if isinstance(repro, int) else repro
            best = r.best_fix_bytes
            fix = f"{fmt_bytes(best)} ({r.best_fix})" if best is not None else "none measured"
            ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
            verdict = {True: "present", False: "absent", None: "not measurable"}[r.present]
            rows.append([r.jax, repro, fix, ratio, verdict])
        caption = (
            f"{self.case} at {_params_label(self.params)}: compile-time total bytes per device. "
            f"Present means reproduction / best fix >= {PROBLEM_RATIO}. {self.provenance}."
        )
        return Table(["jax", "reproduction", "best fix", "ratio", "problem"], rows, caption)

    def variants_table(self, *, seconds: bool = False) -> Table:
        """Every variant (rows) in every release (columns): total bytes, or compile seconds."""
        names = list(dict.fromkeys(n for r in self.releases for n in r.roles))
        rows = []
        for name in names:
            row = [name]
            for r in self.releases:
                got = r.totals.get(name, "-")
                if seconds and isinstance(got, int):
                    got = f"{r.compile_seconds[name]:.1f} s"
                elif seconds and got == "timeout":
                    got = f"timeout ({r.compile_seconds[name]:g} s)"
                elif isinstance(got, int):
                    got = fmt_bytes(got)
                row.append(got)
            rows.append(row)
        what = "compile seconds" if seconds else "compile-time total bytes per device"
        caption = f"{self.case} at {_params_label(self.params)}: {what}. {self.provenance}."
        return Table(["variant", *(r.jax for r in self.releases)], rows, caption)

    def grid_table(self, variant: str | None = None) -> Table:
        """One variant (default: the reproduction) at every grid point (columns), per release."""
        name = variant or self.releases[-1].reproduction_name
        points: list[dict[str, Any]] = []
        cells: dict[tuple[str, str], str] = {}
        for release in self.raw:
            data = release["cases"][self.case]
            for entry in [*data["variants"], *data["skipped"]]:
                if entry["name"] != name:
                    continue
                if dict(entry["params"]) not in points:
                    points.append(dict(entry["params"]))
                ok = entry.get("status", "ok") == "ok"
                got = fmt_bytes(entry["bytes"]["total"]) if ok else entry["status"]
                cells[release["jax"], _params_label(entry["params"])] = got
        labels = [_params_label(p) for p in points]
        rows = [[r["jax"], *(cells.get((r["jax"], lb), "-") for lb in labels)] for r in self.raw]
        caption = f"{self.case}, {name}: compile-time total bytes per device. {self.provenance}."
        return Table(["jax", *labels], rows, caption)

    def reasons(self) -> list[str]:
        """One line per unmeasured variant: release, variant, status and reason."""
        return [
            f"jax {r.jax}, {name}: {r.totals[name]}: {note}"
            for r in self.releases
            for name, note in r.notes.items()
        ]

    def plot(self, ax: Any = None, *, live: CaseResult | None = None) -> Axes:
        """Total bytes per release, one line per variant; `live` adds this build's figures."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(9.5, 4.2))
        columns = [*self.releases, *([self.live(live)] if live else [])]
        every = [t for r in columns for t in r.totals.values() if isinstance(t, int)]
        unit, scale = _unit(max(every, default=1))
        failed: list[tuple[int, str]] = []  # (release index, color): could not compile
        for name, role in self.releases[-1].roles.items():
            got = [
                (i, t / scale)
                for i, r in enumerate(self.releases)
                if isinstance(t := r.totals.get(name), int)
            ]
            width = 2.6 if role == "reproduction" else 1.2
            if got:
                line = ax.plot(
                    *zip(*got, strict=True), marker="o", lw=width, label=f"{name} ({role})"
                )
            else:
                line = ax.plot([], [], marker="o", lw=width, label=f"{name} ({role})")
            color = line[0].get_color()
            failed += [(i, color) for i, r in enumerate(self.releases)
                       if r.totals.get(name) in ("failed", "timeout")]  # fmt: skip
            if live and isinstance(mine := columns[-1].totals.get(name), int):
                ax.scatter([len(self.releases)], [mine / scale],
                           marker="*", s=110, color=color, zorder=3)  # fmt: skip
        if failed:
            ax.set_ylim(bottom=0)
            ax.scatter([i for i, _ in failed], [0] * len(failed), marker="x", s=60, zorder=3,
                       color=[c for _, c in failed], clip_on=False,
                       label="x: failed or timed out")  # fmt: skip
        ax.set_xticks(range(len(columns)))
        ax.set_xticklabels([r.jax.replace(" (this build)", "\n(this build)") for r in columns],
                           rotation=45, fontsize="small")  # fmt: skip
        ax.set_xlabel("jax release (stars: measured during this build)" if live else "jax release")
        ax.set_ylabel(f"{unit} per device (compile time)")
        title = f"{self.case} ({_params_label(self.params)})\n{self.provenance}"
        ax.set_title(title, fontsize="small")
        ax.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.01, 0.5))
        ax.figure.tight_layout()
        return cast("Axes", ax)


def _headline_params(releases: Sequence[Mapping[str, Any]], case: str) -> dict[str, Any]:
    """The grid point where the newest measured reproduction is largest."""
    for release in reversed(releases):
        repro = [v for v in release["cases"][case]["variants"] if v["role"] == "reproduction"]
        if repro:
            return dict(max(repro, key=lambda v: v["bytes"]["total"])["params"])
    first = releases[-1]["cases"][case]["skipped"]
    if not first:
        raise RunbookError(f"no entries for case {case!r} in the release files")
    return dict(first[0]["params"])


def _on_target(release: Mapping[str, Any], case: str, target: str) -> dict[str, Any]:
    """`release` with its figures for `case` replaced by those compiled for `target`; where
    the release could not compile for it, every program carries that status and reason."""
    found = release.get("targets", {}).get(target)
    if found is not None and found["status"] == "ok" and case in found.get("cases", {}):
        return {**release, "backend": found["cases"][case]["backend"],
                "cases": {case: found["cases"][case]}}  # fmt: skip
    if found is None:
        status, reason = "not measured", "this release's file predates target measurements"
    elif found["status"] == "ok":  # the target compiled other cases in a later `--case` run
        status = "not measured"
        reason = f"this release's {target} compiler was measured without this case"
    else:
        status, reason = found["status"], found["reason"]
    cpu = release["cases"][case]
    entries = [
        {"name": e["name"], "role": e["role"], "params": e["params"], "status": status,
         "reason": reason, "seconds": None}
        for e in [*cpu["variants"], *cpu["skipped"]]
    ]  # fmt: skip
    return {**release, "cases": {case: {**cpu, "variants": [], "skipped": entries}}}


def history(
    case: str, *, target: str | None = None, data_dir: str | pathlib.Path | None = None
) -> History:
    """Case `case` in every committed release: reproduction against best fix, per release.

    Args:
        case: a case name (see `case_names()`).
        target: the figures compiled for this target (e.g. ``"h100"``) instead of the CPU's.
        data_dir: the folder holding ``versions/``; defaults to the project's ``docs/_data``.

    Returns:
        A `History`; ``statement()`` says since when the problem exists and whether a release
        fixed it, ``table()`` and ``plot()`` show the figures.
    """
    releases = [r for r in load_versions(data_dir) if case in r["cases"]]
    if not releases:
        raise RunbookError(f"no release file measured case {case!r}: run `nox -s versions`.")
    if target is not None:
        releases = [_on_target(r, case, target) for r in releases]
    params = _headline_params(releases, case)
    first, last = releases[0], releases[-1]
    machines = sorted({r["host"]["cpu"] for r in releases if "host" in r})
    dates = sorted({r["generated"] for r in releases})
    where = (
        f"compiled for the {target} target without the device"
        if target
        else f"{last['backend'].upper()} backend"
    )
    provenance = (
        f"{where}, {last['cases'][case]['devices']} device(s); "
        f"jax {first['jax']} to {last['jax']}; measured {dates[0]}"
        f"{' to ' + dates[-1] if len(dates) > 1 else ''} on {', '.join(machines) or 'unknown'}"
    )
    figures = tuple(_figures(r, case, params) for r in releases)
    return History(case, params, figures, provenance, tuple(releases))


def slowest(h: History) -> Note:
    """The slowest compile of any program in any release, beside the newest release's."""
    found = [(s, r.jax, n) for r in h.releases for n, s in r.compile_seconds.items() if s]
    if not found:
        return Note(f"{h.case}: no compile time recorded.")
    seconds, release, name = max(found)
    newest = h.releases[-1].compile_seconds.get(name)
    now = f"{newest:.1f} s" if newest is not None else h.releases[-1].totals.get(name, "-")
    return Note(
        f"The slowest compile at {_params_label(h.params)}: `{name}` in jax {release}, "
        f"{seconds:.1f} s; the same program in jax {h.last}: {now}."
    )


def releases_table(releases: Sequence[Mapping[str, Any]]) -> Table:
    """One row per committed release file: versions, machine, time, and what it measured."""
    rows = []
    for r in releases:
        counts: dict[str, int] = {}
        for c in r["cases"].values():
            for e in [*c["variants"], *c["skipped"]]:
                counts[e["status"]] = counts.get(e["status"], 0) + 1
        targets = "; ".join(
            f"{t}: {v['status']}" + (f" ({v['compiler']})" if v.get("compiler") else "")
            for t, v in r.get("targets", {}).items()
        )
        rows.append([
            r["jax"], r["jaxlib"], r["generated"],
            f"{r['host']['cpu']}, {r['host']['cores']} cores",
            f"{r['elapsed_seconds']:.0f} s",
            f"{r['session_seconds']:.0f} s" if "session_seconds" in r else "not recorded",
            ", ".join(f"{n} {s}" for s, n in counts.items()),
            targets or "not measured",
        ])  # fmt: skip
    limit = releases[-1]["time_limit_seconds"] if releases else 0
    return Table(
        ["jax", "jaxlib", "generated", "machine", "measuring", "session", "CPU programs",
         "targets"],
        rows,
        f"One file per release in docs/_data/versions/; each program limited to {limit:g} s "
        "of compile time. Session: the release's `nox -s versions` session from its first "
        "install to its file written.",
    )  # fmt: skip


def matrix_time(releases: Sequence[Mapping[str, Any]]) -> str:
    """How long the committed matrix took: measuring, and the `nox -s versions` sessions that
    wrote the files, installs included, where every file recorded its session."""
    measuring = sum(r["elapsed_seconds"] for r in releases)
    text = f"Measuring took {measuring / 60:.1f} min over {len(releases)} releases"
    if releases and all("session_seconds" in r for r in releases):
        session = sum(r["session_seconds"] for r in releases)
        return f"{text}; the sessions, installing each environment, took {session / 60:.1f} min."
    return f"{text}, plus installing each environment (not recorded in every file)."


def _verdicts(found: Mapping[str, Any] | None) -> dict[str, str] | None:
    """``{claim key: verdict}`` of one case's recorded claims; None unless decided."""
    if not found or found["status"] != "ok":
        return None
    return {c["key"]: c["verdict"] for c in found["claims"]}


def recorded_verdicts(
    case: str, jax_version: str, data_dir: str | pathlib.Path | None = None
) -> dict[str, str] | None:
    """``{claim key: verdict}`` that release `jax_version` gave case `case` on CPU, as
    ``nox -s versions`` recorded it; None where that release has no file or no claims."""
    path = pathlib.Path(data_dir or DATA_DIR) / "versions" / f"{jax_version}.json"
    if not path.exists():
        return None
    return _verdicts(json.loads(path.read_text()).get("claims", {}).get("cases", {}).get(case))


def claims_by_release(case: str, releases: Sequence[Mapping[str, Any]] | None = None) -> Table:
    """One row per claim, one column per release: the verdict that release gave on CPU."""
    releases = releases if releases is not None else load_versions()
    recorded = {r["jax"]: r.get("claims", {}).get("cases", {}).get(case) for r in releases}
    text: dict[str, str] = {}  # claim key -> the claim's words, in the order first recorded
    columns: dict[str, dict[str, str] | str] = {}  # release -> verdicts, or why there are none
    for jax, found in recorded.items():
        verdicts = _verdicts(found)
        if verdicts is not None and found:
            columns[jax] = verdicts
            text.update({c["key"]: c["claim"] for c in found["claims"]})
        else:
            columns[jax] = found["status"] if found else "not recorded"
    decided = {j: v for j, v in columns.items() if isinstance(v, dict)}
    rows = [[words, *(v.get(key, "-") for v in decided.values())] for key, words in text.items()]
    missing = "; ".join(f"{j}: {v}" for j, v in columns.items() if isinstance(v, str))
    return Table(
        ["claim", *decided],
        rows,
        f"{case}: each claim's verdict per release, decided on the CPU at scale 'seed' by "
        "`nox -s versions` in that release's own environment."
        + (f" No verdicts for {missing} (`nox -s \"versions(RELEASE)\" -- --claims-only` "
           "decides them without measuring the figures again)." if missing else ""),
    )  # fmt: skip


def versions_report(case: str, live: CaseResult | None = None) -> list[Any]:
    """A case across releases, for the versions page: when the problem appears on CPU and
    on each target the files hold, the figures per release, and what failed where."""
    from .._case import get_case

    items: list[Any] = [Note(f"### {get_case(case).title}")]
    cpu = history(case)
    items += [cpu.statement()]
    targets = sorted({t for r in load_versions() for t in r.get("targets", {})})
    for t in targets:
        items.append(history(case, target=t).statement())
    items += [cpu.table(live=live), cpu.variants_table()]
    for t in targets:
        items.append(history(case, target=t).variants_table())
    reasons = cpu.reasons() + [x for t in targets for x in history(case, target=t).reasons()]
    items.append(
        Note("What could not be measured, and why:\n\n" + "\n".join(f"- {r}" for r in reasons))
        if reasons
        else Note("Every program compiled in every release.")
    )
    items.append(slowest(cpu))
    items.append(claims_by_release(case))
    return items
