"""The `live-references` page's measurements: a real run's live device bytes, step by step
(run by `runbook.runs.live_references`, whose docstring says how), the claims, the tables
and the chart. The case itself (the loops, their inputs) is `runbook.cases.live_references`,
which this module runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import jax

from .._case import CaseResult, measured_here
from .._errors import RunbookError
from .._render import Table, fmt_bytes
from ..cases.live_references import CASE, LOOPS, initial_params, param_bytes
from ..runs import live_references as runs
from ..runs.live_references import (
    FAILED_WITH,
    REBOUND,
    check_fits,
    others,
    run,
    seed_like,
    session,
)
from ._claims import Claim, verdict
from ._pages import cited_reports_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# What the reports say, in our words; ours is measured beside it (`reports_table`).
REPORTS = {
    "jax-ml/jax#1222": "asks for a way to give back the GPU memory JAX holds once a "
    "computation is done, even by copying the results to NumPy first",
    "jax-ml/jax#10007": "a new array made each iteration of a plain Python loop (no jit), "
    "bound to the same name: the live buffers seemed to grow by one per iteration",
    "jax-ml/jax#14934": "in a notebook, the GPU memory of a call that raised an error stays "
    "allocated afterwards",
    "jax-ml/jax#725": "objects in reference cycles are not freed when their last reference "
    "goes, so the device arrays they hold wait for Python's cycle collector",
    "jax-ml/jax#12575, google/flax#2493": "out of memory in a loop calling a Flax "
    "nn.Sequential model; traced to a cache in Flax's modules holding the arrays",
    "jax-ml/jax#11448": "a jitted lax loop closing over a large constant left a live buffer "
    "behind after every function and array was gone",
}

# The figures a real run measures (`Case.figures`): `runbook.runs.live_references`'s.
FIGURES = runs.FIGURES

RECOMMENDED = CASE.recommended or "keep-floats"
KEY_FIGURE = CASE.key_figure or "live_growth"


WATCH_STEPS = 12  # past the watch's warm-up, on the watch page


def watched_loop(variant: str, steps: int, mark_step: Callable[[], None]) -> None:
    """Run `variant`'s loop (a name in `runbook.cases.live_references.LOOPS`) for `steps`
    steps at the case's runnable scale, calling `mark_step()` once per step."""
    scale = CASE.scale(CASE.runnable_scale)
    check_fits({**scale, "steps": steps})
    if variant not in LOOPS:
        raise RunbookError(f"unknown variant {variant!r}; valid: {', '.join(LOOPS)}")
    start = [initial_params(scale["size"])]
    LOOPS[variant](start.pop(), steps, mark_step)


def checks(
    errors: Mapping[str, float], steps: int, tolerance: float | None = None
) -> list[dict[str, Any]]:
    """The same-result rows (`runbook.site.verify_table`'s) of each fix's error against the
    reproduction (`runbook.runs.live_references`' `_error`)."""
    tol = CASE.tolerance if tolerance is None else tolerance
    fixes = [v.name for v in CASE.variants if v.role == "fix"]
    return [
        {"name": name, "params": {"steps": steps}, "max_rel_error": err, "tolerance": tol,
         "same": err <= tol}
        for name, err in errors.items() if name in fixes or name not in CASE_NAMES
    ]  # fmt: skip


CASE_NAMES = {v.name for v in CASE.variants}


def same_result(scale: str | None = None) -> list[dict[str, Any]]:
    """Each fix's loop against the reproduction's, from the same start, on real arrays at
    `scale` (default: the runnable one), in the fresh process of its figures: the final
    parameters and every step's loss."""
    s = CASE.scale(scale or CASE.runnable_scale)
    size, steps = int(s["size"]), int(s["steps"])
    return checks(session(size, steps, seed_like(size, steps))["errors"], steps)


