"""The `inplace-copy` page: the reports beside our figures, the loop timing of
jax-ml/jax#40101, where the copy comes from in the buffer assignment, and the claims. The
reproduction and its fixes are in `runbook.cases.inplace_copy`."""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import jax
import jax.numpy as jnp

from .. import _cache
from .._case import CaseResult, measure_case
from .._render import Table, fmt_bytes
from ..cases.inplace_copy import CASE
from ._claims import Claim, verdict
from ._diagnose_cases import diagnose_case
from ._history import Note, load_versions
from ._pages import cited_reports_table

# What the reports say, summarised; ours is measured beside it.
REPORTS = {
    "JAX's `.at` documentation": "inside jit, `x = x.at[idx].set(y)` is applied in place",
    "jax-ml/jax#9132": "an `.at[].set()` ran out of place, and nothing tells the user so",
    "jax-ml/jax#1034": "a buffer updated one row at a time inside a fori_loop runs in time "
    "that grows with the buffer's size, as if each update copied it",
    "jax-ml/jax#40101": "from jaxlib 0.11.1, on CPU, a small update inside a loop rewrites the "
    "whole buffer at every step: the loop's time grows with the square of its length",
}

COPIED = 0.95  # a variant copies the buffer when its temporaries are at least this share of it
IN_PLACE = 0.05  # ... and updates it in place when they are under this share

LOOP_STEPS = (8192, 32768)  # trip counts of the loop timing: 4x apart
QUADRATIC = 8.0  # time ratio over a 4x longer loop: 4 when linear, 16 when quadratic


def _share(result: CaseResult, name: str) -> float:
    report = result.one(name)
    return report.temp / (report.lower_bound or 1)


def measured(result: CaseResult, name: str) -> bool:
    """False for a variant this JAX cannot build (e.g. no lax.optimization_barrier)."""
    return bool(result.select(name))


def copies(result: CaseResult, name: str) -> bool:
    return _share(result, name) >= COPIED


def in_place(result: CaseResult, name: str) -> bool:
    return _share(result, name) < IN_PLACE


def state(result: CaseResult, name: str) -> str:
    """What `name` did with the buffer: "copy", "in place", or "partial" in between."""
    return "copy" if copies(result, name) else "in place" if in_place(result, name) else "partial"


def _fill(steps: int) -> Any:
    """A loop that writes element t + 1 of a buffer from element t (#1034, #40101)."""

    def body(t: Any, a: jax.Array) -> jax.Array:
        return a.at[t + 1].set(a[t] * 0.5 + 1.0)

    return jax.jit(lambda a: jax.lax.fori_loop(0, steps - 1, body, a))


def _loop_json() -> dict[str, Any]:
    seconds = []
    for steps in LOOP_STEPS:
        run, buf = _fill(steps), jnp.zeros(steps, jnp.float32)
        run(buf).block_until_ready()  # compile and warm up
        best = float("inf")
        for _ in range(3):  # the fastest of three: the loop's cost, not the machine's noise
            start = time.perf_counter()
            run(buf).block_until_ready()
            best = min(best, time.perf_counter() - start)
        seconds.append(best)
    return {"steps": list(LOOP_STEPS), "seconds": seconds}


def loop_timing() -> dict[str, Any]:
    """The loop of jax-ml/jax#40101 run on this CPU at two lengths 4x apart: the fastest
    of three runs of each, in seconds, and their ratio (4 when linear, 16 when quadratic)."""
    found: dict[str, Any] = _cache.cached({"kind": "inplace-loop"}, _loop_json, module=__name__)
    return {**found, "ratio": found["seconds"][1] / found["seconds"][0]}


def _per_step(loop: dict[str, Any]) -> str:
    (short, long), (fast, slow) = loop["steps"], loop["seconds"]
    return (
        f"per step: {fast / short * 1e9:.0f} ns with a {short:,}-element buffer, "
        f"{slow / long * 1e9:.0f} ns with {long:,} elements (jax {jax.__version__}, CPU)"
    )


