"""The `live-references` page's measurements: a real run's live device bytes, step by step,
the claims, the tables and the chart. The case itself (the loops, their inputs) is
`runbook.cases.live_references`, which this module runs.

The figures come from a fresh process (`runbook._subprocess.call`), one per scale, which
runs each variant's loop in turn from the same start, nothing of the one before alive:
live device bytes are the sum of ``nbytes`` over ``jax.live_arrays()``, read after each
step, above those live before the loop (an exact count of the arrays Python references,
so the order of the loops does not change it). Python's cycle collector is paused during each
loop (``gc.disable()``), the case in which the collector does not happen to run between
steps; the last figure is read after an explicit ``gc.collect()``.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .. import _cache, _subprocess
from .._case import CaseResult, measured_here
from .._case_types import Variant
from .._errors import RunbookError, WontFitError
from .._quiet import start_backend
from .._render import Table, fmt_bytes
from ..cases import live_references
from ..cases.live_references import CASE, LOOPS, initial_params, param_bytes
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

# The figures a real run measures (`live_figures`): live device bytes (``jax.live_arrays()``)
# above what was live before the loop (the starting parameters, whose last reference the
# loop takes).
FIGURES = {
    "live_first_step": "live device bytes after the first step, above those before it",
    "live_growth": "live device bytes after the last step, above those after the first",
    "live_per_step": "live_growth / (steps - 1)",
    "live_after_loop": "after the loop returned (its final parameters and log kept)",
    "live_after_drop": "after the log (and the loop's other results but the parameters) "
    "were dropped, before any cycle collection",
    "live_after_collect": "after gc.collect()",
}

RECOMMENDED = CASE.recommended or "keep-floats"
KEY_FIGURE = CASE.key_figure or "live_growth"
# jax-ml/jax#10007's loop: arrays bound in turn to one name; #14934's failed call: arrays it
# made before raising.
REBOUND = 5
FAILED_WITH = 4
# Never plan for more live bytes than this share of what the machine has available.
SAFETY = 0.5


def _live_bytes() -> int:
    return sum(int(a.nbytes) for a in jax.live_arrays())


def _check_fits(scale: Mapping[str, Any]) -> None:
    """Refuse a scale whose reproduction would keep more than the machine can hold."""
    from .._runtime import _available_host_bytes

    needed = (scale["steps"] + 2) * param_bytes(scale)
    available = _available_host_bytes()
    if needed > SAFETY * available:
        raise WontFitError(
            f"live-references at {dict(scale)} keeps {fmt_bytes(needed)} alive; this machine "
            f"has {fmt_bytes(available)} available"
        )


def watched_loop(variant: str, steps: int, mark_step: Callable[[], None]) -> None:
    """Run `variant`'s loop (a name in `runbook.cases.live_references.LOOPS`) for `steps`
    steps at the case's runnable scale, calling `mark_step()` once per step."""
    scale = CASE.scale(CASE.runnable_scale)
    _check_fits({**scale, "steps": steps})
    if variant not in LOOPS:
        raise RunbookError(f"unknown variant {variant!r}; valid: {', '.join(LOOPS)}")
    start = [initial_params(scale["size"])]
    LOOPS[variant](start.pop(), steps, mark_step)


def _one_run(variant: str, size: int, steps: int) -> dict[str, Any]:
    """One variant's loop, its live bytes after each step and the figures of `FIGURES`."""
    held = [initial_params(size)]
    gc.collect()
    gc.disable()  # the collector does not run between steps (see the module's docstring)
    try:
        base = _live_bytes()
        series: list[int] = []
        params, log = LOOPS[variant](held.pop(), steps, lambda: series.append(_live_bytes() - base))
        figures = {
            "live_first_step": series[0],
            "live_growth": series[-1] - series[0],
            "live_per_step": (series[-1] - series[0]) // max(steps - 1, 1),
            "live_after_loop": _live_bytes() - base,
        }
        losses = [float(e["loss"]) for e in log]
        del log
        figures["live_after_drop"] = _live_bytes() - base
        gc.collect()
        figures["live_after_collect"] = _live_bytes() - base
    finally:
        gc.enable()
    return {"figures": figures, "series": series, "result": (np.asarray(params), losses)}


def _error(got: tuple[Any, list[float]], want: tuple[Any, list[float]]) -> float:
    """max |got - want| / (|want| + 1) over the final parameters and every step's loss."""
    a = np.concatenate([np.ravel(got[0]), np.asarray(got[1], np.float32)])
    b = np.concatenate([np.ravel(want[0]), np.asarray(want[1], np.float32)])
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b) / (np.abs(b) + 1.0)))


def _runs_json(size: int, steps: int, others: bool) -> dict[str, Any]:
    """In a fresh process: every variant's loop in turn (`_one_run`), each from the same
    start with nothing of the one before it alive, and each one's `_error` against the
    reproduction's result; with `others`, `_others` too."""
    start_backend()
    jax.block_until_ready(live_references.train_step(initial_params(size)))  # compiled once
    jax.block_until_ready(jnp.zeros(()))
    runs = {name: _one_run(name, size, steps) for name in LOOPS}
    # Same result: every loop's final parameters and losses against the reproduction's.
    want = runs["keep-arrays"]["result"]
    errors = {name: _error(r.pop("result"), want) for name, r in runs.items()}
    return {"runs": runs, "errors": errors, "others": _others(size) if others else None}


