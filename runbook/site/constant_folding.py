"""The `constant-folding` page's measurements: a real compile and run in a fresh process
(`runbook.runs.constant_folding`), a sweep over sizes, what the compilers' analyses say, the
claims, the tables and the chart. The case itself (the reproduction, the fixes, their
inputs) is `runbook.cases.constant_folding`, which this module measures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp

from .. import _cache, _subprocess
from .._case import CaseResult
from .._errors import RunbookError
from .._host import settle, status
from .._measure import MemoryReport, measure
from .._quiet import start_backend
from .._render import Table, fmt_bytes
from .._subprocess import one_line
from ..cases.constant_folding import CASE, floor_bytes, table_bytes
from ..runs import constant_folding as runs
from ..runs.constant_folding import reset_peak, run_figures
from ._claims import Claim, verdict
from ._pages import cited_reports_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# What the reports say, in our words; ours is measured beside it (`reports_table`).
REPORTS = {
    "jax-ml/jax#14655": "a large sparse matrix's index array built inside jit: compiling "
    "takes about a minute where running without jit takes a tenth of a second; XLA says "
    "constant folding is slow",
    "jax-ml/jax#12789": "an array made with jnp.ones inside jit, then updated in place: XLA "
    "folds the update while compiling, which makes compiling much slower",
    "jax-ml/jax#21300": "XLA's 'Constant folding an instruction is taking > 1s' warning "
    "appears for a jitted function of no argument; switching the pass off through "
    "compiler_options is the suggested way out",
    "jax-ml/jax#18475": "a large, cheap expression of jnp.arange is folded into a constant "
    "(the maintainers could not see it folded)",
    "jax-ml/jax#19653": "cited by the issue for this case; its text was not available to us, "
    "so no claim is taken from it",
    "jax-ml/jax#677": "cited by the issue for this case; its text was not available to us, "
    "so no claim is taken from it",
}

# A compile quicker than this may hold no single fold over XLA's one-second alarm.
QUICK_COMPILE_SECONDS = 2.0

# The figures a real run measures (`Case.figures`): `runbook.runs.constant_folding`'s.
FIGURES = runs.FIGURES

RECOMMENDED = CASE.recommended or "table-from-argument"
REPRO = "table-inside-jit"
OPTION = "no-constant-folding"
KEY_FIGURE = CASE.key_figure or "compile_seconds"


def _sweep_json(sizes: list[list[int]]) -> list[dict[str, Any]]:
    """In a fresh process: the reproduction and the recommended fix compiled at each size
    (rows, cols), smallest first: compile seconds and the resident peak while compiling."""
    start_backend()
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(8)))
    rows = []
    for r, c in sizes:
        s = {"rows": r, "cols": c}
        for name in (REPRO, RECOMMENDED):
            v = CASE.variant(name)
            args = CASE.inputs(v, s, {}, False)
            base = settle()
            reset_peak()
            start = time.perf_counter()
            jitted: Any = v.program(s)
            jitted.lower(*args).compile()
            seconds = time.perf_counter() - start
            rows.append({"name": name, "elements": r * c, "table": table_bytes(s),
                         "compile_seconds": seconds, "rss_compile_peak": status("VmHWM") - base})  # fmt: skip
    return rows


SWEEP = [[256, 4096], [1024, 4096]]


def sweep(sizes: list[list[int]] | None = None) -> list[dict[str, Any]]:
    """`_sweep_json` in a fresh process, cached; sizes below the seed scale's."""
    sizes = sizes or SWEEP
    rows: list[dict[str, Any]] = _cache.cached(
        {"kind": "constant-folding-sweep", "sizes": sizes},
        lambda: _subprocess.call(
            "runbook.site.constant_folding:_sweep_json", timeout=300, sizes=sizes
        ),
        module=__name__,
    )
    return rows


WATCH_STEPS = 4  # past the watch's warm-up, on the watch page


