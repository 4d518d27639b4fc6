"""`recompilation`'s real runs: each variant's loop of ``calls`` steps in a fresh process,
measured (resident set, compile count, seconds), what ``python -m runbook run recompilation``
measures beyond the compile (`Case.figures` names `run_figures`). The loops themselves are
`runbook.cases.recompilation`'s; the case's page shows these runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .. import _cache, _subprocess
from .._case_types import Variant
from .._errors import WontFitError
from .._host import available_bytes, settle
from .._quiet import start_backend
from .._render import fmt_bytes
from ..cases import recompilation
from ..cases.recompilation import (
    bucket,
    loss,
    masked_loss,
    run_bucketed,
    run_each_shape,
    run_each_static,
    run_traced_static,
    scaled_loss,
)

# The figures a real run measures (`run_figures`): resident set in bytes above the process
# before the loop, counts of compilations, seconds.
FIGURES = {
    "rss_growth": "resident set after the loop",
    "compile_count": "compilations during the loop",
    "loop_seconds": "the loop, compiles included",
    "rerun_seconds": "the same loop again, every executable cached (the compute alone)",
    "rows_count": "rows the loop computed, padding included",
    "rss_deleted": "resident after deleting the jitted function (no clear_caches())",
    "rss_cleared": "resident after jax.clear_caches() (as rss_deleted where this JAX has none)",
    "clear_caches_count": "jax.clear_caches() calls made (0: this JAX has none)",
}
# An upper bound on what one executable of the case's step adds to the resident set (about
# 2 MiB measured on CPU): a scale whose loop could pass half the free memory is refused.
EXECUTABLE_BOUND = 8 * 2**20
# Steps of a loop after which its resident set is read (settled: collected and trimmed,
# about 0.1 s each), besides the first; the trace marks the others None.
CHECKPOINTS = 6
# Keys each variant's step is compiled at before its loop (`warm_up`).
WARM_UPS = 3


def make_step(variant: str) -> Callable[..., Any]:
    """The jitted function each variant's loop calls (a new one, with an empty cache)."""
    if variant == "each-shape":
        return jax.jit(loss)
    if variant == "bucketed":
        return jax.jit(masked_loss)
    if variant == "each-static":
        return jax.jit(scaled_loss, static_argnames="temperature")
    if variant == "traced-static":
        return jax.jit(scaled_loss)
    raise ValueError(f"no loop for variant {variant!r}")


# Each variant's loop, by name: what `run_loop`, `warm_up` and `_loop_json` run.
LOOPS: dict[str, Callable[..., list[float]]] = {
    "each-shape": run_each_shape,
    "bucketed": run_bucketed,
    "each-static": run_each_static,
    "traced-static": run_traced_static,
}


def _available() -> int:
    return available_bytes()


_COMPILES: list[str] = []


