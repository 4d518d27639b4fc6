"""The `gather-grad` page's machinery: the write-up's claims, the issue's figures beside ours,
and the XLA options its advice could mean, each tried in a process of its own.

The programs themselves are in `runbook.cases.gather_grad`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .. import _subprocess
from .._case import CaseResult, measure_case
from .._errors import RunbookError
from .._measure import MemoryReport, measure
from .._provenance import Provenance
from .._render import Table, fmt_bytes
from ..cases.gather_grad import CASE, _args, loss
from ._claims import Claim, verdict
from ._history import Note

# The figures, as reported (XLA's CPU memory-usage report, GiB). Quoted, not ours.
REPORTED_GIB = {"forward": 129.01, "gradient": 224.01}
REPORTED_SOURCE = "https://github.com/jax-ml/jax/issues/30015"


def reported_table(result: CaseResult) -> Table:
    """The issue's figures beside ours (int32 indices)."""
    rows = []
    for name, ours in (("forward", "forward"), ("gradient", "grad")):
        mine = result.one(ours, index_dtype="int32").total
        rows.append([name, f"{REPORTED_GIB[name]:.2f} GiB", fmt_bytes(mine),
                     f"{mine / 2**30 - REPORTED_GIB[name]:+.2f} GiB"])  # fmt: skip
    return Table(
        ["program", "reported in #30015", "measured here", "difference"],
        rows,
        f"Reported figures quoted from {REPORTED_SOURCE} (XLA's CPU memory-usage report); "
        f"ours: {result.provenance.label()}, compile time, nothing allocated.",
    )


def reported_by_release() -> Note:
    """Which committed releases give the issue's figures (from the version matrix)."""
    from ._history import history

    h = history("gather-grad")
    found = []
    for name, ours in (("forward", "forward"), ("gradient", "grad")):
        hits = [
            r.jax
            for r in h.releases
            if isinstance(total := r.totals.get(ours), int)
            and f"{total / 2**30:.2f}" == f"{REPORTED_GIB[name]:.2f}"
        ]
        found.append(f"the {name}'s {REPORTED_GIB[name]:.2f} GiB: {', '.join(hits) or 'none'}")
    return Note(
        f"Releases of the version matrix (CPU, {h.first} to {h.last}) that give "
        + "; ".join(found)
        + "."
    )


def manual_grad(x: jax.Array, idx: jax.Array) -> jax.Array:
    """A hand-written gradient of `loss` with respect to `x`: 2.5 at every gathered point."""
    return jnp.zeros_like(x).at[idx[:, 0], idx[:, 1], idx[:, 2]].add(2.5)


# XLA options the write-up's "try XLA flags" advice could mean; each is measured.
FLAG_TRIALS = (
    {"xla_disable_hlo_passes": "fusion"},
    {"xla_disable_hlo_passes": "cpu-instruction-fusion"},
    {"xla_cpu_enable_concurrency_optimized_scheduler": False},
    {"xla_cpu_copy_insertion_use_region_analysis": True},
)


def _flag_trial_temp(flags: dict[str, Any], scale: str, target: str | None) -> int:
    """In a child: the gradient's temporaries compiled with XLA options `flags`."""
    args = _args(CASE.scales[scale], {"index_dtype": "int32"}, False)
    return measure(jax.grad(loss), *args, compiler_options=flags, target=target).temp


def _option(flags: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in flags.items())


def flag_trial(
    flags: dict[str, Any], scale: str = "seed", target: str | None = None
) -> tuple[dict[str, Any], int | str]:
    """``(flags, temp bytes)`` of the gradient compiled with XLA options `flags`, or with
    why there is no figure: an option this jaxlib rejects, or XLA crashing on it.

    Each trial compiles in a fresh process, because some options crash XLA's compiler (a
    crash there is a finding about that jaxlib, recorded here; it must not end the caller).
    """
    try:
        return flags, _subprocess.call(
            "runbook.site.gather_grad:_flag_trial_temp", flags=flags, scale=scale, target=target
        )
    except _subprocess.ChildCrashed as e:
        return flags, _subprocess.failure(e)
    except RunbookError as e:  # an option this jaxlib lacks proves nothing either way
        return flags, f"rejected: {_subprocess.failure(e)}"