def watched_loop(variant: str, steps: int, mark_step: Callable[[], None]) -> None:
    """Run `variant` at the runnable scale for `steps` calls (the first compiles), calling
    `mark_step()` after each: a loop for `runbook.watch` to follow."""
    v = CASE.variant(variant)
    s = CASE.scales[CASE.runnable_scale]
    params = CASE.grid(s)[0]
    fn = v.program(params)
    args = CASE.inputs(v, s, params, True)
    for _ in range(steps):
        jax.block_until_ready(fn(*args))
        mark_step()


def constant_bytes(report: MemoryReport) -> int:
    """Bytes of the constants in a report's buffer assignment (measured with ``buffers=True``)."""
    return sum(b.size for b in report.buffers if b.kind == "constant")


def _cell(f: Mapping[str, float], name: str) -> str:
    if name not in f:
        return "-"
    value = f[name]
    if name == "run_seconds":
        return f"{value * 1e3:.1f} ms"
    if name.endswith("_seconds"):
        return f"{value:.2f} s" + (" (stopped)" if f.get("unfinished_count") else "")
    return f"{int(value):,}" if name.endswith("_count") else fmt_bytes(value)


def run_table(result: CaseResult) -> Table:
    """Each variant's real compile and run beside what memory_analysis totals."""
    fix = result.figures_of(RECOMMENDED)[KEY_FIGURE]
    rows = []
    for r in result.reports:
        f = r.figures
        rows.append(
            [r.name, fmt_bytes(r.total), _cell(f, "compile_seconds"),
             f"{f[KEY_FIGURE] / fix:.1f}x", _cell(f, "rss_compile_peak"),
             _cell(f, "rss_compiled"), _cell(f, "rss_run_peak"), _cell(f, "run_seconds"),
             _cell(f, "fold_warning_count")]
        )  # fmt: skip
    return Table(
        ["variant", "memory_analysis total", "compile", f"compile / {RECOMMENDED}'s",
         "resident peak: compiling", "resident: compiled", "resident peak: calls",
         "one call", "XLA's slow-folding warnings"],
        rows,
        f"Each variant in a fresh process, scale {result.scale!r} (table "
        f"{fmt_bytes(table_bytes(CASE.scales[result.scale]))}): resident set above the "
        f"process before its inputs were made. {result.provenance.label()}.",
    )  # fmt: skip


def analysis(scale: str = "tiny") -> dict[str, int]:
    """What memory_analysis says of the reproduction and the fix at `scale` (compiled here,
    with buffers): their totals, and the constants the reproduction's buffer assignment
    holds, beside the table's bytes."""
    s = CASE.scales[scale]
    params = CASE.grid(s)[0]
    repro, fix = (
        measure(v.program(params), *CASE.inputs(v, s, params, False), buffers=True)
        for v in (CASE.variant(REPRO), CASE.variant(RECOMMENDED))
    )
    return {"table": table_bytes(CASE.scales[scale]), "repro_total": repro.total,
            "fix_total": fix.total, "repro_constants": constant_bytes(repro),
            "fix_constants": constant_bytes(fix)}  # fmt: skip


def iota_expression(n: int = 1 << 20) -> dict[str, int]:
    """jax-ml/jax#18475's expression, ``x + jnp.where(jnp.arange(n) == 5, 1, 2)``, compiled
    here: the constants its buffer assignment holds beside the array's bytes."""
    fn = jax.jit(lambda x: x + jnp.where(jnp.arange(n) == 5, 1, 2))
    r = measure(fn, jax.ShapeDtypeStruct((), jnp.int32), buffers=True)
    return {"bytes": n * 4, "constants": constant_bytes(r)}