def _loop_evidence(loop: dict[str, Any]) -> str:
    (short, long), (fast, slow) = loop["steps"], loop["seconds"]
    return (
        f"a fori_loop writing one float32 per step: {fast * 1e3:.2f} ms for {short:,} steps, "
        f"{slow * 1e3:.2f} ms for {long:,} ({loop['ratio']:.1f}x for 4x the steps; 4x is "
        "linear, 16x quadratic)"
    )


@functools.cache
def _finding(target: str | None) -> str:
    found = diagnose_case(CASE.name, "read-after", target=target).findings
    named = [f for f in found if f.case == CASE.name]
    if not named:
        return "runbook.diagnose names no copy"
    return f"runbook.diagnose names it: {named[0].pattern}, {fmt_bytes(named[0].bytes)}"


def reports_table(result: CaseResult) -> Table:
    target = result.provenance.target or None  # "" on this process's backend
    only, after = result.one("update-only"), result.one("read-after")
    ours = [
        (
            f"the update alone, donated: {fmt_bytes(only.temp)} of temporaries; read "
            f"afterwards: {fmt_bytes(after.temp)}, a copy of the {fmt_bytes(after.lower_bound)} "
            "buffer"
        ),
        _finding(target),
        _per_step(loop_timing()),
        _loop_evidence(loop_timing()) + f" (jax {jax.__version__}, this machine's CPU)",
    ]
    return cited_reports_table(REPORTS, ours, result.provenance.label())


def claims(
    result: CaseResult | None = None,
    *,
    target: str | None = None,
    scale: str = "seed",
) -> list[Claim]:
    """The reports' claims and the common advice, decided by measurements.

    Args:
        result: the case measured (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    result = result or measure_case(CASE.name, scale, target=target)
    buffer = fmt_bytes(result.one("update-only").lower_bound)

    def temps(name: str) -> str:
        return f"{name}: {fmt_bytes(result.one(name).temp)} of temporaries"

    loop = loop_timing() if target is None else None

    def avoids(name: str) -> tuple[str, str]:
        if not measured(result, name):
            return "not reproducible here", f"{name}: this JAX lacks an API it needs."
        return verdict(in_place(result, name)), f"{temps(name)}."

    return [
        Claim(
            "donated-in-place",
            "Inside jit, `.at[].set` on a donated buffer that nothing reads afterwards is "
            "applied in place (JAX's `.at` documentation).",
            verdict(in_place(result, "update-only")),
            f"{temps('update-only')} for a {buffer} buffer.",
        ),
        Claim(
            "read-after-copies",
            "Reading the old buffer after the update makes XLA copy the whole buffer, "
            "although it is donated.",
            verdict(copies(result, "read-after")),
            f"{temps('read-after')} for a {buffer} buffer.",
        ),
        Claim(
            "read-first-avoids",
            "Reading the old rows before the update avoids the copy.",
            verdict(in_place(result, "read-first")),
            f"{temps('read-first')}, against {fmt_bytes(result.one('read-after').temp)} when "
            "read after.",
        ),
        Claim(
            "barrier-avoids",
            "Ordering the read before the update with lax.optimization_barrier avoids the copy.",
            *avoids("barrier"),
        ),
        Claim(
            "from-read-avoids",
            "An update computed from the rows it replaces is applied in place.",
            *avoids("from-read"),
        ),
        Claim(
            "loop-rewrites-40101",
            "On CPU, a small update inside a loop rewrites the whole buffer at every step "
            "(jax-ml/jax#40101, from jaxlib 0.11.1).",
            "not reproducible here" if loop is None else verdict(loop["ratio"] >= QUADRATIC),
            "a run-time effect on CPU; compiling for a target does not run the loop."
            if loop is None
            else _loop_evidence(loop) + ".",
        ),
    ]


def _entry(release: dict[str, Any], target: str | None, name: str) -> dict[str, Any] | None:
    where = release if target is None else release.get("targets", {}).get(target, {})
    case = where.get("cases", {}).get(CASE.name) or {}
    entries = [*case.get("variants", []), *case.get("skipped", [])]
    return next((v for v in entries if v["name"] == name), None)


def _copies_in(release: dict[str, Any], target: str | None, name: str) -> bool | None:
    """Whether `name` copied the buffer in `release`'s data (None: not measured there)."""
    variant = _entry(release, target, name)
    if variant is None or variant.get("status", "ok") != "ok":
        return None
    return bool(variant["bytes"]["temp"] >= COPIED * variant["lower_bound"])


