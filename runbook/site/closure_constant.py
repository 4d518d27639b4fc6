"""The `closure-constant` page's measurements: a real run's host memory (measured by
`runbook.runs.closure_constant`), the claims, the tables and the chart. The case itself (the
reproduction, the fix, their inputs) is `runbook.cases.closure_constant`, which this module
measures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
from jax import lax

from .._case import CaseResult, measure_case, measured_here
from .._measure import MemoryReport, measure
from .._quiet import start_backend
from .._render import Table, fmt_bytes
from ..cases import closure_constant
from ..cases.closure_constant import _ids, floor_bytes, lookup, make_lookup_captured, sizes, table
from ..runs import closure_constant as runs
from ._claims import Claim, verdict
from ._history import Note
from ._pages import cited_reports_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# What the reports say, as the issue summarises them; ours is measured beside it.
REPORTS = {
    "jax-ml/jax#282": "the jit cache keeps memory alive (open since 2019)",
    "jax-ml/jax#11448, #12719": "arrays captured inside loops and `cond` become constants too",
    "jax-ml/jax#16278": "out of memory only when the array is captured; zeros work fine",
    "jax-ml/jax#23457": "an embedding table on CPU: about 3.8 GB resident when zeros, about "
    "39 GB when random",
    "jax-ml/jax#10596": "the advice: pass the array as a parameter",
    "jax-ml/jax#19429": "`jax.clear_caches()` to free the memory",
}

# jax-ml/jax#23457's resident sets, as reported (not measured here).
REPORTED_GB = {"zeros": 3.8, "random": 39.0}

# The figures a real run measures (`Case.figures`): `runbook.runs.closure_constant`'s.
FIGURES = runs.FIGURES

RECOMMENDED = "embed"
KEY_FIGURE = closure_constant.CASE.key_figure or "rss_peak"


def constant_bytes(report: MemoryReport) -> int:
    """Bytes of the constants in a report's buffer assignment (measured with ``buffers=True``)."""
    return sum(b.size for b in report.buffers if b.kind == "constant")


def control_flow_programs(scale_name: str = "small") -> list[tuple[str, Any]]:
    """jax-ml/jax#11448 and #12719's patterns: the random table captured inside a loop body
    and inside both branches of a `cond`, each as (label, jitted function of the ids)."""
    start_backend()  # the first JAX call of a page may be here: plugins' chatter filtered
    s = closure_constant.CASE.scales[scale_name]
    t = table("random", s["vocab"], s["dim"])

    def in_loop(ids: jax.Array) -> jax.Array:
        def body(i: jax.Array, acc: jax.Array) -> jax.Array:
            return acc + lookup(t, (ids + i) % s["vocab"])

        rows: jax.Array = lax.fori_loop(
            0, 4, body, jnp.zeros((ids.shape[0], s["dim"]), jnp.float32)
        )
        return rows

    def in_cond(ids: jax.Array) -> jax.Array:
        rows: jax.Array = lax.cond(ids[0] > 0, lambda i: lookup(t, i), lambda i: -lookup(t, i), ids)
        return rows

    return [
        ("straight-line lookup", make_lookup_captured(t)),
        ("lookup in a fori_loop body", jax.jit(in_loop)),
        ("lookup in both branches of a cond", jax.jit(in_cond)),
    ]


def control_flow(scale_name: str = "small") -> list[dict[str, Any]]:
    """Each of `control_flow_programs` compiled here: the table's bytes, the constants in the
    buffer assignment, the lowered text's bytes and what memory_analysis totals."""
    s = closure_constant.CASE.scales[scale_name]
    ids = _ids(s, False)
    rows = []
    for label, fn in control_flow_programs(scale_name):
        r = measure(fn, ids, buffers=True)
        rows.append(
            {
                "label": label,
                "table": sizes(s)["table"],
                "constants": constant_bytes(r),
                "lowered": len(fn.lower(ids).as_text().encode()),
                "total": r.total,
            }
        )
    return rows


def control_flow_table(rows: list[dict[str, Any]]) -> Table:
    """`control_flow` as a table."""
    return Table(
        ["captured table used in", "table", "constants compiled in", "lowered text",
         "memory_analysis total"],
        [[r["label"], fmt_bytes(r["table"]), fmt_bytes(r["constants"]), fmt_bytes(r["lowered"]),
          fmt_bytes(r["total"])] for r in rows],
        "Compiled here; constants read from XLA's buffer assignment, which memory_analysis "
        "leaves out of its total.",
    )  # fmt: skip