def reports_table(result: CaseResult, cheap: Mapping[str, int]) -> Table:
    """What each report says beside the figure we measure for the same effect.

    `cheap` is `iota_expression()`.
    """
    r = result.figures_of(REPRO)
    e = result.figures_of(RECOMMENDED)
    o = result.select(OPTION)
    option = (
        f"compile {_cell(o[0].figures, 'compile_seconds')} with the pass off against "
        f"{_cell(r, 'compile_seconds')}"
        if o and o[0].figures
        else "jax.jit takes no compiler_options in this JAX"
    )
    ours = [
        (
            f"compile {_cell(r, 'compile_seconds')} with the table built inside jit, "
            f"{_cell(e, 'compile_seconds')} with it built from an argument"
        ),
        (
            f"resident peak while compiling {fmt_bytes(r['rss_compile_peak'])} against "
            f"{fmt_bytes(e['rss_compile_peak'])} (the table is "
            f"{fmt_bytes(table_bytes(CASE.scales[result.scale]))})"
        ),
        (
            f"{int(r['fold_warning_count'])} slow-folding warning(s) compiling the reproduction, "
            f"{int(e['fold_warning_count'])} for the fix; {option}"
        ),
        (
            f"{fmt_bytes(cheap['constants'])} of constants compiled for a "
            f"{fmt_bytes(cheap['bytes'])} jnp.where(jnp.arange(...)) expression"
        ),
        "-",
        "-",
    ]
    return cited_reports_table(
        REPORTS,
        ours,
        f"{result.provenance.label()}; real compiles and runs, {result.scale} scale.",
    )


def _figures_here(scale: str) -> tuple[dict[str, Mapping[str, float]], str | None]:
    """Each available variant's run figures at `scale`, without compiling it in this
    process (a folding compile may take minutes on some releases: the child is stopped);
    and why this JAX refused the XLA option, where it did."""
    s = CASE.scales[scale]
    params = CASE.grid(s)[0]
    out: dict[str, Mapping[str, float]] = {}
    refused = None
    for v in CASE.variants:
        if not CASE.available(v):
            continue
        try:
            out[v.name] = run_figures(v, s, params)
        except RunbookError as e:
            if v.name != OPTION:
                raise
            # jax 0.4.38 and 0.5.3 take compiler_options but refuse this one (a repeated
            # field of XLA's options): the option's claims say why they are not decided.
            refused = one_line(str(e).strip().splitlines()[-1])  # the error, not the banner
    return out, refused


def _warning_verdict(repro: Mapping[str, float], fix: Mapping[str, float]) -> str:
    """The alarm is a timer (one second): a whole compile under `QUICK_COMPILE_SECONDS`
    that logged nothing folded too quickly to decide it here."""
    if repro["fold_warning_count"] >= 1:
        return verdict(fix["fold_warning_count"] == 0)
    if repro["compile_seconds"] < QUICK_COMPILE_SECONDS:
        return "not reproducible here"
    return "refuted"


def option_note(result: CaseResult) -> str:
    """What switching the pass off costs at run time here, in a sentence from `result`."""
    found = result.select(OPTION)
    if not found:
        return "This JAX's jax.jit takes no compiler_options: the option is not measured here."
    o, e = found[0], result.one(RECOMMENDED)
    if o.total > 1.1 * e.total:
        return (
            f"With the pass off, this XLA keeps the table's steps apart at run time, each "
            f"written out whole: memory_analysis totals {fmt_bytes(o.total)} against "
            f"{fmt_bytes(e.total)} for {RECOMMENDED}, and one call takes "
            f"{o.figures['run_seconds'] * 1e3:.1f} ms against "
            f"{e.figures['run_seconds'] * 1e3:.1f} ms."
        )
    return (
        f"With the pass off, this XLA compiles the table as {RECOMMENDED} does: "
        f"memory_analysis totals {fmt_bytes(o.total)} against {fmt_bytes(e.total)}."
    )