def _state(release: dict[str, Any], target: str | None, name: str) -> str:
    found = _copies_in(release, target, name)
    if found is not None:
        return "copy" if found else "in place"
    variant = _entry(release, target, name)
    return (
        "not in this JAX" if variant and variant["status"] == "not applicable" else "not measured"
    )


def by_release(
    names: tuple[str, ...] = ("read-first", "barrier"),
    targets: tuple[str | None, ...] = (None, "h100"),
    releases: list[dict[str, Any]] | None = None,
) -> Table:
    """Per release of the version matrix: whether each fix still copied the buffer, on CPU
    and compiled for each target; and the verdict of the loop claim (jax-ml/jax#40101)."""
    rows = []
    for release in releases if releases is not None else load_versions():
        if CASE.name not in release.get("cases", {}):
            continue
        row = [release["jax"]]
        for name in names:
            for target in targets:
                row.append(_state(release, target, name))
        decided = release.get("claims", {}).get("cases", {}).get(CASE.name) or {}
        loop = next((c for c in decided.get("claims", []) if c["key"] == "loop-rewrites-40101"),
                    None)  # fmt: skip
        row.append(loop["verdict"] if loop else "not measured")
        rows.append(row)
    header = ["jax"] + [f"{n}, {t or 'CPU'}" for n in names for t in targets]
    return Table(
        [*header, "jax-ml/jax#40101 on CPU"],
        rows,
        "From the committed version matrix (compile time, seed scale); the loop claim is "
        "timed on each release's CPU.",
    )


def changes(releases: list[dict[str, Any]] | None = None) -> Note:
    """Where, across the matrix, each fix started or stopped copying on each target."""
    releases = releases if releases is not None else load_versions()
    found = []
    for name in ("read-first", "barrier", "from-read"):
        for target in (None, "h100"):
            states = [(r["jax"], _copies_in(r, target, name)) for r in releases]
            states = [(jax_version, s) for jax_version, s in states if s is not None]
            for (before, a), (after, b) in itertools.pairwise(states):
                if a != b:
                    found.append(
                        f"{name} on {target or 'CPU'}: {'copy' if a else 'in place'} in "
                        f"{before}, {'copy' if b else 'in place'} in {after}"
                    )
    if not found:
        return Note("No fix changed between copy and in place across the matrix.")
    return Note("Changes across releases: " + "; ".join(found) + ".")


def dependence_table(result: CaseResult) -> Table:
    """Each variant: does the update need the read (data dependence), and its temporaries."""
    needs = {"update-only": "nothing is read", "read-after": "no: the read comes after",
             "read-first": "no: only the schedule orders them",
             "barrier": "yes: through the barrier", "from-read": "yes: the update is "
             "computed from the read"}  # fmt: skip
    rows = [
        [v.name, needs[v.name], fmt_bytes(result.one(v.name).temp), state(result, v.name)]
        for v in CASE.variants
        if measured(result, v.name)
    ]  # fmt: skip
    return Table(
        ["variant", "does the update depend on the read?", "temporaries", "buffer"],
        rows,
        result.provenance.label(),
    )


def targets_table(targets: tuple[str, ...] = ("h100", "v5e")) -> Table:
    """Each variant, copy or in place, on this backend and compiled for each target."""
    results = [measure_case(CASE.name, "seed")] + [
        measure_case(CASE.name, "seed", target=t) for t in targets
    ]
    rows = []
    for v in CASE.variants:
        if not all(measured(r, v.name) for r in results):
            continue
        row = [v.name]
        row += [f"{state(r, v.name)} ({fmt_bytes(r.one(v.name).temp)})" for r in results]
        rows.append(row)
    labels = ["CPU"] + [f"{t} (compile-time prediction)" for t in targets]
    return Table(
        ["variant", *labels],
        rows,
        f"Temporaries of each variant, jax {jax.__version__}, one device each.",
    )
