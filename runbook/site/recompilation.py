"""The `recompilation` page's measurements: real runs of each variant's loop in a fresh
process (resident set, compile count, seconds; run by `runbook.runs.recompilation`), the
reports beside them, the claims, the tables and the chart. The loops themselves are
`runbook.cases.recompilation`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax

from .._case import CaseResult, measured_here
from .._errors import RunbookError
from .._quiet import start_backend
from .._render import Table, fmt_bytes
from ..cases import recompilation
from ..cases.recompilation import CASE, bucket
from ..runs import recompilation as runs
from ..runs.recompilation import (
    batches,
    compiles,
    count_compiles,
    loop_run,
    row_counts,
    rows_needed,
    run_loop,
)
from ._claims import Claim, verdict
from ._pages import cited_reports_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# What the reports say, summarised in our words; ours is measured beside it.
REPORTS = {
    "jax-ml/jax#2072": "a jitted function fed inputs of ever-changing shapes makes host memory "
    "creep up over a long loop, although the arrays shrink; the reply: the compilation cache "
    "has no eviction",
    "jax-ml/jax#7930": "a new shape every iteration keeps adding memory, and dropping the "
    "jitted function does not give it back",
    "jax-ml/jax#10828": "a request for one call that empties every jit cache (it became "
    "jax.clear_caches())",
    "jax-ml/jax#16778": "executables are never destroyed; on a GPU each also holds device "
    "memory, which ran out; the cache is bounded by a count of entries, not by their size",
    "jax-ml/jax#19429": "calling jax.clear_caches() every iteration of a new-shape loop still "
    "leaves resident memory rising slowly",
    "jax-ml/jax#5531": "memory grows inside backend_compile because the function compiles "
    "again every iteration",
}

# The figures a real run measures (`Case.figures`): `runbook.runs.recompilation`'s.
FIGURES = runs.FIGURES

RECOMMENDED = CASE.recommended or "bucketed"
KEY_FIGURE = CASE.key_figure or "rss_growth"
PAIRS = (("each-shape", RECOMMENDED), ("each-static", "traced-static"))


WATCH_STEPS = 24  # past the watch's warm-up, on the watch page


def watched_loop(variant: str, steps: int, mark_step: Callable[[], None]) -> None:
    """`variant`'s loop at the runnable scale for `steps` steps, calling `mark_step()` after
    each (for `runbook.watch`): the case's own loop, with a new jitted step."""
    scale = CASE.scale(CASE.runnable_scale)
    run_loop(variant, scale, steps, on_step=mark_step)


def trace(result: CaseResult, name: str) -> list[list[int | None]]:
    """Variant `name`'s ``[compilations, resident growth]`` after each step of its loop
    (growth None where the loop did not read it)."""
    r = result.one(name)
    got: list[list[int | None]] = loop_run(name, CASE.scale(result.scale), r.params)["trace"]
    return got


def checkpoints(result: CaseResult, name: str) -> list[tuple[int, int, int]]:
    """Variant `name`'s ``(step, compilations, resident growth)`` where its loop read the
    resident set (the first step and every ``calls // CHECKPOINTS``-th: the runs module's)."""
    found = []
    for i, (c, g) in enumerate(trace(result, name)):
        if c is not None and g is not None:
            found.append((i + 1, c, g))
    return found


def _signed(n: float) -> str:
    """Bytes with their sign: a resident set can end below where it started."""
    return ("+" if n >= 0 else "-") + fmt_bytes(abs(n))


def _cleared(f: Mapping[str, float]) -> str:
    return "no jax.clear_caches()" if not f["clear_caches_count"] else fmt_bytes(f["rss_cleared"])


def figures_table(result: CaseResult) -> Table:
    """Each variant's real run beside what memory_analysis says of one step."""
    s = CASE.scale(result.scale)
    rows = []
    for r in result.reports:
        f = r.figures
        per = (f[KEY_FIGURE] / f["compile_count"]) if f["compile_count"] else 0.0
        rows.append(
            [r.name, fmt_bytes(r.total), f"{int(f['compile_count'])}", fmt_bytes(f[KEY_FIGURE]),
             fmt_bytes(per), f"{f['loop_seconds']:.2f} s", f"{f['rerun_seconds']:.3f} s",
             fmt_bytes(f["rss_deleted"]), _cleared(f)]
        )  # fmt: skip
    return Table(
        ["variant", "memory_analysis total (one step)", "compilations", "resident growth",
         "growth per compilation", "loop", "loop again (cached)", "after deleting the function",
         "after clear_caches()"],
        rows,
        f"Each variant's loop of {s['calls']} steps in a fresh process, scale {result.scale!r}: "
        f"resident set above the process before the loop; memory_analysis of one step at the "
        f"largest batch. {result.provenance.label()}.",
    )  # fmt: skip


