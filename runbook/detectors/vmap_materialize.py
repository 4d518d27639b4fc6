"""`vmap-materialize`: temporaries made for the whole batch at once under `jax.vmap`.

`jax.vmap` turns every operation of the per-example function into one batched operation,
so each intermediate exists for the whole batch at the same time. Where a per-example
intermediate is large, the batch of them is what runs out of memory; ``lax.map`` with a
``batch_size`` (or a rolled loop) holds a few examples' worth at a time.

Attention scores and logits made under vmap are their own detectors': each value is named
by one finding.
"""

from __future__ import annotations

import re

from .._hlo import Instruction, Value
from .._program import Finding, NearMiss, Program, finding
from .._render import fmt_bytes
from . import attention_scores, vocab_logits

MIN_SHARE = 0.25  # of the program's total, held at once by vmapped temporaries
MAX_EVIDENCE = 6
PATTERN = "whole-batch temporaries under vmap"
CASE = "vmap-materialize"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "temporaries of operations JAX names vmap(...), outside any loop and neither attention "
        f"scores nor logits, at least {MIN_SHARE:.0%} of the program's total live at once"
    )


_VMAP = re.compile(r"(?:^|/)vmap\(")


def vmapped(program: Program) -> tuple[list[tuple[Value, Instruction]], int]:
    """Temporaries of vmapped operations outside loops, and the most of them live at once."""
    chosen = []
    claimed = attention_scores.scores(program) | vocab_logits.logit_values(program)
    for v in program.values:
        inst = program.module.get(v.instruction)
        if v.kind != "temp" or inst is None or program.in_loop(inst):
            continue  # inside a loop: a chunk of the batch (lax.map), not all of it
        if (v.instruction, v.index) in claimed:
            continue
        if _VMAP.search(program.describe(inst)[0]):
            chosen.append((v, inst))
    return chosen, program.peak(v for v, _ in chosen)


def near_miss(program: Program) -> NearMiss | None:
    """Vmapped temporaries below the share this detector names."""
    chosen, nbytes = program.shared(vmapped)
    if not chosen or nbytes >= MIN_SHARE * program.total:
        return None
    return NearMiss(
        CASE,
        PATTERN,
        nbytes,
        f"{len(chosen)} temporaries of vmapped operations hold {fmt_bytes(nbytes)} at once, "
        f"{nbytes / (program.total or 1):.0%} of the total (named from {MIN_SHARE:.0%})",
    )


def detect(program: Program) -> list[Finding]:
    chosen, nbytes = program.shared(vmapped)
    if not chosen or nbytes < MIN_SHARE * program.total:
        return []
    evidence = [program.buffer(inst, v) for v, inst in chosen]
    lines = sorted({program.describe(inst)[1] for _, inst in chosen} - {""})
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            sorted(evidence, key=lambda b: -b.size)[:MAX_EVIDENCE],
            "Map over the batch in chunks with lax.map(f, xs, batch_size=k) (or a rolled "
            "loop) so that k examples' temporaries exist at a time instead of the whole batch's",
            copy="runbook.cases.vmap_materialize.set_and_sum_mapped",
            detail=f"{len(chosen)} temporaries of vmapped operations, {fmt_bytes(nbytes)} live "
            f"at once, made at {', '.join(lines[:3]) or 'lines XLA did not record'}.",
        )
    ]
