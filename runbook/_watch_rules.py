"""The rules of `runbook.watch`: when a loop's record names a case, and the findings.

Each rule reads only what the watch recorded (live device bytes per step, the arrays added
since the warm-up, every compilation with its seconds, host memory and evidence of constant
folding) and compares it with documented thresholds of `Thresholds`, so that a test can sit
just below or just above each threshold.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from ._buffers import Buffer
from ._program import Finding, finding
from ._render import fmt_bytes

# The fixes a finding points at: the recommended function of each runtime case.
FIXES = {
    "live-references": "runbook.cases.live_references.train_keep_floats",
    "recompilation": "runbook.cases.recompilation.run_bucketed",
    "constant-folding": "runbook.cases.constant_folding.table_from_argument",
}


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When `runbook.watch` names a case. Every rule is one comparison with one of these.

    Attributes:
        warmup: the first steps that the growth and recompilation rules ignore: the first
            step compiles everything and creates the optimizer state, the second may compile
            again (e.g. for donated or committed inputs).
        min_steps: steps after the warm-up needed before growth or recompilation is judged.
        min_growth: bytes the live device arrays must gain after the warm-up (on the device
            that gained most) to count as growth.
        rising: the share of steps after the warm-up in which the live bytes rose; growth
            that is not steady (one large allocation, then flat) is not flagged.
        recompiles: a function compiled in this many steps after the warm-up is
            recompiling, if also in `recompile_share` of them.
        recompile_share: the share of the steps after the warm-up in which the function
            compiled; compiles that die out (shape buckets filling up) are not flagged.
        slow_compile: seconds one compilation may take before it is flagged, if it shows
            constant folding (`fold_constant`).
        compile_host: bytes the host's peak resident set may rise during one compilation
            before it is flagged, if it shows constant folding (`fold_constant`).
        fold_constant: bytes of constants in the compiled program that show constant
            folding (tables XLA computed while compiling, or arrays the function closes
            over); XLA's own slow-folding alarm during the compilation shows it too. A slow
            compilation without either is a large program, not this case.
    """

    warmup: int = 2
    min_steps: int = 3
    min_growth: int = 2**20
    rising: float = 0.75
    recompiles: int = 3
    recompile_share: float = 0.5
    slow_compile: float = 2.0
    compile_host: int = 128 * 2**20
    fold_constant: int = 2**20

    def __post_init__(self) -> None:
        from ._errors import RunbookError

        if self.warmup < 0 or self.min_steps < 1 or self.recompiles < 1:
            raise RunbookError("watch thresholds: warmup >= 0, min_steps >= 1, recompiles >= 1")
        if not 0 < self.rising <= 1 or not 0 <= self.recompile_share <= 1:
            raise RunbookError(
                "watch thresholds: rising is a share in (0, 1], recompile_share in [0, 1]"
            )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step left behind, read when `Watch.step` marked its end.

    Attributes:
        step: the step's number, from 1 (0 is the state when the watch started).
        seconds: wall time since the previous mark (dispatch is asynchronous: work of this
            step may still run).
        live_bytes: bytes of the live `jax.Array`s per device (shards counted on the device
            that holds them).
        live_arrays: how many `jax.Array`s are alive.
        in_use: the device allocator's bytes in use per device where JAX reports it
            (`Device.memory_stats()`; GPU and TPU), else None.
        rss: the host process's resident set in bytes, or None where it cannot be read.
        compiles: compilations during the step.
    """

    step: int
    seconds: float
    live_bytes: dict[str, int]
    live_arrays: int
    in_use: dict[str, int] | None
    rss: int | None
    compiles: int

    @property
    def total(self) -> int:
        """Live array bytes on all devices."""
        return sum(self.live_bytes.values())


@dataclasses.dataclass(frozen=True)
class Compile:
    """One compilation seen during the watch.

    Attributes:
        function: the name JAX compiled (``jit(step)``).
        step: the step it happened in (from 1).
        seconds: XLA's compile time, as JAX logged it.
        types: the argument shapes and dtypes JAX compiled for.
        change: what differed from the previous compilation of the same function: JAX's
            own explanation of the cache miss where it gives one, else the argument types
            compared; "" for the first compilation.
        call_site: where the call that missed the cache was made, when JAX says.
        host_rise: how much the host's peak resident set rose during the compilation (a
            lower bound when the process had a higher peak before), or None.
        constants: bytes of the constants in the compiled program (its optimised HLO), or
            None where the watch could not read the program.
        fold_warnings: how many times XLA logged its slow-folding alarm ("Constant folding
            an instruction is taking > 1s") during the compilation, or None where its log
            could not be read.
    """

    function: str
    step: int
    seconds: float
    types: tuple[str, ...]
    change: str = ""
    call_site: str = ""
    host_rise: int | None = None
    constants: int | None = None
    fold_warnings: int | None = None


@dataclasses.dataclass(frozen=True)
class Growth:
    """Arrays of one shape and dtype that are alive at the last step and were not at the
    end of the warm-up.

    Attributes:
        shape: dtype and shape, e.g. ``float32[128]``.
        arrays: how many more are alive than at the end of the warm-up.
        bytes: the bytes they add.
        holder: what holds one of them (found through `gc.get_referrers` and the
            variables of the frames around the loop), or "" when nothing was found.
    """

    shape: str
    arrays: int
    bytes: int
    holder: str = ""


def _post(steps: Sequence[StepRecord], t: Thresholds) -> list[StepRecord]:
    return [s for s in steps if s.step >= t.warmup]


def live_references(
    steps: Sequence[StepRecord], growth: Sequence[Growth], t: Thresholds
) -> list[Finding]:
    """Live bytes that rise step after step, after the warm-up."""
    post = _post(steps, t)
    if len(post) - 1 < t.min_steps:
        return []
    first, last = post[0], post[-1]
    devices = set(first.live_bytes) | set(last.live_bytes)
    gained = max(
        (last.live_bytes.get(d, 0) - first.live_bytes.get(d, 0) for d in devices), default=0
    )
    rose = sum(b.total > a.total for a, b in itertools.pairwise(post))
    share = rose / (len(post) - 1)
    if gained < t.min_growth or share < t.rising:
        return []
    n = len(post) - 1
    added = sorted(growth, key=lambda g: -g.bytes)
    held = next((g.holder for g in added if g.holder), "")
    where = all_ = ""
    if len(devices) > 1:  # the rate is one device's: say which, and all devices' beside it
        top = max(
            sorted(devices), key=lambda d: last.live_bytes.get(d, 0) - first.live_bytes.get(d, 0)
        )
        total = last.total - first.total
        where = f" on {top}, the device that gained most,"
        all_ = f"; {fmt_bytes(total)} on all devices, {fmt_bytes(total / n)} per step"
    detail = (
        f"the live device arrays gained {fmt_bytes(gained)}{where} in the {n} steps after the "
        f"warm-up ({fmt_bytes(gained / n)} per step{all_}; they rose in {rose} of {n}), from "
        f"{first.live_arrays} to {last.live_arrays} arrays"
        + (
            f"; the arrays added: {', '.join(f'{g.shape} x{g.arrays}' for g in added[:3])}"
            if added
            else ""
        )
        + (f", held by {held}" if held else "")
    )
    evidence = [
        Buffer(g.bytes, f"{g.shape} x{g.arrays}", "live array", "", "", g.holder) for g in added
    ]
    return [
        finding(
            "live device bytes grow every step",
            "live-references",
            gained,
            evidence,
            "Keep what you log as Python numbers (`float(loss)`, or fetch every N steps) and "
            "keep no reference to a step's arrays after the step",
            copy=FIXES["live-references"],
            detail=detail,
        )
    ]


def recompilation(
    steps: Sequence[StepRecord], compiles: Sequence[Compile], t: Thresholds
) -> list[Finding]:
    """A function compiled again in several steps after the warm-up."""
    after = len(_post(steps, t)) - 1
    if after < t.min_steps:
        return []
    by_fn: dict[str, list[Compile]] = {}
    for c in compiles:
        if c.step > t.warmup:
            by_fn.setdefault(c.function, []).append(c)
    need = max(t.recompiles, t.recompile_share * after)
    hot = {fn: cs for fn, cs in by_fn.items() if len({c.step for c in cs}) >= need}
    if not hot:
        return []
    ranked = sorted(hot.items(), key=lambda kv: (-len(kv[1]), -sum(c.seconds for c in kv[1])))
    parts = []
    evidence = []
    for fn, cs in ranked:
        changes = [c.change for c in cs if c.change]
        parts.append(
            f"{fn} compiled {len(cs)} times in {len({c.step for c in cs})} steps after the "
            f"warm-up ({sum(c.seconds for c in cs):.2f} s)"
            + (f"; last change: {changes[-1]}" if changes else "")
        )
        last = cs[-1]
        evidence.append(
            Buffer(0, ", ".join(last.types) or "-", "compile", fn, last.change, last.call_site)
        )
    return [
        finding(
            "a function compiles again and again",
            "recompilation",
            0,
            evidence,
            "Give the function a few fixed shapes (pad inputs to buckets) and pass values "
            "that change as array arguments, not as static arguments or new closures",
            copy=FIXES["recompilation"],
            detail="; ".join(parts),
        )
    ]


def folds(c: Compile, t: Thresholds) -> bool:
    """The compilation shows constant folding: constants of at least `fold_constant` bytes
    in its program, or XLA's slow-folding alarm."""
    return bool(c.fold_warnings) or (c.constants or 0) >= t.fold_constant


def _evidence(c: Compile) -> str:
    parts = []
    if c.constants:
        parts.append(f"its program holds {fmt_bytes(c.constants)} of constants")
    if c.fold_warnings:
        n = c.fold_warnings
        parts.append(f"XLA logged its slow-folding alarm {n} time{'s' if n > 1 else ''}")
    return " and ".join(parts)


def constant_folding(compiles: Sequence[Compile], t: Thresholds) -> list[Finding]:
    """One compilation that takes seconds or much host memory (the warm-up included) and
    shows constant folding: large constants in its program, or XLA's slow-folding alarm.
    Seconds alone are not enough: a large program takes seconds to compile too."""
    slow = [
        c
        for c in compiles
        if (c.seconds >= t.slow_compile or (c.host_rise or 0) >= t.compile_host) and folds(c, t)
    ]
    if not slow:
        return []
    slow.sort(key=lambda c: -c.seconds)
    rise = max((c.host_rise or 0 for c in slow), default=0)
    detail = "; ".join(
        f"{c.function} took {c.seconds:.2f} s to compile at step {c.step}"
        + (f", the host's peak resident set rose {fmt_bytes(c.host_rise)}" if c.host_rise else "")
        + f"; {_evidence(c)}"
        for c in slow[:3]
    ) + (
        ": XLA evaluating operations on constants (tables built inside the function, or "
        "arrays it closes over) at compile time looks like this"
    )
    evidence = [
        Buffer(
            c.host_rise or 0,
            ", ".join(c.types) or "-",
            "compile",
            c.function,
            f"{c.seconds:.2f} s; {_evidence(c)}",
            c.call_site,
        )
        for c in slow
    ]
    return [
        finding(
            "a compilation takes seconds and host memory",
            "constant-folding",
            rise,
            evidence,
            "Pass large tables to the jitted function as arguments instead of building them "
            "from constants inside it or closing over them",
            copy=FIXES["constant-folding"],
            detail=detail,
        )
    ]


def findings(
    steps: Sequence[StepRecord],
    compiles: Sequence[Compile],
    growth: Sequence[Growth],
    t: Thresholds,
) -> tuple[Finding, ...]:
    """Every rule's findings, in the order growth, recompilation, constant folding."""
    return (
        *live_references(steps, growth, t),
        *recompilation(steps, compiles, t),
        *constant_folding(compiles, t),
    )
