"""Diagnose every corpus program and count, per mechanism, what `diagnose` names and misses.

A program's diagnosis names a case when a finding of that case is not only informational
(`Diagnosis.cases`). Per case: the corpus programs that expect it, how many of them it was
named on, and its false alarms: programs not expecting it (clean ones included) on which
it was named anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from ... import _cache, _subprocess, _targets
from ..._render import Table
from ._entry import REGISTRY, Entry

HERE = pathlib.Path(__file__).resolve().parent


def entries() -> list[Entry]:
    """Every corpus program, single-device ones first."""
    from . import accumulation, offload, programs, sharded, tpu  # noqa: F401 - registers them

    return sorted(REGISTRY, key=lambda e: e.devices > 1)


def get(name: str) -> Entry:
    found = {e.name: e for e in entries()}
    if name not in found:
        raise KeyError(f"no corpus program {name!r}; known: {sorted(found)}")
    return found[name]


@functools.cache
def source_hash() -> str:
    """The corpus's own source (the cache key's part that the core hash leaves out)."""
    digest = hashlib.sha256()
    for path in sorted(HERE.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `diagnose` said about one corpus program."""

    entry: Entry
    cases: tuple[str, ...]  # named (not informational)
    informational: tuple[str, ...]
    shares: dict[str, float]  # each named case's largest finding, against the total
    total: int
    seconds: float
    provenance: str

    @property
    def missed(self) -> list[str]:
        return sorted(self.entry.expected - set(self.cases))

    @property
    def false_alarms(self) -> list[str]:
        return sorted(set(self.cases) - self.entry.expected)


def diagnose_entry(name: str) -> dict[str, Any]:
    """Diagnose corpus program `name` in this process; a JSON-able summary."""
    from ..._diagnose import diagnose

    entry = get(name)
    fn, args = entry.build()
    d = diagnose(fn, *args, name=name, target=entry.target)
    whole = d.report.total + d.constants
    shares: dict[str, float] = {}
    for f in d.findings:
        if f.case and not f.informational:
            shares[f.case] = max(shares.get(f.case, 0.0), f.bytes / whole if whole else 0.0)
    return {
        "name": name,
        "cases": d.cases,
        "informational": sorted({f.case or f.pattern for f in d.findings if f.informational}),
        "shares": shares,
        "total": d.report.total,
        "seconds": d.seconds,
        "provenance": d.report.provenance.label(),
    }


def _diagnose_group(names: list[str]) -> list[dict[str, Any]]:
    """`diagnose_entry` for each of `names` (run in a child with forced host devices)."""
    return [diagnose_entry(n) for n in names]


def _request(entry: Entry) -> dict[str, Any]:
    """A one-device program's cache request. One diagnosed for a GPU or TPU target names it
    and the detectors' source: its diagnosis then depends on the compiler and the code
    alone, the same on every machine, so `nox -s store` keeps it and builds read it there
    instead of compiling (a v5e's compiles of the corpus took a minute of each cold build)."""
    request: dict[str, Any] = {"corpus": entry.name, "source": source_hash()}
    if entry.target is not None:
        request |= {"target": entry.target, "detectors": _cache.detectors_hash()}
    return request


def _records(chosen: Sequence[Entry]) -> list[dict[str, Any]]:
    """Each chosen program's summary. Groups needing several devices start first, in child
    processes waited on from threads, so that they compile while this process does."""
    from concurrent.futures import ThreadPoolExecutor

    groups = {
        devices: [e.name for e in chosen if e.devices == devices]
        for devices in sorted({e.devices for e in chosen if e.devices > 1})
    }
    with ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
        children = [
            pool.submit(
                _cache.cached,
                {"corpus-group": names, "devices": devices, "source": source_hash()},
                functools.partial(
                    _subprocess.call,
                    "runbook.site.corpus.evaluate:_diagnose_group",
                    devices=devices,
                    names=names,
                ),
            )
            for devices, names in groups.items()
        ]
        out: list[dict[str, Any]] = []
        for e in chosen:
            if e.devices == 1:
                request = _request(e)
                out.append(_cache.cached(request, functools.partial(diagnose_entry, e.name)))
        for child in children:
            out += child.result()
    return out