@functools.cache
def flag_trials(
    scale: str = "seed", target: str | None = None
) -> tuple[tuple[dict[str, Any], int | str], ...]:
    """`flag_trial` for every option of `FLAG_TRIALS`, once per process: the claims and the
    page's table read the same trials."""
    return tuple(flag_trial(flags, scale, target) for flags in FLAG_TRIALS)


def flag_table(scale: str = "seed") -> Table:
    """Every XLA option of `FLAG_TRIALS`, each compiled in a fresh process: the gradient's
    temporaries, or why there are none (a crash of XLA's compiler is a finding, not an end)."""
    trials = flag_trials(scale)
    rows = [[_option(f), fmt_bytes(t) if isinstance(t, int) else t] for f, t in trials]
    provenance = Provenance.current()
    return Table(
        ["XLA option", "gradient's temporaries (int32 indices)"],
        rows,
        f"jax.grad(loss) at scale {scale!r}, each option in a process of its own; "
        f"{provenance.label()}.",
    )


def _needs(result: CaseResult, name: str, **params: Any) -> MemoryReport:
    """The report, or why this target could not measure it (a `RunbookError`)."""
    found = result.select(name, **params)
    if found:
        return found[0]
    why = next(
        (
            e["reason"]
            for e in result.skipped
            if e["name"] == name and e["params"].items() >= params.items()
        ),
        "not measured",
    )
    raise RunbookError(f"{name} could not be measured on {result.provenance.device_kind}: {why}")


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """Every claim of the write-up, decided by measurements at the seed scale.

    Args:
        result: the case measured with buffers (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.

    Raises:
        RunbookError: the programs the claims rest on cannot be compiled for `target`.
    """
    if result is None:
        result = measure_case("gather-grad", scale, buffers=True, target=target)
    target = result.provenance.target or None
    size = CASE.scales[result.scale]
    args32 = _args(size, {"index_dtype": "int32"}, False)
    fwd = _needs(result, "forward", index_dtype="int32")
    grad = _needs(result, "grad", index_dtype="int32")
    grad16 = _needs(result, "grad", index_dtype="int16")
    fwd16 = _needs(result, "forward", index_dtype="int16")
    whole = _needs(result, "grad-whole-index", index_dtype="int32")
    chunked = _needs(result, "grad-chunked", index_dtype="int32")
    idx_bytes = size["rows"] * 3 * 4
    out = []

    copy = next((b for b in grad.buffers if b.kind == "temp"), None)
    copied = copy is not None and copy.size == idx_bytes and "concatenate" in copy.op
    largest = (
        f"{fmt_bytes(copy.size)} {copy.shape} from {copy.op or copy.instruction} "
        f"({copy.source or 'no source line'})"
        if copy
        else "none (the gradient has no temporaries)"
    )
    out.append(
        Claim(
            "duplicate",
            "The gradient holds a second copy of `idx`, made by a concatenate.",
            verdict(copied),
            f"largest temporary: {largest}; idx itself is {fmt_bytes(idx_bytes)}.",
        )
    )
    # The claims below are about that copy: where the compiler makes none, there is
    # nothing for them to be right or wrong about.
    no_copy = f"this compiler makes no copy of idx to explain (largest temporary: {largest})."

    jax_made = "concatenate" in jax.jit(jax.grad(loss)).lower(*args32).as_text()
    out.append(
        Claim(
            "xla-bug",
            "The copy is an XLA bug.",
            verdict(not (jax_made and whole.temp < grad.temp))
            if copied
            else "not reproducible here",
            "the program JAX hands to XLA already contains the concatenate "
            f"({'present' if jax_made else 'absent'} in the lowered StableHLO): jnp indexing "
            "splits and re-joins the index; passing it whole to lax.gather removes the copy "
            f"({fmt_bytes(grad.temp)} -> {fmt_bytes(whole.temp)} temp)."
            if copied
            else no_copy,
        )
    )

    copy16 = next((b for b in grad16.buffers if b.kind == "temp"), None)
    widened = copy16 is not None and copy16.shape.startswith("s32") and copy16.size == idx_bytes
    out.append(
        Claim(
            "int16-s32",
            "With int16 indices the copy is made as int32 (s32).",
            verdict(widened) if copied else "not reproducible here",
            f"int16 run: largest temporary {copy16.shape if copy16 else '-'}, "
            f"{fmt_bytes(copy16.size) if copy16 else '-'} (twice the int16 input)."
            if copied
            else no_copy,
        )
    )
    ratio16 = grad16.total / fwd16.total
    out.append(
        Claim(
            "int16-fourfold",
            "With int16 indices the gradient needs four times the forward's memory.",
            verdict(abs(ratio16 - 4) < 0.2),
            f"int16: gradient {fmt_bytes(grad16.total)} / forward {fmt_bytes(fwd16.total)} = "
            f"{ratio16:.2f}x (int32: {grad.total / fwd.total:.2f}x).",
        )
    )

    out.append(
        Claim(
            "avoid-gather",
            "Avoid gather operations to save memory.",
            verdict(chunked.overhead > 1.05),
            f"the fixes keep the gather: grad-chunked reaches {chunked.overhead:.4f}x its lower "
            f"bound; grad-whole-index {whole.overhead:.3f}x.",
        )
    )

    manual = measure(manual_grad, *args32, name="manual", target=target)
    out.append(
        Claim(
            "manual-grad",
            "Computing the gradient by hand avoids the inflation.",
            verdict(manual.total < 0.9 * grad.total) if copied else "not reproducible here",
            f"hand-written scatter-add: {fmt_bytes(manual.total)} vs jax.grad "
            f"{fmt_bytes(grad.total)}: jnp indexing of the scatter builds the same index copy."
            if copied
            else f"{no_copy} (hand-written scatter-add: {fmt_bytes(manual.total)}, jax.grad: "
            f"{fmt_bytes(grad.total)})",
        )
    )

    remat = measure(jax.grad(jax.checkpoint(loss)), *args32, name="checkpoint", target=target)
    out.append(
        Claim(
            "checkpoint",
            "Gradient checkpointing (jax.checkpoint) reduces the memory.",
            verdict(remat.total < 0.9 * grad.total),
            f"jax.grad(jax.checkpoint(loss)): {fmt_bytes(remat.total)} vs {fmt_bytes(grad.total)}: "
            "nothing is saved for the backward pass; the copy is made inside it. Chunking "
            f"(grad-chunked, no checkpoint needed) gives {fmt_bytes(chunked.total)}."
            if copied
            else f"jax.grad(jax.checkpoint(loss)): {fmt_bytes(remat.total)} vs "
            f"{fmt_bytes(grad.total)} without it.",
        )
    )

    trials = flag_trials(result.scale, target) if copied else ()
    best = min((t for _, t in trials if isinstance(t, int)), default=grad.temp)
    tried = "; ".join(
        f"{_option(f)}: {fmt_bytes(t) if isinstance(t, int) else t}" for f, t in trials
    )
    out.append(
        Claim(
            "xla-flags",
            "XLA flags or disabled HLO passes can prevent the copy.",
            verdict(best < 0.9 * grad.temp, otherwise="not reproducible here")
            if copied
            else "not reproducible here",
            f"temp with each option tried (default {fmt_bytes(grad.temp)}): {tried}."
            if copied
            else no_copy,
        )
    )

    out.append(
        Claim(
            "profiling",
            "Memory profiling identifies the operations responsible.",
            verdict(bool(copy and copy.source)) if copied else "not reproducible here",
            "XLA's buffer assignment, read back by runbook.measure(..., buffers=True), names the "
            f"concatenate, its shape and the source line {copy.source if copy else '-'}."
            if copied
            else no_copy,
        )
    )
    return out