def cost_table(result: CaseResult) -> Table:
    """What each fix costs: the rows it computes beyond the rows needed (padding), and the
    cached loop's seconds, beside what it saves."""
    s = CASE.scale(result.scale)
    rows = []
    for repro, fix in PAIRS:
        a, b = result.figures_of(repro), result.figures_of(fix)
        needed = rows_needed(fix, s["calls"], s["calls"])
        rows.append(
            [f"{fix} (for {repro})", f"{int(b['rows_count']):,} / {needed:,}",
             f"{b['rows_count'] / needed:.2f}x", f"{b['rerun_seconds'] / a['rerun_seconds']:.2f}x",
             f"{int(a['compile_count'])} -> {int(b['compile_count'])}",
             f"{fmt_bytes(a[KEY_FIGURE])} -> {fmt_bytes(b[KEY_FIGURE])}",
             f"{a['loop_seconds']:.2f} s -> {b['loop_seconds']:.2f} s"]
        )  # fmt: skip
    return Table(
        ["fix", "rows computed / needed", "compute (rows) ratio", "cached loop: fix / repro",
         "compilations", "resident growth", "loop with its compiles"],
        rows,
        "Compute grows with the rows a step computes: the rows ratio is the padding's cost in "
        "arithmetic; the cached loop's seconds (noisy on a shared machine) are what it cost "
        f"here. Real runs, scale {result.scale!r}. {result.provenance.label()}.",
    )  # fmt: skip


def growth_chart(result: CaseResult) -> Figure:
    """Resident growth after each step of each loop (left), and against the compilations
    made so far (right), with what `jax.clear_caches()` left as a marker at the end."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in result.reports:
        points = checkpoints(result, r.name)
        growth = [g / 2**20 for _, _, g in points]
        line = left.plot([i for i, _, _ in points], growth, marker="o", label=r.name)[0]
        right.plot([c for _, c, _ in points], growth, marker="o", label=r.name)
        if r.figures["clear_caches_count"]:
            left.plot([points[-1][0]], [r.figures["rss_cleared"] / 2**20], marker="x",
                      markersize=10, color=line.get_color())  # fmt: skip
    left.set_xlabel("steps (each-shape: a new row count each step)")
    right.set_xlabel("compilations so far (distinct shapes or values)")
    for ax in (left, right):
        ax.set_ylabel("resident growth, MiB")
    left.legend(fontsize=8, loc="upper left")
    left.set_title("x: after jax.clear_caches()", fontsize=9)
    fig.suptitle(f"{result.provenance.label()}, scale {result.scale!r}", fontsize=9)
    fig.tight_layout()
    return fig


def explain_misses(steps: int = 3) -> dict[str, str]:
    """What ``jax_explain_cache_misses`` logs for the two reproductions' loops, `steps` steps
    each, in this process after emptying its caches; a variant maps to "" where this JAX has
    no such option."""
    start_backend()
    if not hasattr(jax.config, "jax_explain_cache_misses"):
        return {"each-shape": "", "each-static": ""}
    found = {}
    scale = CASE.scale("tiny")
    logger = logging.getLogger("jax")
    with contextlib.suppress(AttributeError):  # a key seen before would not miss again
        jax.clear_caches()
    for variant in ("each-shape", "each-static"):
        buffer = io.StringIO()
        handler = logging.StreamHandler(buffer)
        logger.addHandler(handler)
        old = jax.config.jax_explain_cache_misses
        try:
            jax.config.update("jax_explain_cache_misses", True)
            run_loop(variant, scale, steps)
        finally:
            jax.config.update("jax_explain_cache_misses", old)
            logger.removeHandler(handler)
        found[variant] = buffer.getvalue()
    return found


def _loop_misses(text: str) -> list[str]:
    """The blocks of a ``jax_explain_cache_misses`` log for calls of a function seen before
    (the first call of each function is a miss by definition)."""
    blocks = text.split("TRACING CACHE MISS")[1:]
    return [b for b in blocks if "never seen function" not in b]


def miss_lines(text: str, limit: int = 6) -> str:
    """What each miss of the loop's own step says changed, a line per miss."""
    found = []
    for block in _loop_misses(text):
        said = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("*")]
        said = said or [ln.strip() for ln in block.splitlines() if "unavailable" in ln]
        found.append("; ".join(said) or "(no reason given)")
    return "\n".join(found[:limit])