def result_totals(result: CaseResult | None, scale: str) -> tuple[int, int]:
    """memory_analysis totals of the recommended fix and of the pass-off variant at `scale`
    (from `result`, else compiled here: neither folds, so both compile fast)."""
    if result is not None:
        return result.one(RECOMMENDED).total, result.one(OPTION).total
    s = CASE.scales[scale]
    params = CASE.grid(s)[0]
    totals = []
    for name in (RECOMMENDED, OPTION):
        v = CASE.variant(name)
        totals.append(measure(v.program(params), *CASE.inputs(v, s, params, False)).total)
    return totals[0], totals[1]


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The claims of the reports and of common advice, decided by measurement.

    Compile time and host memory are measured by real compiles on this machine: for a
    target there is no run (`RunbookError`). Without `result`, each variant is compiled in
    a child that is stopped after `runbook.runs.constant_folding.COMPILE_LIMIT_SECONDS`
    (older XLAs fold far slower), and memory_analysis is read at the tiny scale.
    """
    if target is not None:
        raise RunbookError(
            f"no run figures for {target}: they are measured on this machine's backend only"
        )
    refused = None
    if result is not None:
        figs: Mapping[str, Mapping[str, float]] = {r.name: r.figures for r in result.reports}
        scale = result.scale
        refused = next((one_line(s["reason"]) for s in result.skipped
                        if s["name"] == OPTION and s["status"] == "failed"), None)  # fmt: skip
    else:
        figs, refused = _figures_here(scale)
    seen = analysis("tiny")
    cheap = iota_expression()
    r, e = figs[REPRO], figs[RECOMMENDED]
    o = figs.get(OPTION)
    table = table_bytes(CASE.scales[scale])
    slow = r["compile_seconds"] >= 3 * e["compile_seconds"]
    found = [
        Claim(
            "compile-slow",
            "A large array built inside jit from no argument makes compiling slow "
            "(jax-ml/jax#14655, #12789).",
            verdict(slow),
            f"compile {_cell(r, 'compile_seconds')} with the table ({fmt_bytes(table)}) built "
            f"inside jit, {_cell(e, 'compile_seconds')} with it built from an argument "
            f"({r['compile_seconds'] / e['compile_seconds']:.1f}x).",
        ),
    ]
    if "rss_compile_peak" in r:
        grown = r["rss_compile_peak"] - e["rss_compile_peak"]
        found.append(
            Claim(
                "compile-memory",
                "Compiling it makes the host's memory grow by more than the array.",
                verdict(grown >= table),
                f"resident peak while compiling {fmt_bytes(r['rss_compile_peak'])} against "
                f"{fmt_bytes(e['rss_compile_peak'])} for the fix: {grown / table:.1f}x the "
                f"table more; after compiling, {fmt_bytes(r['rss_compiled'])} against "
                f"{fmt_bytes(e['rss_compiled'])} (the executable holds the folded table).",
            )
        )
    else:
        found.append(
            Claim(
                "compile-memory",
                "Compiling it makes the host's memory grow by more than the array.",
                "not reproducible here",
                f"the compile was stopped after {_cell(r, 'compile_seconds')}: no peak read.",
            )
        )
    found.append(
        Claim(
            "warning",
            "XLA logs 'Constant folding an instruction is taking > 1s' while compiling it "
            "(jax-ml/jax#21300, #12789, #14655).",
            _warning_verdict(r, e),
            f"{int(r['fold_warning_count'])} warning(s) on stderr compiling the reproduction "
            f"(compile {_cell(r, 'compile_seconds')}), {int(e['fold_warning_count'])} for "
            "the fix. The alarm is a timer: a fold under a second logs nothing.",
        )
    )
    if o is None:
        found.append(
            Claim(
                "option",
                "Compiling with xla_disable_hlo_passes=constant_folding avoids the slow "
                "compile (jax-ml/jax#21300).",
                "not reproducible here",
                f"this JAX refused the option: {refused}"
                if refused
                else "jax.jit takes no compiler_options in this JAX.",
            )
        )
    else:
        found.append(
            Claim(
                "option",
                "Compiling with xla_disable_hlo_passes=constant_folding avoids the slow "
                "compile (jax-ml/jax#21300).",
                verdict(
                    o["compile_seconds"] <= r["compile_seconds"] / 3
                    and o["fold_warning_count"] == 0
                ),
                f"compile {_cell(o, 'compile_seconds')} with the pass off, "
                f"{_cell(r, 'compile_seconds')} with it on; "
                f"{int(o['fold_warning_count'])} warning(s).",
            )
        )
    if o is not None and "run_seconds" in o:
        fix_total, option_total = result_totals(result, scale)
        found.append(
            Claim(
                "option-free",
                "Switching constant folding off costs no more memory than building the "
                "table from an argument.",
                verdict(option_total <= 1.1 * fix_total),
                f"memory_analysis total {fmt_bytes(option_total)} with the pass off against "
                f"{fmt_bytes(fix_total)} for {RECOMMENDED}; one call "
                f"{o['run_seconds'] * 1e3:.1f} ms against {e['run_seconds'] * 1e3:.1f} ms; "
                f"resident peak over the calls {fmt_bytes(o['rss_run_peak'])} against "
                f"{fmt_bytes(e['rss_run_peak'])}."
                + (
                    " With the pass off, this XLA keeps the table's steps apart at run "
                    "time, each written out whole."
                    if option_total > 1.1 * fix_total
                    else ""
                ),
            )
        )
    found += [
        Claim(
            "analysis-shows",
            "memory_analysis() shows what the folded array costs.",
            verdict(seen["repro_total"] - seen["fix_total"] >= seen["table"]),
            f"at the tiny scale (table {fmt_bytes(seen['table'])}): total "
            f"{fmt_bytes(seen['repro_total'])} folded, {fmt_bytes(seen['fix_total'])} for the "
            f"fix; the folded table is a constant of "
            f"{fmt_bytes(seen['repro_constants'])} in the buffer assignment, outside the "
            "total. Neither the compile's time nor its host memory is in it.",
        ),
        Claim(
            "iota-folded",
            "A large, cheap expression of jnp.arange is folded into a constant (jax-ml/jax#18475).",
            verdict(cheap["constants"] >= cheap["bytes"]),
            f"{fmt_bytes(cheap['constants'])} of constants in the compiled program for a "
            f"{fmt_bytes(cheap['bytes'])} expression: XLA does not fold an iota.",
        ),
    ]
    return found


def sweep_table(rows: list[dict[str, Any]]) -> Table:
    """`sweep()` as a table: each size's compile time and compile peak, both variants."""
    by = {(x["name"], x["elements"]): x for x in rows}
    sizes = sorted({x["elements"] for x in rows})
    out = []
    for n in sizes:
        a, b = by[(REPRO, n)], by[(RECOMMENDED, n)]
        out.append([fmt_bytes(a["table"]), f"{a['compile_seconds']:.2f} s",
                    f"{b['compile_seconds']:.2f} s", fmt_bytes(a["rss_compile_peak"]),
                    fmt_bytes(b["rss_compile_peak"])])  # fmt: skip
    return Table(
        ["table", f"compile: {REPRO}", f"compile: {RECOMMENDED}", f"compile peak: {REPRO}",
         f"compile peak: {RECOMMENDED}"],
        out,
        "Compiled one after another in one fresh process; resident peak above the process "
        "before each compile.",
    )  # fmt: skip