def host_table(result: CaseResult) -> Table:
    """Each variant's host figures beside what memory_analysis says, and the peak against
    the floor and against the recommended fix."""
    s = closure_constant.CASE.scales[result.scale]
    fix = result.figures_of(RECOMMENDED)[KEY_FIGURE]
    rows = []
    for r in result.reports:
        f = r.figures
        rows.append(
            [r.name, fmt_bytes(r.total), fmt_bytes(f["lowered_text_bytes"]),
             fmt_bytes(f["rss_inputs"]), fmt_bytes(f["rss_peak"]),
             f"{f['rss_peak'] / floor_bytes(s):.2f}x", f"{f['rss_peak'] / fix:.2f}x",
             fmt_bytes(f["rss_cached"]), fmt_bytes(f["rss_cleared"]),
             fmt_bytes(f["rss_deleted"])]
        )  # fmt: skip
    return Table(
        ["variant", "memory_analysis total", "lowered text", "resident: inputs",
         "resident: peak (compile + run)", "peak / floor", f"peak / {RECOMMENDED}'s",
         "resident: executable cached", "after clear_caches()",
         "compiled again, then the function deleted"],
        rows,
        f"Each variant in a fresh process, scale {result.scale!r}: resident set above the "
        f"process before its inputs were made (the table the user holds counts once). Floor: "
        f"table + ids + rows = {fmt_bytes(floor_bytes(s))}. {result.provenance.label()}.",
    )  # fmt: skip


