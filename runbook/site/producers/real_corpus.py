"""Diagnose the real-program corpus at its authors' scale: docs/_data/corpus/real.json.

    nox -s "real-corpus(newest)"  (python -m runbook.site.producers.real_corpus
                                  [--targets cpu h100 v5e] [--programs NAME ...] [--out FILE]
                                  [--diagnose-only | --fixes CASE ...])
    nox -s "real-corpus(oldest)"  (the same, on the oldest tested release)
    nox -s "real-corpus(newest)" -- --watch   (runbook.watch on the corpus's training loops,
                                              run for real: docs/_data/corpus/watched.json)

For each program of `runbook.site.corpus.real` and each target (this machine's CPU, and
GPU/TPU compilers without the device), nothing allocated:

- a bare compile, timed (what the user's own ``jit(...).lower(...).compile()`` costs);
- `runbook.diagnose`, timed: the cases it names, each finding's share of the total;
- each of the program's fixes, compiled as the diagnosis compiles: the bytes it saves.

A mechanism is *expected* on a target when its fix saves at least `THRESHOLD` of the
program's total there: decided by measurement, per target, never by reading the code.
Multi-device programs run on forced host devices in a child process on CPU, and on the
target's compile-only devices otherwise. Rows already in the file for other programs or
targets are kept, so that targets can be measured in separate runs. With
``--diagnose-only``, a row already in the file keeps its fixes' figures (what the compiler
makes of each fix, which a detector does not change) and is timed and diagnosed again:
after a detector changes, at the cost of a bare compile and a diagnosis per row. The row
records both dates (``date``: the diagnosis, ``fixes_date``: the fixes), and stops with
an error where the program's total is no longer the one its fixes were measured against.
With ``--fixes CASE ...``, the other way round: a row already in the file keeps its
diagnosis, and those fixes of its program are measured (again), each with its own
``date``, after a bare compile checks that the program is the one the row diagnosed: after
a fix is added or changed, at the cost of the fixes' compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import re
import sys
import time
import traceback
from typing import Any

import jax

from runbook import _releases

OUT = pathlib.Path(__file__).resolve().parents[3] / "docs" / "_data" / "corpus" / "real.json"
THRESHOLD = 0.05  # a fix saving at least this share of the total shows its mechanism
TARGETS = ("cpu", "h100", "v5e")


def _compiler(target: str) -> tuple[Any, dict[str, Any]]:
    """The `Target` to compile for (None: this process's CPU) and the compiler options
    every compile of a row is made with (the CPU's accounting)."""
    from runbook import _targets
    from runbook._program import cpu_accounting_options

    t = None if target == "cpu" else _targets.require(target)
    return t, (cpu_accounting_options() if t is None else {})


def evaluate(name: str, target: str, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """One program on one target (``"cpu"``: this process's backend): its row. Given its
    row `measured` before, the fixes' figures are kept from it (see the module's help)."""
    from runbook import _targets
    from runbook._diagnose import diagnose
    from runbook._errors import DoesNotFitError
    from runbook._measure import compile_fn
    from runbook.site.corpus import real

    program = real.get(name)
    t, options = _compiler(target)
    row: dict[str, Any] = {"program": name, "target": target, "jax": jax.__version__}
    with _targets.compiling_for(t):  # meshes built on the target's devices
        fn, args = program.build("authors", False)
        start = time.perf_counter()
        try:
            compile_fn(fn, *args, target=t)
            row["compile_seconds"] = time.perf_counter() - start
        except DoesNotFitError as e:
            row["compile_seconds"] = time.perf_counter() - start
            row["refused"] = {"needed": e.needed, "limit": e.limit}
        d = diagnose(fn, *args, target=t, name=name)
        total = d.report.total
        if measured is not None and total != measured["total"]:
            raise RuntimeError(
                f"{name} on {target} compiles to {total:,} bytes now, {measured['total']:,} "
                "in the row: its compiler changed, so its fixes must be measured again "
                "(without --diagnose-only)"
            )
        whole = total + d.constants
        shares: dict[str, float] = {}
        for f in d.findings:
            if f.case and not f.informational:
                shares[f.case] = max(shares.get(f.case, 0.0), f.bytes / whole if whole else 0.0)
        if measured is not None:  # a detector changes nothing the compiler made of a fix
            fixes = measured["fixes"]
            row["fixes_date"] = measured.get("fixes_date", measured["date"])
        else:
            fixes = {
                case: _fix(build("authors", False), total, t, options)
                for case, build in program.fixes.items()
            }
    row.update(
        total=total,
        backend=d.report.provenance.label(),
        diagnose_seconds=d.seconds,
        named=d.cases,
        shares=shares,
        fixes=fixes,
        diagnosed_refused=d.refused,
        fits=d.fits,
        margin=d.margin,
    )
    return _verdicts(row)


def _verdicts(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with what its fixes' savings make of what it names: expected, missed and false
    alarms."""
    fixes, named = row["fixes"], row["named"]
    row["expected"] = sorted(
        c for c, f in fixes.items() if f.get("saving", 0) >= THRESHOLD * row["total"]
    )
    row["missed"] = sorted(set(row["expected"]) - set(named))
    row["false_alarms"] = sorted(set(named) - set(row["expected"]))
    return row


def refix(name: str, target: str, measured: dict[str, Any], cases: list[str]) -> dict[str, Any]:
    """The row `measured` with the fixes `cases` of its program measured (again), its
    diagnosis kept; a bare compile first checks that the program compiles to the row's
    total."""
    from runbook import _targets
    from runbook.site.corpus import real

    program = real.get(name)
    t, options = _compiler(target)
    with _targets.compiling_for(t):
        bare = _fix(program.build("authors", False), 0, t, options)
        if bare.get("total") != measured["total"]:
            raise RuntimeError(
                f"{name} on {target} compiles to {bare} now, {measured['total']:,} bytes in "
                "the row: diagnose it again with all its fixes (without --fixes)"
            )
        fixes = dict(measured["fixes"])
        for case in cases:
            if case in program.fixes:
                fixes[case] = _fix(program.fixes[case]("authors", False), bare["total"], t, options)
                fixes[case]["date"] = time.strftime("%Y-%m-%d")
    return _verdicts(dict(measured, fixes=fixes))


def _fix(built: tuple[Any, Any], total: int, t: Any, options: dict[str, Any]) -> dict[str, Any]:
    """One fix, compiled as the diagnosis compiles: its total and the bytes it saves. A fix the
    target's compiler refuses as too large is read from the buffer assignment it wrote before
    refusing, as `runbook.diagnose` reads a refused program: the same figures, compared
    alike."""
    from runbook._errors import DoesNotFitError, RunbookError
    from runbook._measure import measure
    from runbook._program import Program

    fixed_fn, fixed_args = built
    try:
        fixed = measure(fixed_fn, *fixed_args, target=t, compiler_options=options)
        return {"total": fixed.total, "saving": total - fixed.total}
    except DoesNotFitError:
        pass
    except RunbookError as e:
        return _error(e)
    try:
        read = Program.compile(
            fixed_fn, *fixed_args, target=t, compiler_options=options, keep_refused=True
        )
    except (DoesNotFitError, RunbookError) as e:  # refused with no assignment written
        return _error(e)
    return {"total": read.total, "saving": total - read.total, "refused": read.refused}


def _error(e: Exception) -> dict[str, str]:
    """A fix's error as its row records it: the message's first line."""
    return {"error": str(e).splitlines()[0][:300]}


def _evaluate_json(
    name: str, target: str, measured: dict[str, Any] | None = None, cases: list[str] | None = None
) -> dict[str, Any]:
    """`evaluate` (or `refix`, given `cases`) in a child process (forced host devices)."""
    if cases is not None and measured is not None:
        return refix(name, target, measured, cases)
    return evaluate(name, target, measured)


def run(
    name: str, target: str, measured: dict[str, Any] | None = None, cases: list[str] | None = None
) -> dict[str, Any]:
    """`evaluate` (or `refix`, given `cases`), in a child with the program's devices where
    the CPU needs them."""
    from runbook import _subprocess
    from runbook.site.corpus import real

    devices = real.get(name).devices
    if target == "cpu" and devices > 1:
        data: dict[str, Any] = _subprocess.call(
            "runbook.site.producers.real_corpus:_evaluate_json",
            devices=devices,
            name=name,
            target=target,
            measured=measured,
            cases=cases,
        )
        return data
    return _evaluate_json(name, target, measured, cases)


def provenance() -> dict[str, Any]:
    """The releases and machine that made the file."""
    from runbook._provenance import Provenance
    from runbook._targets import _version

    p = dataclasses.asdict(Provenance.current())
    for dist in ("flax", "equinox", "optax", "libtpu", "jax-cuda12-plugin"):
        p[dist] = _version(dist)
    return p


def load(path: str | pathlib.Path = OUT) -> dict[str, Any]:
    """The committed file: ``releases`` (each JAX release's provenance), ``threshold``,
    ``programs`` and ``rows`` (one per program, target and release)."""
    data: dict[str, Any] = json.loads(pathlib.Path(path).read_text())
    return data


def release(row: dict[str, Any]) -> str:
    """The JAX release a row was measured with."""
    if "jax" in row:
        return str(row["jax"])
    found = re.search(r"jax (\S+)", row.get("backend", ""))
    return found[1] if found else "?"


def releases(data: dict[str, Any]) -> list[str]:
    """The releases the file holds rows for, newest first."""
    return sorted({release(r) for r in data["rows"]}, key=_releases.release_key, reverse=True)


def _pct(x: float) -> str:
    return f"{x:.0%}"


def table(data: dict[str, Any] | None = None, jax_release: str | None = None) -> Any:
    """Per program and target: what the fixes measured, what diagnose named, its time; for
    one release (default: the newest the file holds)."""
    from runbook._render import Table, fmt_bytes

    data = data or load()
    jax_release = jax_release or releases(data)[0]
    order = {p["name"]: i for i, p in enumerate(data["programs"])}
    rows = []
    chosen = [r for r in data["rows"] if release(r) == jax_release]
    for r in sorted(chosen, key=lambda r: (order.get(r["program"], 99), r["target"])):
        if "error" in r:
            rows.append(
                [r["program"], r["target"], "-", "-", "-", "-", f"error: {r['error'][:80]}"]
            )
            continue
        measured = ", ".join(
            f"{c} {fmt_bytes(f['saving'])}"
            for c, f in sorted(r["fixes"].items())
            if "saving" in f and f["saving"] >= data["threshold"] * r["total"]
        )
        named = ", ".join(f"{c} ({_pct(r['shares'].get(c, 0))})" for c in r["named"]) or "none"
        ratio = r["diagnose_seconds"] / r["compile_seconds"] if r["compile_seconds"] else 0
        rows.append([
            r["program"], r["target"], fmt_bytes(r["total"]), measured or "none", named,
            ", ".join(r["missed"] + [f"{c} ({_alarm(r, c)})" for c in r["false_alarms"]]) or "-",
            f"{ratio:.1f}x",
        ])  # fmt: skip
    p = data["releases"][jax_release]
    return Table(
        ["program", "target", "per device", "fixes that save (measured)", "named (share)",
         "missed / false alarms", "diagnose / compile"],
        rows,
        f"Each program at its authors' scale, compiled without allocating; a mechanism counts "
        f"as present where its fix saves at least {data['threshold']:.0%} of the total. jax "
        f"{p['jax']}, flax {p['flax']}, equinox {p['equinox']}, optax {p['optax']}; made by "
        f"`nox -s real-corpus` on {p['date']} (docs/_data/corpus/real.json).",
    )  # fmt: skip


def untried(row: dict[str, Any]) -> list[str]:
    """The row's false alarms whose fix the program does not carry: named, and counted as
    false alarms, but not measured either way."""
    return [c for c in row.get("false_alarms", []) if c not in row.get("fixes", {})]


def _alarm(row: dict[str, Any], case: str) -> str:
    return "false alarm: no fix tried" if case in untried(row) else "false alarm"


def summary(data: dict[str, Any] | None = None) -> str:
    """Per target, in Markdown: mechanisms present, named, missed, false alarms, and the
    diagnosis's time against a bare compile."""
    import statistics

    data = data or load()
    lines = []
    for target, jax_release in itertools.product(TARGETS, releases(data)):
        mine = [r for r in data["rows"] if r["target"] == target and release(r) == jax_release]
        rows = [r for r in mine if "error" not in r]
        where = f"**{target}**, jax {jax_release}"
        if not rows:
            lines.append(f"- {where}: not measured in this file yet.")
            continue
        present = sum(len(r["expected"]) for r in rows)
        missed = sum(len(r["missed"]) for r in rows)
        alarms = sum(len(r["false_alarms"]) for r in rows)
        unmeasured = sum(len(untried(r)) for r in rows)
        ratios = [
            r["diagnose_seconds"] / r["compile_seconds"] for r in rows if r["compile_seconds"]
        ]
        errors = len(mine) - len(rows)
        lines.append(
            f"- {where}: {len(rows)} programs, {present} mechanisms present by measurement, "
            f"{present - missed} named, {missed} missed, {alarms} false alarm"
            + ("" if alarms == 1 else "s")
            + (f" ({unmeasured} where the program carries no fix to try)" if unmeasured else "")
            + "; diagnose took "
            f"{statistics.median(ratios):.1f}x a bare compile (median), {max(ratios):.1f}x at "
            "most" + (f"; {errors} program(s) failed to compile" if errors else "") + "."
        )
    return "\n".join(lines)


def fix_by_release(data: dict[str, Any], case: str, target: str = "cpu") -> str:
    """In words, per release: in how many programs `case`'s fix saves at least the
    threshold on `target`, of those that carry it."""
    parts = []
    for jax_release in releases(data):
        rows = [
            r for r in data["rows"]
            if r["target"] == target and release(r) == jax_release and "saving" in
            r.get("fixes", {}).get(case, {})
        ]  # fmt: skip
        saving = [r for r in rows if case in r["expected"]]
        parts.append(f"{len(saving)} of {len(rows)} programs at jax {jax_release}")
    return f"{case}'s fix saves memory on {target} in " + ", and in ".join(parts)


def described() -> list[dict[str, Any]]:
    """Each real program as the file records it: the page reads these, and so needs none of
    the programs' libraries."""
    from runbook.site.corpus import real

    return [
        {
            "name": p.name, "model": p.model, "source": p.source,
            "libraries": list(p.libraries), "devices": p.devices, "fixes": list(p.fixes),
        }
        for p in real.programs()
    ]  # fmt: skip


def programs_table(data: dict[str, Any] | None = None) -> Any:
    """Each real program: what it is, its libraries, devices, and the file it rewrites."""
    from runbook._render import Table

    data = data or load()
    return Table(
        ["program", "model", "libraries", "devices", "fixes tried", "rewritten from"],
        [
            [p["name"], p["model"], ", ".join(p["libraries"]), p["devices"],
             ", ".join(p["fixes"]), p["source"]]
            for p in data["programs"]
        ],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from runbook.site.corpus import real

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--programs", nargs="+", default=None)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    again = parser.add_mutually_exclusive_group()
    again.add_argument(
        "--diagnose-only",
        action="store_true",
        help="keep each row's fixes; time and diagnose it again (after a detector changes)",
    )
    again.add_argument(
        "--fixes",
        nargs="+",
        metavar="CASE",
        help="keep each row's diagnosis; measure these fixes of its program (after a fix "
        "is added or changed)",
    )
    again.add_argument(
        "--watch",
        action="store_true",
        help="instead, run the single-device programs' training loops at their tiny scale "
        "under runbook.watch (runbook.site.corpus.watched)",
    )
    a = parser.parse_args(argv)
    if a.watch:
        from runbook.site.corpus import watched

        if a.targets != list(TARGETS) or a.programs or a.out != OUT:
            parser.error(f"--watch runs its own loops on this CPU into {watched.OUT}; it "
                         "takes no --targets, --programs or --out")  # fmt: skip
        print(watched.table(watched.write(provenance())), file=sys.stderr, flush=True)
        return
    kept = a.diagnose_only or a.fixes is not None  # rows that must be in the file already
    names = a.programs or [p.name for p in real.programs()]
    if a.fixes is not None:
        carried = {case for name in names for case in real.get(name).fixes}
        if not set(a.fixes) <= carried:
            parser.error(
                f"no program chosen carries a fix for "
                f"{', '.join(sorted(set(a.fixes) - carried))}; they carry: "
                f"{', '.join(sorted(carried))}"
            )
    old = json.loads(a.out.read_text()) if a.out.exists() else {"rows": []}
    rows = {(r["program"], r["target"], release(r)): r for r in old["rows"]}
    releases = dict(old.get("releases", {}))
    releases[jax.__version__] = provenance()
    for target in a.targets:
        for name in names:
            print(f"{name} on {target} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            measured = rows.get((name, target, jax.__version__)) if kept else None
            if kept and (measured is None or "error" in measured):
                print(f"  no measured row to keep: {name} on {target} skipped",
                      file=sys.stderr, flush=True)  # fmt: skip
                continue
            try:
                row = run(name, target, measured, a.fixes)
            except Exception as e:  # noqa: BLE001 - recorded, and the next program goes on
                traceback.print_exc()
                if measured is not None:
                    continue  # the measured row stands
                row = {"program": name, "target": target, "jax": jax.__version__,
                       "error": f"{type(e).__name__}: {e}"}  # fmt: skip
            if a.fixes is None:  # a row's own seconds and date are its diagnosis's
                row["wall_seconds"] = time.perf_counter() - start
                row["date"] = time.strftime("%Y-%m-%d")
            rows[name, target, jax.__version__] = row
            print(json.dumps(row)[:400], file=sys.stderr, flush=True)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            data = {
                "releases": releases,
                "threshold": THRESHOLD,
                "programs": described(),
                "rows": list(rows.values()),
            }
            a.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