def _listen(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if "backend_compile" in event:
        _COMPILES.append(event)


def count_compiles() -> None:
    """Count backend compilations from here on (one listener per process)."""
    if not _COMPILES:
        _COMPILES.append("listening")
        jax.monitoring.register_event_duration_secs_listener(_listen)


def compiles() -> int:
    """Backend compilations this process made since `count_compiles` started listening."""
    return len(_COMPILES) - 1


def _guard(scale: Mapping[str, Any]) -> None:
    bound = scale["calls"] * EXECUTABLE_BOUND
    if bound > _available() / 2:
        raise WontFitError(
            f"{scale['calls']} compilations could hold up to {fmt_bytes(bound)}, more than "
            f"half the host memory available ({fmt_bytes(_available())}): use a smaller scale"
        )


def _private_step(variant: str) -> Callable[..., Any]:
    """`variant`'s jitted step over a function of its own: the same program, another cache
    (JAX keys its caches on the Python function, so the loop's step shares nothing)."""
    if variant == "each-shape":
        return jax.jit(lambda params, x: recompilation.loss(params, x))
    if variant == "bucketed":
        return jax.jit(lambda params, x, n: recompilation.masked_loss(params, x, n))
    return jax.jit(
        lambda params, x, temperature: recompilation.scaled_loss(params, x, temperature),
        static_argnames="temperature" if variant == "each-static" else (),
    )


# The loops' inputs: the row counts, batches and temperatures each step is given.
def row_counts(calls: int, seed: int = 0) -> list[int]:
    """`calls` distinct row counts, 1 to `calls`, in a shuffled order."""
    return [int(r) + 1 for r in np.random.default_rng(seed).permutation(calls)]


def batches(scale: Mapping[str, Any], rows: Sequence[int], seed: int = 1) -> list[np.ndarray]:
    """One host batch of `features` columns per row count in `rows`."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((r, scale["features"]), dtype=np.float32) for r in rows]


def temperatures(calls: int) -> list[float]:
    """A schedule of `calls` distinct temperatures, annealed from 2 towards 1."""
    return [1.0 + 1.0 / (1 + i) for i in range(calls)]


def loop_inputs(variant: str, scale: Mapping[str, Any], steps: int) -> tuple[Any, ...]:
    """What `variant`'s loop runs on besides its step and weights, for `steps` steps:
    batches of every row count 1 to `steps` (shapes), or batches of `calls` rows with a
    temperature each (statics)."""
    if variant in ("each-shape", "bucketed"):
        return (batches(scale, row_counts(steps)),)
    return (
        batches(scale, [scale["calls"]] * steps),
        temperatures(steps),
    )


def run_loop(
    variant: str,
    scale: Mapping[str, Any],
    steps: int,
    on_step: Callable[[], None] | None = None,
    step: Callable[..., Any] | None = None,
) -> list[float]:
    """`variant`'s loop for `steps` steps at `scale`, with a new jitted step unless given."""
    return LOOPS[variant](
        step or make_step(variant),
        recompilation.init_params(scale),
        *loop_inputs(variant, scale, steps),
        on_step=on_step,
    )


def rows_computed(variant: str, steps: int, calls: int) -> int:
    """Rows the loop's steps compute, padding included (the rows needed: `rows_needed`)."""
    if variant == "bucketed":
        return sum(bucket(r) for r in row_counts(steps))
    return rows_needed(variant, steps, calls)


def rows_needed(variant: str, steps: int, calls: int) -> int:
    """Rows the loop's batches hold."""
    return sum(row_counts(steps)) if variant in ("each-shape", "bucketed") else steps * calls


def warm_up(variant: str, scale: Mapping[str, Any], weights: Mapping[str, jax.Array]) -> None:
    """Run `variant`'s loop for `WARM_UPS` steps on a step of its own (`_private_step`): the
    smallest row counts, or temperatures off the schedule. What a process pays once for its
    first programs of a kind (the compiler's and the runtime's code and pools for small
    shapes: about 8 MiB on CPU) is then paid before the loop is measured, and the loop still
    compiles every key itself."""
    step = _private_step(variant)
    run = LOOPS[variant]
    if variant in ("each-shape", "bucketed"):
        run(step, weights, batches(scale, list(range(1, WARM_UPS + 1)), seed=3))
    else:
        x = batches(scale, [scale["calls"]] * WARM_UPS, seed=3)
        run(step, weights, x, [0.5**i for i in range(1, WARM_UPS + 1)])


def _loop_json(variant: str, scale: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: `variant`'s loop of ``calls`` steps, measured (`FIGURES`), and the
    trace of ``[compilations, resident growth]`` after each step."""
    start_backend()
    _guard(scale)
    calls = scale["calls"]
    count_compiles()
    weights = recompilation.init_params(scale)
    run = LOOPS[variant]
    warm_up(variant, scale, weights)
    step = make_step(variant)
    inputs = loop_inputs(variant, scale, calls)
    base, before = settle(), compiles()
    trace: list[list[int | None]] = []
    every = max(calls // CHECKPOINTS, 1)
    marking = [0.0]  # seconds spent reading the resident set, left out of the loop's

    def mark() -> None:
        if (len(trace) + 1) % every == 0 or len(trace) == 0:
            t = time.perf_counter()
            trace.append([compiles() - before, settle() - base])
            marking[0] += time.perf_counter() - t
        else:
            trace.append([compiles() - before, None])

    start = time.perf_counter()
    run(step, weights, *inputs, on_step=mark)
    seconds = time.perf_counter() - start - marking[0]
    figures: dict[str, float] = {
        "rss_growth": settle() - base,
        "compile_count": compiles() - before,
        "loop_seconds": seconds,
    }
    start = time.perf_counter()
    run(step, weights, *inputs)
    figures["rerun_seconds"] = time.perf_counter() - start
    figures["rows_count"] = rows_computed(variant, calls, calls)
    del step
    figures["rss_deleted"] = settle() - base
    clear = getattr(jax, "clear_caches", None)
    figures["clear_caches_count"] = 0 if clear is None else 1
    if clear is not None:
        clear()
    figures["rss_cleared"] = settle() - base  # may be below the start: pages given back
    return {"figures": figures, "trace": trace}


_RUNS: dict[str, dict[str, Any]] = {}


def loop_run(variant: str, scale: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """`_loop_json` for one variant, in a fresh process; stored (`runbook._cache`) and kept
    for this process, so that the figures and the trace come from one run."""
    request = {"kind": "recompilation-loop", "variant": variant, "scale": dict(scale),
               "params": dict(params)}  # fmt: skip
    key = json.dumps(request, sort_keys=True)
    if key not in _RUNS:
        _RUNS[key] = _cache.cached(
            request,
            lambda: _subprocess.call(
                "runbook.runs.recompilation:_loop_json",
                variant=variant,
                scale=dict(scale),
                params=dict(params),
            ),
            module=recompilation.__name__,
        )
    return _RUNS[key]


def run_figures(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any]
) -> dict[str, float]:
    """`FIGURES` for one variant, measured in a fresh process (`Case.figures`)."""
    figures: dict[str, float] = loop_run(variant.name, scale, params)["figures"]
    return figures