def reports_table(result: CaseResult, flow: list[dict[str, Any]]) -> Table:
    """What each report says beside the figure we measure for the same effect.

    `flow` is `control_flow()`.
    """
    z, r, e = (result.figures_of(n) for n in ("captured-zeros", "captured-random", RECOMMENDED))
    t = sizes(closure_constant.CASE.scales[result.scale])["table"]
    ours = [
        (
            f"with the captured-table function alive, {fmt_bytes(r['rss_cached'])} resident "
            f"against {fmt_bytes(r['rss_inputs'])} for its inputs; "
            f"{fmt_bytes(r['rss_cleared'])} after jax.clear_caches(); "
            f"{fmt_bytes(r['rss_deleted'])} after deleting the function (no clear_caches())"
        ),
        "; ".join(f"{x['label']}: {fmt_bytes(x['constants'])} of constants" for x in flow)
        + f" (table {fmt_bytes(flow[0]['table'])})",
        (
            f"peak resident {fmt_bytes(r['rss_peak'])} with a random table captured, "
            f"{fmt_bytes(z['rss_peak'])} with zeros (table {fmt_bytes(t)})"
        ),
        (
            f"random / zeros peak: {r['rss_peak'] / z['rss_peak']:.1f}x here; the report's "
            f"{REPORTED_GB['random']:g} / {REPORTED_GB['zeros']:g} GB is "
            f"{REPORTED_GB['random'] / REPORTED_GB['zeros']:.1f}x"
        ),
        (
            f"peak resident {fmt_bytes(e['rss_peak'])} with the table as an argument, "
            f"{r['rss_peak'] / e['rss_peak']:.2f}x less than captured"
        ),
        (
            f"after jax.clear_caches(): {fmt_bytes(r['rss_cleared'])}, from "
            f"{fmt_bytes(r['rss_cached'])} with the executable cached"
        ),
    ]
    return cited_reports_table(
        REPORTS,
        ours,
        f"{result.provenance.label()}; host resident set of real runs, {result.scale} scale.",
    )


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The claims of the reports and of common advice, decided by measurement.

    Host memory is measured on this machine only: for a target compile there is no run.

    Args:
        result: the case measured on this machine (measured here when not given).
        target: a compile target: no run there decides these claims (`RunbookError`).
        scale: the scale to measure at when `result` is not given.
    """
    result = measured_here("closure-constant", result, target, scale)
    z, r, e = (result.figures_of(n) for n in ("captured-zeros", "captured-random", RECOMMENDED))
    table_bytes = sizes(closure_constant.CASE.scales[result.scale])["table"]
    analysed = result.one("captured-random")
    # Its buffer assignment (the accelerator section measures the same program: cached).
    constants = constant_bytes(
        measure_case(
            "closure-constant",
            result.scale,
            variants=["captured-random"],
            at=analysed.params,
            buffers=True,
        ).one("captured-random")
    )
    held = r["rss_cached"] - r["rss_inputs"]  # beyond what the user holds, after the run
    return [
        Claim(
            "closure-fine",
            "Capturing an array in a jitted closure is fine: it costs what passing it costs.",
            verdict(r["rss_peak"] <= 1.1 * e["rss_peak"]),
            f"peak resident {fmt_bytes(r['rss_peak'])} captured vs {fmt_bytes(e['rss_peak'])} "
            f"as an argument ({r['rss_peak'] / e['rss_peak']:.2f}x); the lowered program is "
            f"{fmt_bytes(r['lowered_text_bytes'])} of text against "
            f"{fmt_bytes(e['lowered_text_bytes'])} (table {fmt_bytes(table_bytes)}).",
        ),
        Claim(
            "zeros-as-random",
            "Zeros captured are as expensive as random data.",
            verdict(z["rss_peak"] >= 0.8 * r["rss_peak"]),
            f"peak resident {fmt_bytes(z['rss_peak'])} with zeros vs "
            f"{fmt_bytes(r['rss_peak'])} random; lowered text {fmt_bytes(z['lowered_text_bytes'])}"
            f" vs {fmt_bytes(r['lowered_text_bytes'])}: a constant of one repeated value is "
            "written once (a splat), so zeros hide the cost a real table has.",
        ),
        Claim(
            "cache-keeps",
            "The jit cache keeps the memory alive (jax-ml/jax#282).",
            verdict(held >= 0.5 * table_bytes and r["rss_deleted"] < r["rss_cached"] - 0.5 * held),
            f"after the run, with the function alive: {fmt_bytes(held)} resident beyond the "
            f"inputs ({held / table_bytes:.1f}x the table); compiled again, then the function "
            f"deleted (no clear_caches()): {fmt_bytes(r['rss_deleted'])} resident, the inputs "
            f"{fmt_bytes(r['rss_inputs'])}. As an argument: "
            f"{fmt_bytes(e['rss_cached'] - e['rss_inputs'])} beyond the inputs.",
        ),
        Claim(
            "clear-caches",
            "`jax.clear_caches()` frees the memory (jax-ml/jax#19429).",
            verdict(r["rss_cached"] - r["rss_cleared"] >= 0.5 * held),
            f"{fmt_bytes(r['rss_cached'])} resident with the executable cached, "
            f"{fmt_bytes(r['rss_cleared'])} after clear_caches() "
            f"({fmt_bytes(r['rss_cached'] - r['rss_cleared'])} freed of the {fmt_bytes(held)} "
            f"held beyond the inputs), the jitted function still alive.",
        ),
        Claim(
            "analysis-shows",
            "memory_analysis() shows what a captured array costs.",
            verdict(analysed.total >= table_bytes),
            f"memory_analysis total {fmt_bytes(analysed.total)} captured vs "
            f"{fmt_bytes(result.one(RECOMMENDED).total)} as an argument: it counts the table "
            f"only when it is an argument. The buffer assignment holds "
            f"{fmt_bytes(constants)} of constants (the table is {fmt_bytes(table_bytes)}), "
            "none of it in the total; the lowered text "
            f"({fmt_bytes(r['lowered_text_bytes'])}), the compile peak "
            f"({fmt_bytes(r['rss_peak'])} resident) and the cached executable are nowhere in it.",
        ),
    ]


def lowered_constants(fn: Any, *args: Any, width: int = 72) -> Table:
    """The constants in the program JAX lowers for `fn` (a jitted function): each one's
    size in the StableHLO text and its opening characters."""
    text = fn.lower(*args).as_text()
    rows = []
    for line in text.splitlines():
        if "stablehlo.constant" not in line:
            continue
        body = line.strip()
        shown = body if len(body) <= width else body[:width] + "…"
        rows.append((len(line.encode()), shown))
    return Table(
        ["bytes of text", "the constant, as lowered"],
        [[fmt_bytes(n), shown] for n, shown in sorted(rows, key=lambda r: -r[0])[:3]]
        or [["-", "no constants"]],
        f"From `{getattr(fn, '__name__', 'fn')}.lower(...).as_text()`: {fmt_bytes(len(text))} "
        "in all.",
    )


def predict(result: CaseResult) -> Table:
    """Two predictions of the reproduction's resident peak beside the measured one.

    memory_analysis's: the table the user holds plus the program's total. Copies': the
    table held by the user, its text in the lowered program (measured), the constant XLA
    compiles into the executable (one table) and the rows returned.
    """
    s = sizes(closure_constant.CASE.scales[result.scale])
    r = result.one("captured-random")
    f = r.figures
    predicted = {
        "the table + memory_analysis's total": s["table"] + r.total,
        "the table + its lowered text + its compiled constant + the rows": s["table"]
        + f["lowered_text_bytes"]
        + s["table"]
        + s["rows"],
    }
    return Table(
        ["prediction", "predicted", "measured peak (resident)", "measured / predicted"],
        [[k, fmt_bytes(v), fmt_bytes(f[KEY_FIGURE]), f"{f[KEY_FIGURE] / v:.2f}"]
         for k, v in predicted.items()],
        f"captured-random, scale {result.scale!r}; the lowered text is measured, the rest is "
        f"the table ({fmt_bytes(s['table'])}) and the rows ({fmt_bytes(s['rows'])}).",
    )  # fmt: skip


def constants_by_compiler(results: Mapping[str, CaseResult]) -> Table:
    """Per compiler (`runbook.site.on_targets` results, measured with buffers): what
    memory_analysis totals for each variant and the constants its buffer assignment holds."""
    rows = []
    for where, res in results.items():
        row = [where]
        for name in ("captured-random", "captured-zeros", RECOMMENDED):
            found = res.select(name)
            if not found:
                row += ["-", "-"]
                continue
            row += [fmt_bytes(found[0].total), fmt_bytes(constant_bytes(found[0]))]
        rows.append(row)
    return Table(
        ["compiled for", "captured-random: total", "its constants", "captured-zeros: total",
         "its constants", f"{RECOMMENDED}: total", "its constants"],
        rows,
        "memory_analysis totals (arguments + temporaries + outputs) beside the constants each "
        "compiler's buffer assignment holds, which no total includes. Targets: compiled "
        "by each target's compiler, without the device.",
    )  # fmt: skip


def host_chart(result: CaseResult, ax: Any = None) -> Figure:
    """Per variant: memory_analysis's total beside the resident peak, the resident set with
    the executable cached and after `jax.clear_caches()`; the floor as a line."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.8))
    series: list[tuple[str, Callable[[MemoryReport], float]]] = [
        ("memory_analysis total", lambda r: r.total),
        ("resident peak (compile + run)", lambda r: r.figures[KEY_FIGURE]),
        ("resident, executable cached", lambda r: r.figures["rss_cached"]),
        ("resident after clear_caches()", lambda r: r.figures["rss_cleared"]),
    ]
    reports = list(result.reports)
    width = 0.8 / len(series)
    for i, (label, get) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(reports))]
        ax.bar(xs, [get(r) / 2**20 for r in reports], width, label=label)
    floor = floor_bytes(closure_constant.CASE.scales[result.scale]) / 2**20
    ax.axhline(floor, color="black", linewidth=1, linestyle="--", label="floor (resident)")
    ax.set_xticks(range(len(reports)), [r.name for r in reports])
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"{result.provenance.label()}, scale {result.scale!r}", fontsize=9)
    return cast("Figure", ax.figure)


def compilers_note(results: Mapping[str, CaseResult]) -> Note:
    """What `constants_by_compiler` shows, in two sentences computed from it: where
    memory_analysis's total leaves the captured table out, and where zeros cost more."""
    table_bytes = sizes(closure_constant.CASE.scales[next(iter(results.values())).scale])["table"]
    missed, zeros_cost = [], []
    for where, res in results.items():
        random, zeros = res.select("captured-random"), res.select("captured-zeros")
        if random and random[0].total < table_bytes <= constant_bytes(random[0]):
            missed.append(where)
        if random and zeros and zeros[0].total >= random[0].total + table_bytes:
            zeros_cost.append(f"{where} ({fmt_bytes(zeros[0].total)})")
    text = (
        f"memory_analysis leaves the captured random table out of its total on {len(missed)} "
        f"of {len(results)} compilers ({', '.join(missed) or 'none'}): each holds it as a "
        "constant of its own. "
    )
    text += (
        "With zeros captured, "
        + ", ".join(zeros_cost)
        + " materialise the zeros as a table-sized array the total does count; the others "
        "fold them away."
        if zeros_cost
        else "With zeros captured, every compiler folds them away."
    )
    return Note(text)
