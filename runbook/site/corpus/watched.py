"""`runbook.watch` on real training loops: the corpus's single-device steps, run for real at
their tiny scale (`tests/test_watch_real.py`, and docs/_data/corpus/watched.json for the
watch page, made by ``nox -s "real-corpus(newest)" -- --watch`` and its oldest twin).

Each loop keeps its losses as Python floats. A steady loop keeps nothing else; a leaking one
appends to a list each step a new batch (a data loader's, copied to the device) or the
step's model. The truth the watch is held to is `jax.live_arrays()`: the bytes of the live
arrays the list holds, after each step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp

from ..._render import Table, fmt_bytes
from ..._watch import Watch, watch
from .real import get

OUT = pathlib.Path(__file__).resolve().parents[3] / "docs" / "_data" / "corpus" / "watched.json"
STEPS = 12
# What a leaking loop keeps, by the step argument it is: a corpus step's first argument is
# its state or model, its second its batch.
KEPT = {"model": 0, "batch": 1}
# At the tiny scale a step's batch or model is tens of KiB, under the default 1 MiB of
# growth: the leaking loops lower that threshold and keep every other one.
TINY_GROWTH = 2**16


@dataclasses.dataclass(frozen=True)
class Loop:
    """A program's loop: what it keeps each step, besides its losses."""

    program: str
    keeps: str  # "nothing", or a key of `KEPT`

    @property
    def overrides(self) -> dict[str, Any]:
        return {} if self.keeps == "nothing" else {"min_growth": TINY_GROWTH}


# flax.linen with dropout and a donated state, batch norm, an equinox scan; then two leaks.
LOOPS = (
    Loop("lm1b", "nothing"),
    Loop("resnet50-imagenet", "nothing"),
    Loop("eqx-mamba", "nothing"),
    Loop("resnet50-imagenet", "batch"),
    Loop("eqx-mamba", "model"),
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a loop: the watch (None unwatched), the bytes the list held after each
    step, and the live arrays before the loop and after its `with` block."""

    loop: Loop
    watch: Watch | None
    held: list[int]
    before: int
    after: int

    def truth_per_step(self) -> float:
        """What the list gained per step after the watch's warm-up, in live-array bytes."""
        if not self.held or self.watch is None:
            return 0.0
        warmup = self.watch.thresholds.warmup
        return (self.held[-1] - self.held[warmup - 1]) / (len(self.held) - warmup)

    def reported_per_step(self) -> float:
        """What the watch's finding says the loop gains per step (0 without one)."""
        if self.watch is None or not self.watch.findings:
            return 0.0
        return self.watch.findings[0].bytes / (self.watch.steps - self.watch.thresholds.warmup)


def _advance(out: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """The next step's arguments and this step's loss, from what a corpus step returns:
    ``(state, metrics)`` (flax) or ``(model, optimizer state, loss)`` (equinox)."""
    if len(out) == 2:
        state, metrics = out
        return (state, *args[1:]), metrics["loss"]
    model, opt_state, loss = out
    return (model, opt_state, *args[2:]), loss


def _owned(kept: list[Any]) -> int:
    ids = {id(x) for x in jax.tree.leaves(kept)}
    return sum(a.nbytes for a in jax.live_arrays() if id(a) in ids)


def run(loop: Loop, watched: bool = True) -> Run:
    """`STEPS` steps of `loop`, under `runbook.watch` (its default thresholds but for the
    leaks' `TINY_GROWTH`) or not."""
    fn, args = get(loop.program).build("tiny", True)
    jax.block_until_ready(args)
    kept_arg = KEPT.get(loop.keeps)
    kept: list[Any] = []
    losses: list[float] = []
    held: list[int] = []
    before = len(jax.live_arrays())
    w = watch(**loop.overrides) if watched else None
    with w if w is not None else contextlib.nullcontext():
        for _ in range(STEPS):
            if loop.keeps == "batch":  # a new batch each step, as a loader gives
                b = KEPT["batch"]
                args = (*args[:b], jax.tree.map(jnp.copy, args[b]), *args[b + 1 :])
            args, loss = _advance(fn(*args), args)
            losses.append(float(loss))
            if kept_arg is not None:
                kept.append(args[kept_arg])
                held.append(_owned(kept))
            if w is not None:
                w.step()
    return Run(loop, w, held, before, len(jax.live_arrays()))


def measure() -> list[dict[str, Any]]:
    """Each loop watched, then run again unwatched: a row of what the watch named, its
    growth rate and the live arrays' (bytes per step), and the arrays each run left."""
    rows = []
    for loop in LOOPS:
        seen, bare = run(loop), run(loop, watched=False)
        assert seen.watch is not None
        first = max(seen.watch.compiles, key=lambda c: c.seconds)
        rows.append({
            "program": loop.program, "keeps": loop.keeps, "steps": seen.watch.steps,
            "longest_compile": {"step": first.step, "seconds": first.seconds},
            "cases": list(seen.watch.cases),
            "reported_per_step": seen.reported_per_step(), "truth_per_step": seen.truth_per_step(),
            "left_watched": seen.after - seen.before, "left_unwatched": bare.after - bare.before,
        })  # fmt: skip
    return rows


def write(provenance: dict[str, Any], path: pathlib.Path = OUT) -> dict[str, Any]:
    """`measure()` at this JAX release, merged into `path` beside the other releases' rows,
    with the `provenance` of this release (the releases and machine that measured it)."""
    measured = measure()
    data = json.loads(path.read_text()) if path.exists() else {"releases": {}, "rows": []}
    data["releases"][jax.__version__] = provenance
    rows = [r for r in data["rows"] if r["jax"] != jax.__version__]
    today = time.strftime("%Y-%m-%d")
    rows += [{**r, "jax": jax.__version__, "date": today} for r in measured]
    data["rows"] = rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def table(data: dict[str, Any] | None = None) -> Table:
    """The committed rows, one per loop and release: what the watch named, its growth rate
    against the live arrays', and the arrays left alive after the `with` block."""
    data = data or json.loads(OUT.read_text())
    rows = [
        [r["program"], r["keeps"], r["jax"],
         f"step {r['longest_compile']['step']}, {r['longest_compile']['seconds']:.1f} s",
         ", ".join(r["cases"]) or "no finding",
         fmt_bytes(r["reported_per_step"]) if r["cases"] else "-",
         fmt_bytes(r["truth_per_step"]) if r["keeps"] != "nothing" else "-",
         f"{r['left_watched']} / {r['left_unwatched']}"]
        for r in data["rows"]
    ]  # fmt: skip
    made = "; ".join(
        f"jax {v} on {p['machine']}, {p['date']}" for v, p in sorted(data["releases"].items())
    )
    return Table(
        ["program", "kept each step", "jax", "longest compile", "the watch names",
         "growth per step (watch)", "growth per step (live arrays)",
         "arrays the loop left alive (watched / not)"],
        rows,
        f"The real corpus's single-device steps at their tiny scale on the CPU, {STEPS} steps "
        "each, the losses kept as floats; the leaking loops' growth threshold lowered to "
        f"{fmt_bytes(TINY_GROWTH)}, every other threshold the default. Made by "
        f'`nox -s "real-corpus(newest)" -- --watch` and its oldest twin: {made} '
        "(docs/_data/corpus/watched.json).",
    )  # fmt: skip