class _Settings:
    """Settings hashed by identity (Python's default): equal contents, another key."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature


@dataclasses.dataclass(frozen=True)
class _FrozenSettings:
    """The same settings as a frozen dataclass: hashed and compared by value."""

    temperature: float


def static_objects(steps: int = 3) -> dict[str, int]:
    """Compilations of a jitted step whose static argument is a new settings object each
    step, every one with the same contents: hashed by identity, and by value (with
    ``"steps"``, the steps each ran)."""
    start_backend()
    count_compiles()
    scale = CASE.scale("tiny")
    weights = recompilation.init_params(scale)
    x = batches(scale, [scale["calls"]])[0]

    def by_settings(params: Any, x: Any, settings: Any) -> jax.Array:
        return recompilation.scaled_loss(params, x, settings.temperature)

    found = {"steps": steps}
    for label, make in (("identity", _Settings), ("value", _FrozenSettings)):
        step = jax.jit(by_settings, static_argnames="settings")
        before = compiles()
        for _ in range(steps):
            jax.block_until_ready(step(weights, x, settings=make(2.0)))
        found[label] = compiles() - before
    return found


def static_objects_table(found: Mapping[str, int]) -> Table:
    """`static_objects` as a table."""
    return Table(
        ["static argument", "compilations"],
        [["a plain class instance (hashed by identity)", f"{found['identity']}"],
         ["a frozen dataclass (hashed by value)", f"{found['value']}"]],
        f"Equal settings, a new object each of {found['steps']} steps; compiled "
        f"here. jax {jax.__version__}.",
    )  # fmt: skip


def targets_table(results: Mapping[str, CaseResult]) -> Table:
    """Per compiler (`runbook.site.on_targets` results): each variant's total for one step
    against its floor."""
    rows = []
    for where, res in results.items():
        for r in res.reports:
            rows.append(
                [where, r.name, fmt_bytes(r.total), fmt_bytes(r.lower_bound),
                 f"{r.total / r.lower_bound:.2f}x"]
            )  # fmt: skip
    return Table(
        ["compiled for", "variant", "memory_analysis total (one step)", "floor",
         "total / floor"],
        rows,
        "One step at the largest batch; the floor: the weights, the batch and the loss. "
        "Targets are compiled by each target's compiler, without the device.",
    )  # fmt: skip


def versions_statement() -> Any:
    """The version matrix's statement for this case, or a note that no release file has
    recorded it yet (a case added after the last `nox -s versions`)."""
    from ._history import Note, history

    try:
        return history("recompilation").statement()
    except RunbookError:
        return Note(
            "No release file records this case yet: `nox -s versions` measures it on every "
            "release in its next run."
        )


def reports_table(result: CaseResult) -> Table:
    """What each report says beside the figure we measure for the same effect."""
    s = CASE.scale(result.scale)
    e, b = result.figures_of("each-shape"), result.figures_of(RECOMMENDED)
    st, tr = result.figures_of("each-static"), result.figures_of("traced-static")
    points = checkpoints(result, "each-shape")
    half = points[len(points) // 2]
    ours = [
        (
            f"{s['calls']} row counts: {int(e['compile_count'])} compilations, "
            f"resident {_signed(e[KEY_FIGURE])} ({_signed(half[2])} after {half[0]} steps)"
        ),
        (
            f"after deleting the jitted function: {fmt_bytes(e['rss_deleted'])} of "
            f"{fmt_bytes(e[KEY_FIGURE])} still resident"
        ),
        f"jax.clear_caches(): {_cleared(e)} resident after it, from {fmt_bytes(e[KEY_FIGURE])}",
        (
            f"host only (no GPU here): {fmt_bytes(e[KEY_FIGURE] / max(e['compile_count'], 1))} of "
            f"resident set per compilation"
        ),
        (
            f"after one clear_caches(): {_cleared(e)} left by {int(e['compile_count'])} "
            f"compilations, {_cleared(b)} by {int(b['compile_count'])}"
        ),
        (
            f"{int(e['compile_count'])} compilations in {e['loop_seconds']:.2f} s (the same "
            f"loop cached: {e['rerun_seconds']:.3f} s), "
            f"{fmt_bytes(e[KEY_FIGURE] / max(e['compile_count'], 1))} resident each; a new "
            f"float static each step: {int(st['compile_count'])} compilations, "
            f"{_signed(st[KEY_FIGURE])} (traced: {int(tr['compile_count'])}, "
            f"{_signed(tr[KEY_FIGURE])})"
        ),
    ]
    return cited_reports_table(
        REPORTS,
        ours,
        f"Real runs of {s['calls']} steps in fresh processes, scale {result.scale!r}. "
        f"{result.provenance.label()}.",
    )


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The reports' claims and common advice, decided by real runs on this machine.

    Args:
        result: the case measured on this machine (measured here when not given).
        target: a compile target: no run there decides these claims (`RunbookError`).
        scale: the scale to measure at when `result` is not given.
    """
    result = measured_here("recompilation", result, target, scale)
    s = CASE.scale(result.scale)
    calls = s["calls"]
    e, b = result.figures_of("each-shape"), result.figures_of(RECOMMENDED)
    st, tr = result.figures_of("each-static"), result.figures_of("traced-static")
    buckets = len({bucket(r) for r in row_counts(calls)})
    points = checkpoints(result, "each-shape")
    half, end = points[len(points) // 2], points[-1]
    excess = e[KEY_FIGURE] - b[KEY_FIGURE]
    needed = rows_needed(RECOMMENDED, calls, calls)
    repro_total, fix_total = result.one("each-shape").total, result.one(RECOMMENDED).total
    misses = explain_misses()
    width = CASE.scale("tiny")["features"]
    named = {r for r in row_counts(3) if f"f32[{r},{width}]" in misses["each-shape"]}
    found = [
        Claim(
            "compiles-per-shape",
            "A jitted function compiles again for each new input shape (jax-ml/jax#2072, #5531).",
            verdict(e["compile_count"] == calls),
            f"{calls} distinct row counts: {int(e['compile_count'])} compilations; the same "
            f"loop again: none more ({e['rerun_seconds']:.3f} s against "
            f"{e['loop_seconds']:.2f} s the first time).",
        ),
        Claim(
            "cache-grows",
            "Every executable stays cached: host memory grows with the number of distinct "
            "shapes (jax-ml/jax#2072, #16778).",
            verdict(end[2] > half[2] and e[KEY_FIGURE] >= 1.5 * b[KEY_FIGURE]),
            f"resident {_signed(half[2])} after {half[1]} shapes, {_signed(end[2])} "
            f"after {end[1]}; bucketed ({int(b['compile_count'])} compilations): "
            f"{_signed(b[KEY_FIGURE])}.",
        ),
        Claim(
            "delete-frees",
            "Dropping the jitted function gives its executables' memory back (jax-ml/jax#7930 "
            "expected it).",
            verdict(e[KEY_FIGURE] - e["rss_deleted"] >= 0.5 * excess),
            f"resident {_signed(e[KEY_FIGURE])} after the loop, "
            f"{_signed(e['rss_deleted'])} after deleting the jitted function and "
            "collecting: the Python function it wraps (`loss`, a module's) is still alive.",
        ),
    ]
    if not e["clear_caches_count"]:
        found.append(
            Claim(
                "clear-caches",
                "jax.clear_caches() frees memory the cached executables held (jax-ml/jax#10828).",
                "not reproducible here",
                f"jax {jax.__version__} has no jax.clear_caches().",
            )
        )
    else:
        left = e["rss_cleared"] - b["rss_cleared"]
        found += [
            Claim(
                "clear-caches",
                "jax.clear_caches() frees memory the cached executables held (jax-ml/jax#10828).",
                verdict(e["rss_deleted"] - e["rss_cleared"] >= 0.25 * excess),
                f"{_signed(e['rss_deleted'])} before it, {_signed(e['rss_cleared'])} "
                f"after ({fmt_bytes(e['rss_deleted'] - e['rss_cleared'])} given back).",
            ),
            Claim(
                "clear-caches-leaves",
                "Some of the growth stays even after jax.clear_caches() (jax-ml/jax#19429).",
                verdict(left >= 0.1 * excess),
                f"after clear_caches(): {_signed(e['rss_cleared'])} left by "
                f"{int(e['compile_count'])} compilations against {_signed(b['rss_cleared'])} "
                f"by {int(b['compile_count'])}: {fmt_bytes(left)} more, "
                f"{left / max(excess, 1):.0%} of the extra growth.",
            ),
        ]
    found += [
        Claim(
            "gpu-device-memory",
            "On a GPU each cached executable also holds device memory (jax-ml/jax#16778).",
            "not reproducible here",
            "no GPU on this machine: the figures here are host memory.",
        ),
        Claim(
            "static-float",
            "A float static argument compiles once per value.",
            verdict(st["compile_count"] == calls),
            f"{calls} temperatures: {int(st['compile_count'])} compilations, "
            f"{_signed(st[KEY_FIGURE])} resident.",
        ),
        Claim(
            "traced-once",
            "Passed as an array argument, the same value compiles once.",
            verdict(tr["compile_count"] == 1),
            f"{int(tr['compile_count'])} compilation, {_signed(tr[KEY_FIGURE])} resident "
            f"({st[KEY_FIGURE] / max(tr[KEY_FIGURE], 1):.1f}x less than static).",
        ),
        Claim(
            "buckets-bound",
            "Padding to power-of-two buckets bounds the compilations to one per bucket.",
            verdict(b["compile_count"] == buckets),
            f"row counts 1 to {calls}: {buckets} buckets, {int(b['compile_count'])} "
            f"compilations; resident {_signed(b[KEY_FIGURE])} against "
            f"{_signed(e[KEY_FIGURE])} unpadded ({e[KEY_FIGURE] / b[KEY_FIGURE]:.1f}x).",
        ),
        Claim(
            "padding-free",
            "Padding costs nothing.",
            verdict(b["rows_count"] <= needed),
            f"{int(b['rows_count']):,} rows computed for {needed:,} needed "
            f"({b['rows_count'] / needed:.2f}x the arithmetic); the cached loop took "
            f"{b['rerun_seconds']:.3f} s against {e['rerun_seconds']:.3f} s unpadded.",
        ),
        Claim(
            "analysis-shows",
            "memory_analysis() of the compiled step shows the growth.",
            verdict(e[KEY_FIGURE] / b[KEY_FIGURE] <= 1.5 * repro_total / fix_total),
            f"one step's total: {fmt_bytes(repro_total)} unpadded, {fmt_bytes(fix_total)} "
            f"bucketed ({repro_total / fix_total:.2f}x); the real loops' resident growth: "
            f"{e[KEY_FIGURE] / b[KEY_FIGURE]:.1f}x. Each executable is small; their number "
            "is the problem.",
        ),
    ]
    objects = static_objects()
    found.append(
        Claim(
            "static-identity",
            "A static argument with the same contents as the last one hits the cache, "
            "whatever its type.",
            verdict(objects["identity"] == 1),
            f"{objects['steps']} steps, each with new settings of the same contents: "
            f"{objects['identity']} compilations when they hash by identity (a plain class), "
            f"{objects['value']} when by value (a frozen dataclass).",
        )
    )
    static_text = "".join(_loop_misses(misses["each-static"]))
    if not misses["each-shape"]:
        found.append(
            Claim(
                "explain-misses",
                "jax_explain_cache_misses names the argument whose shape changed.",
                "not reproducible here",
                f"jax {jax.__version__} has no jax_explain_cache_misses option.",
            )
        )
        found.append(
            Claim(
                "explain-static",
                "jax_explain_cache_misses names the static argument whose value changed.",
                "not reproducible here",
                f"jax {jax.__version__} has no jax_explain_cache_misses option.",
            )
        )
    else:
        found.append(
            Claim(
                "explain-misses",
                "jax_explain_cache_misses names the argument whose shape changed.",
                verdict(len(named) >= 2),
                "its log for the first steps of each-shape: "
                + (miss_lines(misses["each-shape"], 2).replace("\n", " / ") or "(no line)"),
            )
        )
        shown = miss_lines(misses["each-static"], 2).replace("\n", " / ")
        found.append(
            Claim(
                "explain-static",
                "jax_explain_cache_misses names the static argument whose value changed.",
                verdict("temperature" in static_text and "1.5" in static_text),
                f"its log for the first steps of each-static: {shown or '(no line)'}",
            )
        )
    return found
