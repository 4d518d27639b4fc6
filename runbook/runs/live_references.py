"""`live-references`' real runs: each variant's loop with its live device bytes read after
every step, what ``python -m runbook run live-references`` measures beyond the compile
(`Case.figures` names `live_figures`); with them, the reports' other patterns (`others`).
The loops themselves are `runbook.cases.live_references`'.

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
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _cache, _subprocess
from .._case_types import Variant
from .._errors import RunbookError, WontFitError
from .._host import available_bytes
from .._quiet import start_backend
from .._render import fmt_bytes
from ..cases import live_references
from ..cases.live_references import CASE, LOOPS, initial_params, param_bytes

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
# jax-ml/jax#10007's loop: arrays bound in turn to one name; #14934's failed call: arrays it
# made before raising.
REBOUND = 5
FAILED_WITH = 4
# Never plan for more live bytes than this share of what the machine has available.
SAFETY = 0.5


def _live_bytes() -> int:
    return sum(int(a.nbytes) for a in jax.live_arrays())


def check_fits(scale: Mapping[str, Any]) -> None:
    """Refuse a scale whose reproduction would keep more than the machine can hold."""
    needed = (scale["steps"] + 2) * param_bytes(scale)
    available = available_bytes()
    if needed > SAFETY * available:
        raise WontFitError(
            f"live-references at {dict(scale)} keeps {fmt_bytes(needed)} alive; this machine "
            f"has {fmt_bytes(available)} available"
        )


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
def session(size: int, steps: int, others: bool) -> dict[str, Any]:
    """`_runs_json` at `size` and `steps` (with `others`: `_others` too), in a fresh process;
    stored (`runbook._cache`) and kept for this process: ``{"runs", "errors", "others"}``."""
    check_fits({"size": size, "steps": steps})
    request = {"kind": "live-runs", "size": size, "steps": steps, "others": others}
    got: dict[str, Any] = _cache.cached(
        request,
        lambda: _subprocess.call(
            "runbook.runs.live_references:_runs_json", size=size, steps=steps, others=others
        ),
        module=live_references.__name__,
    )
    return got


def seed_like(size: int, steps: int) -> bool:
    """The page's own scale (its session also measures the reports' other patterns)."""
    s = CASE.scale(CASE.runnable_scale)
    return (size, steps) == (int(s["size"]), int(s["steps"]))


def run(variant: str, scale: str | None = None) -> dict[str, Any]:
    """One variant's loop, run in a fresh process at `scale` (default: the runnable one):
    ``{"figures", "series"}``."""
    s = CASE.scale(scale or CASE.runnable_scale)
    size, steps = int(s["size"]), int(s["steps"])
    runs: dict[str, Any] = session(size, steps, seed_like(size, steps))["runs"]
    if variant not in runs:
        raise RunbookError(f"unknown variant {variant!r}; valid: {', '.join(runs)}")
    return dict(runs[variant])


def live_figures(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any]
) -> dict[str, int]:
    """`FIGURES` for one variant, measured in a fresh process (`Case.figures`)."""
    size, steps = int(scale["size"]), int(params["steps"])
    runs = session(size, steps, seed_like(size, steps))["runs"]
    return dict(runs[variant.name]["figures"])


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
    got: dict[str, Any] = session(size, steps, True)["others"]
    return got
