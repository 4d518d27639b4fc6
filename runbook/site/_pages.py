"""Tables a case page shows beside its own measurements: fixes, same-result checks, and how
XLA:CPU's YNNPACK fusion changes the accounting. Each is one call on a page."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .. import _subprocess
from .._case import CaseResult, get_case, measure_case
from .._measure import YNN_OPTION
from .._render import Table, fmt_bytes, provenance_label
from .._runtime import agreement, runtime_peak


def _params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def cited_reports_table(reports: Mapping[str, str], ours: Sequence[str], caption: str) -> Table:
    """What each cited report said beside what this build measures, one row a report."""
    rows = [[name, said, got] for (name, said), got in zip(reports.items(), ours, strict=True)]
    return Table(["report", "what it reported", "what we measure"], rows, caption)


def fix_table(result: CaseResult, *, at: Mapping[str, Any] | None = None) -> Table:
    """Each fix beside the reproduction at the same grid point: total, floor, saving.

    Args:
        result: the case measured (`measure_case`).
        at: only grid points whose params include these (default: every point).
    """
    case = get_case(result.case)
    rows, shown = [], []
    for r in result.reports:
        if r.role == "baseline" or (at and any(r.params.get(k) != v for k, v in at.items())):
            continue
        shown.append(r)
        repro = result.select(role="reproduction", **r.params)
        saving = f"{repro[0].total / r.total:.2f}x" if repro and r.role == "fix" else "-"
        mark = " (recommended)" if r.name == case.recommended else ""
        rows.append(
            [r.name + mark, _params(r.params), fmt_bytes(r.total), fmt_bytes(r.lower_bound),
             f"{r.overhead:.4f}x", saving]
        )  # fmt: skip
    return Table(
        ["variant", "params", "total", "floor", "total / floor", "reproduction / this"],
        rows,
        f"Compile time, per device, scale {result.scale!r}. The floor is the case's analytic "
        f"lower bound (else arguments + outputs) for the compiler that built the program. "
        f"{provenance_label(shown) if shown else result.provenance.label()}.",
    )


def compare_variants(result: CaseResult, names: Sequence[str], x: str) -> Table:
    """Totals of the variants `names` side by side at each value of param `x`."""
    points = sorted({r.params[x] for r in result.reports if r.name in names})
    rows = []
    for point in points:
        totals = [result.select(n, **{x: point}) for n in names]
        cells = [fmt_bytes(t[0].total) if t else "-" for t in totals]
        same = len({t[0].total for t in totals if t}) == 1 and all(totals)
        rows.append([point, *cells, "yes" if same else "no"])
    return Table(
        [x, *names, "equal?"],
        rows,
        f"Compile-time totals per device. "
        f"{provenance_label([r for r in result.reports if r.name in names])}.",
    )


def verify_table(checks: Sequence[Mapping[str, Any]], case: str, scale: str | None = None) -> Table:
    """The same-result checks `runbook.verify` made, one row per fix and grid point.

    Checks of values show each fix's largest elementwise error against the tolerance;
    checks of distributions (a case with a significance) the two-sample Kolmogorov-Smirnov
    test's statistic and p-value against the significance level.
    """
    c = get_case(case)
    scale = scale or c.runnable_scale
    where = f"Real arrays at scale {scale!r} ({_params(c.scale(scale))})"
    if any(ch.get("compared") == "distribution" for ch in checks):
        rows = [
            [ch["name"], _params(ch["params"]), " vs ".join(map(str, dict.fromkeys(ch["sizes"]))),
             f"{ch['ks_statistic']:.2e}", f"{ch['p_value']:.3g}", f"{ch['tolerance']:g}",
             "yes" if ch["same"] else "NO"]
            for ch in checks
        ]  # fmt: skip
        columns = ["numbers tested", "KS statistic", "p-value", "significance"]
        return Table(
            ["fix", "params", *columns, "same distribution?"],
            rows,
            f"{where}; each fix's numbers and the reproduction's are compared as samples of a "
            "distribution by a two-sample Kolmogorov-Smirnov test (statistic: the largest gap "
            "between the two empirical CDFs; at most 2**24 numbers each, an even stride of them "
            "past that): the same unless the test rejects at the significance level (a p-value "
            "below it).",
        )
    rows = [
        [ch["name"], _params(ch["params"]), f"{ch['max_rel_error']:.1e}", f"{ch['tolerance']:.0e}",
         "yes" if ch["same"] else "NO"]
        for ch in checks
    ]  # fmt: skip
    return Table(
        ["fix", "params", "max relative error", "tolerance", "same result?"],
        rows,
        f"{where}; error = max |fix - reproduction| / (|reproduction| + 1), elementwise.",
    )


def _runnable_point(case: str, scale: str, at: Mapping[str, Any] | None) -> dict[str, Any]:
    """The grid point of `scale` that agrees with `at` wherever both name a param."""
    c = get_case(case)
    grid = c.grid(c.scale(scale))
    for point in grid:
        if all(point.get(k, v) == v for k, v in (at or {}).items()):
            return dict(point)
    return dict(grid[0])


def ynn_accounting(
    case: str,
    variants: Sequence[str],
    *,
    at: Mapping[str, Any] | None = None,
    run_scale: str | None = None,
    run_at: Mapping[str, Any] | None = None,
) -> Table:
    """Does XLA:CPU's YNNPACK fusion avoid memory, or hide memory that is used?

    Each variant is compiled at seed scale with XLA's defaults and with YNN fusion off, then
    run for real at a runnable scale both ways. The unfused program accounts for H more
    bytes; if the fused program's real peak is at least H/2 below the unfused program's,
    the fusion really does without that memory, else it hides memory that is in use.

    Args:
        case: a case name.
        variants: the variants to check.
        at: the seed-scale grid point (default: the first).
        run_scale: the scale run for real (default: the case's runnable scale); choose one
            where H is well above the few MiB a real peak's measurement varies by.
        run_at: its grid point (default: the one agreeing with `at`).
    """
    c = get_case(case)
    off = {YNN_OPTION: ""}
    at = dict(at) if at is not None else dict(c.grid(c.scale("seed"))[0])
    run_scale = run_scale or c.runnable_scale
    run_at = dict(run_at) if run_at is not None else _runnable_point(case, run_scale, at)
    try:
        compiled = {
            label: measure_case(case, "seed", compiler_options=o, variants=variants, at=at)
            for label, o in (("defaults", {}), ("off", off))
        }
    except _subprocess.ChildCrashed as e:  # a finding about this jaxlib, not a broken page
        return Table(["variant", "verdict"], [[", ".join(variants), _subprocess.failure(e)]],
                     f"Compiled at scale 'seed' ({_params(at)}) with XLA's defaults and with "
                     f"compiler_options={{{YNN_OPTION!r}: ''}}.")  # fmt: skip
    rows = []
    method = ""
    for name in variants:
        fused, unfused = (compiled[label].select(name)[0] for label in ("defaults", "off"))
        d, u = (
            runtime_peak(case, name, scale=run_scale, params=run_at, compiler_options=o, repeats=1)
            for o in ({}, off)
        )
        method = d.method
        hidden = u.predicted - d.predicted
        if hidden <= 0:
            verdict = "same accounting"
        elif u.measured - d.measured >= hidden / 2:
            verdict = (
                f"the fusion does without it (runs {fmt_bytes(u.measured - d.measured)} lower)"
            )
        else:
            verdict = "the fusion hides memory in use"
        rows.append(
            [name, fmt_bytes(fused.total), fmt_bytes(unfused.total),
             f"{fmt_bytes(d.predicted)} / {fmt_bytes(d.measured)}",
             f"{fmt_bytes(u.predicted)} / {fmt_bytes(u.measured)}", verdict]
        )  # fmt: skip
    return Table(
        ["variant", "seed: XLA defaults", "seed: YNN fusion off",
         "run: defaults, predicted / measured", "run: YNN off, predicted / measured",
         "verdict"],
        rows,
        f"Compile-time totals per device at scale 'seed' ({_params(at)}); real runs at scale "
        f"{run_scale!r} ({_params(run_at)}) in fresh processes ({method}; agreement: "
        f"{agreement()}). YNN fusion off: compiler_options={{{YNN_OPTION!r}: ''}}. "
        f"{compiled['defaults'].provenance.label()}.",
    )  # fmt: skip


def bench_report(path: str | None = None) -> list[Any]:
    """The committed benchmark (``nox -s bench``), as tables; a note when there is none."""
    import json
    import pathlib

    from ._history import DATA_DIR, Note

    file = pathlib.Path(path) if path else DATA_DIR / "bench" / "bench.json"
    if not file.exists():
        return [Note("No benchmark has been committed yet: run `nox -s bench`.")]
    data = json.loads(file.read_text())
    load = data.get("load_average")
    where = (
        f"jax {data['jax']} / jaxlib {data['jaxlib']}, {data['host']['cpu']} "
        f"({data['host']['cores']} cores), {data['generated']}"
        + (f"; load average {load['start'][0]} at the start, {load['end'][0]} at the end"
           if load else "")
    )  # fmt: skip
    seconds = data["measure_case_seconds"]
    wheres = list(dict.fromkeys(w for row in seconds.values() for w in row))
    items: list[Any] = [
        Table(
            ["case", *wheres],
            [[c, *(f"{row.get(w, '-')} s" for w in wheres)] for c, row in seconds.items()],
            f"Seconds to measure every program of each case at seed scale, per compiler, "
            f"nothing cached. {where}.",
        ),
        Table(
            [
                "case",
                "program",
                "bare compile",
                "measure",
                "measure / bare",
                "measure with buffers / bare",
                "diagnose / bare",
            ],
            [
                [
                    c,
                    r["program"],
                    f"{r['bare_compile_seconds']:.3f} s",
                    f"{r['measure_seconds']:.3f} s",
                    f"{r['measure_ratio']:.2f}x",
                    f"{r['measure_buffers_ratio']:.2f}x",
                    f"{r['diagnose_ratio']:.2f}x" if "diagnose_ratio" in r else "-",
                ]
                for c, r in data["measure_overhead"].items()
            ],
            "runbook.measure and runbook.diagnose against a bare "
            "jax.jit(f).lower(...).compile() of the same program, interleaved, best of three, "
            "JAX's in-memory caches emptied before each so that every one compiles.",
        ),
        Table(
            ["case", "scale", "run time / the reproduction's, per variant"],
            [
                [
                    c,
                    r["scale"],
                    ", ".join(f"{k} {v:.2f}x" for k, v in r["ratio_to_reproduction"].items()),
                ]
                for c, r in data["fix_runtimes"].items()
            ],
            "Each variant executed for real in a fresh process; the fastest of up to three timed "
            "runs, fewer once they add up to a second.",
        ),
    ]
    builds = data.get("docs_build_seconds")
    if builds:
        items.append(
            Table(
                ["docs build", "seconds"],
                [[k, str(v)] for k, v in builds.items()],
                "docs/_tools/build_site.py (as nox -s docs and Read the Docs run it, its "
                "measurement pre-pass included) in a copy of the repository; cold = empty build "
                "folder and measurement cache.",
            )
        )
    items.extend(_profile_tables(data))
    return items


def _profile_tables(data: dict[str, Any]) -> list[Any]:
    """Where the cold build's seconds went (``nox -s bench``'s profile), and its projection."""
    from ._history import Note

    found = data.get("docs_profile")
    if not found:
        return []
    pages = data.get("docs_page_seconds", {})
    prepared = data.get("docs_prepare_seconds", {})
    made = found["by_page"]
    shared = found["used_by_several_pages"]
    items: list[Any] = [
        Table(
            [
                "page",
                "executed",
                "its calls, in the pre-pass",
                "measuring it did itself",
                "entries it made",
            ],
            [
                [
                    p,
                    f"{pages.get(p, 0):.1f} s",
                    f"{prepared[p]:.1f} s" if p in prepared else "-",
                    f"{made.get(p, {}).get('seconds', 0):.1f} s",
                    str(made.get(p, {}).get("entries", 0)),
                ]
                for p in dict.fromkeys([*pages, *made])
            ],
            f"The cold build, page by page: how long each executed, how long the calls it "
            f"declares took in the pre-pass, before the pages ran, and the seconds of the "
            f"measurements it computed itself, in either (compiles, real runs), from the "
            f"{found['entries']:,} entries of the measurement cache it filled. "
            f"{shared['entries']} entries were used again by another page, saving "
            f"{shared['seconds_saved']:.0f} s.",
        ),
        Table(
            ["compiled for", "seconds", "entries"],
            [
                [k, f"{v['seconds']:.1f} s", str(v["entries"])]
                for k, v in found["by_target"].items()
            ],
            "The same seconds by the compiler they were measured with (this machine's backend, "
            "or a target compiled for without the device).",
        ),
    ]
    projected = data.get("docs_projection")
    if projected:
        items.append(
            Note(
                f"Projected cold build with {projected['cases']} cases: "
                f"{projected['seconds']:.0f} s on {projected['cores']} cores (each new case page "
                f"costing today's median, {projected['median_case_page_seconds']:.0f} s; the "
                f"pages that read every case growing in proportion)."
            )
        )
    return items