def evaluate(names: Sequence[str] | None = None) -> list[Outcome]:
    """Diagnose the corpus (or the programs `names`); cached when the site's cache is on.

    Programs needing several devices run together in one child process with that many
    forced host devices.
    """
    chosen = [get(n) for n in names] if names is not None else entries()
    chosen = [e for e in chosen if e.target is None or _targets.unavailable(e.target) is None]
    by_name = {r["name"]: r for r in _records(chosen)}
    return [
        Outcome(
            e,
            tuple(by_name[e.name]["cases"]),
            tuple(by_name[e.name]["informational"]),
            dict(by_name[e.name]["shares"]),
            int(by_name[e.name]["total"]),
            float(by_name[e.name]["seconds"]),
            str(by_name[e.name]["provenance"]),
        )
        for e in chosen
    ]


def counts(outcomes: Sequence[Outcome], cases: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per case: programs expecting it, named, missed, and false alarms."""
    out = {}
    for case in cases:
        expecting = [o for o in outcomes if case in o.entry.expected]
        named = sum(case in o.cases for o in expecting)
        alarms = sum(case in o.cases for o in outcomes if case not in o.entry.expected)
        out[case] = {
            "programs": len(expecting),
            "named": named,
            "missed": len(expecting) - named,
            "false alarms": alarms,
        }
    return out


def provenance(outcomes: Sequence[Outcome]) -> str:
    return "; ".join(dict.fromkeys(o.provenance for o in outcomes))


def table(outcomes: Sequence[Outcome] | None = None) -> Table:
    """Per mechanism: corpus programs, named, missed, false alarms (clean programs count).
    The compile-time cases only: the runtime cases are `runbook.watch`'s."""
    from ..._case import case_names, get_case

    outcomes = evaluate() if outcomes is None else outcomes
    found = counts(outcomes, [n for n in case_names() if not get_case(n).runtime])
    clean = [o for o in outcomes if o.entry.clean]
    rows: list[list[Any]] = [
        [case, c["programs"], c["named"], c["missed"], c["false alarms"]]
        for case, c in found.items()
    ]
    rows.append(
        [
            "clean programs (any case named)",
            len(clean),
            "-",
            "-",
            sum(bool(o.cases) for o in clean),
        ]
    )
    targets = sorted({o.entry.target for o in outcomes if o.entry.target})
    compiled_for = "".join(
        f"; {sum(o.entry.target == t for o in outcomes)} compiled for a {t} without the device"
        for t in targets
    )
    caption = (
        f"{len(outcomes)} corpus programs ({len(clean)} clean), each diagnosed when this page "
        f"was built; multi-device programs on forced host devices{compiled_for}. "
        f"{provenance(outcomes)}."
    )
    return Table(["case", "programs", "named", "missed", "false alarms"], rows, caption)


def _join(items: Sequence[str] | frozenset[str]) -> str:
    return ", ".join(sorted(items)) or "-"


def program_table(outcomes: Sequence[Outcome] | None = None) -> Table:
    """Each program: how it is written, what it should draw, what it drew, the report."""
    outcomes = evaluate() if outcomes is None else outcomes
    rows = []
    for o in outcomes:
        verdict = "ok"
        if o.missed or o.false_alarms:
            verdict = "; ".join(
                [f"missed {_join(o.missed)}"] * bool(o.missed)
                + [f"false alarm {_join(o.false_alarms)}"] * bool(o.false_alarms)
            )
        names = [o.entry.name, o.entry.shape, _join(o.entry.expected), _join(o.cases)]
        rows.append([*names, verdict, o.entry.source])
    return Table(
        ["program", "written as", "expected", "named", "verdict", "drawn from"],
        rows,
        f"Every corpus program and its diagnosis. {provenance(outcomes)}.",
    )


def misses(outcomes: Sequence[Outcome] | None = None) -> dict[str, list[str]]:
    """Program -> the expected cases it was not named on (only programs with a miss)."""
    outcomes = evaluate() if outcomes is None else outcomes
    return {o.entry.name: o.missed for o in outcomes if o.missed}


def false_alarms(outcomes: Sequence[Outcome] | None = None) -> dict[str, list[str]]:
    """Program -> the cases named on it that it does not exhibit (only where any)."""
    outcomes = evaluate() if outcomes is None else outcomes
    return {o.entry.name: o.false_alarms for o in outcomes if o.false_alarms}


def seconds(outcomes: Sequence[Outcome]) -> Mapping[str, float]:
    return {o.entry.name: o.seconds for o in outcomes}