def live_table(result: CaseResult) -> Table:
    """Each variant's compile-time total beside the live bytes of a real run."""
    s = CASE.scales[result.scale]
    one = param_bytes(s)
    rows = []
    for r in result.reports:
        f = r.figures
        rows.append(
            [r.name, r.role, fmt_bytes(r.total), fmt_bytes(f["live_growth"]),
             f"{f['live_growth'] / one:.2f}", fmt_bytes(f["live_per_step"]),
             fmt_bytes(f["live_after_loop"]), fmt_bytes(f["live_after_drop"]),
             fmt_bytes(f["live_after_collect"])]
        )  # fmt: skip
    return Table(
        ["variant", "role", "memory_analysis total (one step)", "live growth over the loop",
         "in parameter copies", "per step", "after the loop returned",
         "after dropping its log", "after gc.collect()"],
        rows,
        f"Real runs in a fresh process: {s['steps']} steps on {fmt_bytes(one)} of parameters "
        "per variant; live device bytes (jax.live_arrays()); growth from the first step to the "
        f"last, the others above the bytes live before the loop; the cycle collector paused until gc.collect(). {result.provenance.label()}.",
    )  # fmt: skip


def live_chart(result: CaseResult, ax: Any = None) -> Figure:
    """Live device bytes after each step, one line per variant, at `result`'s scale (the
    loops run in the fresh process that measured `result`'s figures)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.8))
    for v in CASE.variants:
        series = run(v.name, result.scale)["series"]
        style = "-" if v.role == "reproduction" else "--"
        ax.plot(
            range(1, len(series) + 1),
            [b / 2**20 for b in series],
            style,
            marker="o",
            markersize=2.5,
            label=f"{v.name} ({v.role})",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("live device MiB above the start")
    ax.legend(fontsize=8, loc="upper left")
    s = CASE.scale(result.scale)
    ax.set_title(
        f"{fmt_bytes(param_bytes(s))} of parameters, {s['steps']} steps; "
        f"{result.provenance.label()}",
        fontsize=9,
    )
    return cast("Figure", ax.figure)


def reports_table(result: CaseResult) -> Table:
    """What each report says beside what we measure for the same effect."""
    k, c, y, f = (result.figures_of(n) for n in ("keep-arrays", "cache-arrays", "cycle",
                                                  RECOMMENDED))  # fmt: skip
    o = others(result.scale)
    one = param_bytes(CASE.scales[result.scale])
    ours = [
        (
            f"keep-arrays: {fmt_bytes(k['live_after_loop'])} live after the loop, "
            f"{fmt_bytes(k['live_after_drop'])} once the log is dropped: freed with the last "
            "reference"
        ),
        (
            f"{REBOUND} arrays of {fmt_bytes(one)} bound in turn to one name: "
            f"{fmt_bytes(o['rebind_live'])} live after the loop"
        ),
        (
            f"a failed call's {FAILED_WITH} arrays: {fmt_bytes(o['error_kept_live'])} live while the "
            f"error is kept, {fmt_bytes(o['error_dropped_live'])} once it is dropped"
        ),
        (
            f"cycle: {fmt_bytes(y['live_after_drop'])} live with nothing referring to the old "
            f"states, {fmt_bytes(y['live_after_collect'])} after gc.collect()"
        ),
        (
            f"cache-arrays: the cache grows live memory by {fmt_bytes(c['live_growth'])} over "
            f"the loop, against {fmt_bytes(f['live_growth'])} for {RECOMMENDED}"
        ),
        (
            f"the loop's constant and functions dropped: {fmt_bytes(o['loop_constant_live'])} "
            f"live above before (the constant is {fmt_bytes(one)})"
        ),
    ]
    return cited_reports_table(
        REPORTS, ours, f"{result.provenance.label()}; live device bytes of real runs."
    )


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The claims of the reports and of common advice, decided by measurement.

    Live bytes are measured on this machine only: for a target compile there is no run.

    Args:
        result: the case measured on this machine (measured here when not given).
        target: a compile target: no run there decides these claims (`RunbookError`).
        scale: the scale to measure at when `result` is not given.
    """
    result = measured_here("live-references", result, target, scale)
    s = CASE.scales[result.scale]
    one, steps = param_bytes(s), int(s["steps"])
    k, c, y, f, b = (result.figures_of(n) for n in
                     ("keep-arrays", "cache-arrays", "cycle", RECOMMENDED, "cycle-broken"))  # fmt: skip
    o = others(result.scale)
    totals = {r.name: r.total for r in result.reports}
    guard = o["guard"]
    if guard is None:
        guard_claim = Claim(
            "guard-names-cycle",
            "`jax_array_garbage_collection_guard` reports arrays freed by the cycle collector.",
            "not reproducible here",
            f"jax {jax.__version__} has no jax_array_garbage_collection_guard option.",
        )
    else:
        guard_claim = Claim(
            "guard-names-cycle",
            "`jax_array_garbage_collection_guard` reports arrays freed by the cycle collector.",
            verdict(guard["cycle"] > 0 and guard["cycle-broken"] == 0),
            f"set to 'log', gc.collect() after a short cycle loop printed {guard['cycle']} "
            f"such reports; after the loop without the cycle, {guard['cycle-broken']}.",
        )
    return [
        Claim(
            "log-grows",
            "A log of each step's arrays grows live device memory by a parameter copy per "
            "step (the issue's measurement).",
            verdict(k["live_growth"] >= 0.95 * (steps - 1) * one),
            f"{fmt_bytes(k['live_growth'])} more live at step {steps} than at step 1, on "
            f"{fmt_bytes(one)} of parameters ({k['live_growth'] / one:.2f} copies).",
        ),
        Claim(
            "floats-flat",
            "Keeping `float(loss)` instead keeps live memory flat.",
            verdict(f["live_growth"] <= 0.01 * k["live_growth"]),
            f"{fmt_bytes(f['live_growth'])} of growth with floats against "
            f"{fmt_bytes(k['live_growth'])} with arrays.",
        ),
        Claim(
            "drop-frees",
            "Dropping the references gives the memory back (jax-ml/jax#1222).",
            verdict(k["live_after_drop"] <= 0.01 * k["live_after_loop"]),
            f"{fmt_bytes(k['live_after_loop'])} live with the log, "
            f"{fmt_bytes(k['live_after_drop'])} once it is dropped, before any collection.",
        ),
        Claim(
            "rebind-grows",
            "Rebinding one name to a new array each iteration grows the live buffers "
            "(jax-ml/jax#10007).",
            verdict(o["rebind_live"] >= 2 * one),
            f"{fmt_bytes(o['rebind_live'])} live after {REBOUND} arrays of {fmt_bytes(one)} were "
            "bound in turn to one name: each replaced array is freed.",
        ),
        Claim(
            "error-holds",
            "A call that raised keeps its arrays while its error is kept (jax-ml/jax#14934).",
            verdict(o["error_kept_live"] >= FAILED_WITH * one and o["error_dropped_live"] < one),
            f"{fmt_bytes(o['error_kept_live'])} live while the exception is referenced (its "
            f"traceback holds the frame), {fmt_bytes(o['error_dropped_live'])} once dropped.",
        ),
        Claim(
            "cycle-delays",
            "Arrays in a reference cycle wait for the cycle collector (jax-ml/jax#725).",
            verdict(y["live_after_drop"] >= 0.5 * steps * one and y["live_after_collect"] < one),
            f"keeping only the last state: {fmt_bytes(y['live_growth'])} of growth from step 1 to "
            f"step {steps} with the collector paused, {fmt_bytes(y['live_after_collect'])} "
            f"after gc.collect(); without the cycle {fmt_bytes(b['live_growth'])}.",
        ),
        Claim(
            "cache-holds",
            "A cache that references the arrays holds them across iterations "
            "(jax-ml/jax#12575, google/flax#2493).",
            verdict(c["live_growth"] >= 0.95 * (steps - 1) * one),
            f"a closure's cache keyed by the parameters: {fmt_bytes(c['live_growth'])} of "
            f"growth from step 1 to step {steps} ({c['live_growth'] / one:.2f} copies).",
        ),
        Claim(
            "loop-constant-leaks",
            "A jitted loop closing over a large constant leaves a live buffer behind "
            "(jax-ml/jax#11448).",
            verdict(o["loop_constant_live"] >= one),
            f"{fmt_bytes(o['loop_constant_live'])} live after the function, its constant "
            f"({fmt_bytes(one)}) and the result were dropped.",
        ),
        guard_claim,
        Claim(
            "analysis-shows",
            "memory_analysis() shows the growth.",
            verdict(max(totals.values()) - min(totals.values()) >= one),
            f"every variant compiles the same step: totals from {fmt_bytes(min(totals.values()))}"
            f" to {fmt_bytes(max(totals.values()))}, while the live growth differs by "
            f"{fmt_bytes(k['live_growth'] - f['live_growth'])}.",
        ),
    ]