@functools.cache
def _session(size: int, steps: int, others: bool) -> dict[str, Any]:
    _check_fits({"size": size, "steps": steps})
    request = {"kind": "live-runs", "size": size, "steps": steps, "others": others}
    got: dict[str, Any] = _cache.cached(
        request,
        lambda: _subprocess.call(
            "runbook.site.live_references:_runs_json", size=size, steps=steps, others=others
        ),
        module=__name__,
    )
    return got


def _seed_like(size: int, steps: int) -> bool:
    """The page's own scale (its session also measures the reports' other patterns)."""
    s = CASE.scale(CASE.runnable_scale)
    return (size, steps) == (int(s["size"]), int(s["steps"]))


def run(variant: str, scale: str | None = None) -> dict[str, Any]:
    """One variant's loop, run in a fresh process at `scale` (default: the runnable one):
    ``{"figures", "series"}``."""
    s = CASE.scale(scale or CASE.runnable_scale)
    size, steps = int(s["size"]), int(s["steps"])
    runs: dict[str, Any] = _session(size, steps, _seed_like(size, steps))["runs"]
    if variant not in runs:
        raise RunbookError(f"unknown variant {variant!r}; valid: {', '.join(runs)}")
    return dict(runs[variant])


def live_figures(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any]
) -> dict[str, int]:
    """`FIGURES` for one variant, measured in a fresh process (`Case.figures`)."""
    size, steps = int(scale["size"]), int(params["steps"])
    runs = _session(size, steps, _seed_like(size, steps))["runs"]
    return dict(runs[variant.name]["figures"])


def checks(
    errors: Mapping[str, float], steps: int, tolerance: float | None = None
) -> list[dict[str, Any]]:
    """The same-result rows (`runbook.site.verify_table`'s) of each fix's `_error`."""
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
    return checks(_session(size, steps, _seed_like(size, steps))["errors"], steps)


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


# --- the reports' other patterns, each in a fresh process ------------------------------------


def _others(size: int) -> dict[str, Any]:
    """jax-ml/jax#10007's rebinding loop, #14934's failed call,
    #11448's loop over a captured constant, and the garbage-collection guard on a cycle."""
    import os
    import tempfile

    from jax import lax

    out: dict[str, Any] = {}
    jax.block_until_ready(jnp.ones(size))
    gc.collect()
    base = _live_bytes()

    # jax-ml/jax#10007: a name rebound to a new array each iteration.
    a = None
    for _ in range(REBOUND):
        a = jnp.ones(size, jnp.float32)
    out["rebind_live"] = _live_bytes() - base
    del a

    # jax-ml/jax#14934: a call that raises after making arrays; the error kept, as a
    # notebook keeps the last one.
    def failing() -> None:
        held = [jnp.ones(size, jnp.float32) + i for i in range(FAILED_WITH)]
        raise ValueError(f"failed holding {len(held)} arrays")

    kept: list[BaseException] = []
    try:
        failing()
    except ValueError as e:
        kept.append(e)
    out["error_kept_live"] = _live_bytes() - base
    kept.clear()
    out["error_dropped_live"] = _live_bytes() - base

    # jax-ml/jax#11448: a jitted fori_loop closing over a large constant, all dropped.
    def make_and_run() -> None:
        data = jnp.asarray(np.random.default_rng(0).standard_normal(size, dtype=np.float32))
        jitted = jax.jit(lambda x: lax.fori_loop(0, 3, lambda i, c: c + data, x))
        jax.block_until_ready(jitted(jnp.zeros(size, jnp.float32)))

    make_and_run()
    gc.collect()
    out["loop_constant_live"] = _live_bytes() - base

    # The guard: does it report the cycle's arrays when the collector frees them?
    if not hasattr(jax.config, "jax_array_garbage_collection_guard"):
        out["guard"] = None
        return out
    reports = {}
    for name in ("cycle", "cycle-broken"):
        with tempfile.TemporaryFile(mode="w+") as err:
            saved = os.dup(2)
            os.dup2(err.fileno(), 2)
            try:
                jax.config.update("jax_array_garbage_collection_guard", "log")
                gc.disable()
                params, log = LOOPS[name](initial_params(256), 3)
                del params, log
                gc.collect()
            finally:
                gc.enable()
                jax.config.update("jax_array_garbage_collection_guard", "allow")
                os.dup2(saved, 2)
                os.close(saved)
            err.seek(0)
            reports[name] = err.read().count("garbage collector")
    out["guard"] = reports
    return out


def others(scale: str | None = None) -> dict[str, Any]:
    """`_others` at the runnable scale, measured in the same fresh process as its loops."""
    s = CASE.scale(scale or CASE.runnable_scale)
    size, steps = int(s["size"]), int(s["steps"])
    got: dict[str, Any] = _session(size, steps, True)["others"]
    return got


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