def sweep_chart(rows: list[dict[str, Any]], result: CaseResult, ax: Any = None) -> Figure:
    """Compile seconds against the table's size, both variants; the seed scale's run added."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    seed_table = table_bytes(CASE.scales[result.scale])
    for name, marker in ((REPRO, "o"), (RECOMMENDED, "s")):
        pts = sorted((x["table"], x["compile_seconds"]) for x in rows if x["name"] == name)
        pts.append((seed_table, result.figures_of(name)["compile_seconds"]))
        ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], marker=marker, label=name)
    ax.set_xlabel("table (MiB)")
    ax.set_ylabel("compile (s)")
    ax.legend(fontsize=8)
    ax.set_title(f"{result.provenance.label()}", fontsize=9)
    return cast("Figure", ax.figure)


def floor_table(results: Mapping[str, CaseResult]) -> Table:
    """Per compiler (`runbook.site.on_targets` results, with buffers): each variant's
    memory_analysis total against its floor, and the constants it holds."""
    rows = []
    for where, res in results.items():
        for r in res.reports:
            floor = floor_bytes(CASE.scales[res.scale])
            rows.append([where, r.name, fmt_bytes(r.total), fmt_bytes(floor),
                         f"{r.total / floor:.2f}x", fmt_bytes(constant_bytes(r))])  # fmt: skip
    return Table(
        ["compiled for", "variant", "memory_analysis total", "floor", "total / floor",
         "constants (not in the total)"],
        rows,
        "Compile time only: targets are compiled by each target's compiler, without the "
        "device. The floor: x and the output (a table computed at run time can be computed "
        "where it is used).",
    )  # fmt: skip
