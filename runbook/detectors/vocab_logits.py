"""`vocab-logits`: tokens x vocabulary logits materialised for a softmax.

A language model's loss multiplies every token's hidden state by a ``(hidden,
vocabulary)`` matrix; the logits, their softmax and its gradient are
``tokens x vocabulary`` arrays, usually far larger than the matrix itself. Computing the
loss a chunk of tokens (or a slice of the vocabulary) at a time, with the chunk's logits
recomputed in the backward pass, holds one chunk's.
"""

from __future__ import annotations

import math

from .._hlo import Shape
from .._program import Finding, Program, finding
from .._render import fmt_bytes

MIN_SHARE = 0.10  # of the program's total, held at once by tokens x vocabulary arrays
MAX_EVIDENCE = 6
PATTERN = "tokens x vocabulary logits"
CASE = "vocab-logits"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "an exponential outside any loop over an array whose last axis is the larger side V of a "
        "matrix input and which is larger than that matrix; every tokens x V array outside loops "
        f"counts, reported at {MIN_SHARE:.0%} of the program's total live at once"
    )


def _vocabularies(program: Program) -> dict[int, int]:
    """Vocabulary size -> the most elements of a matrix input with it as its larger side."""
    found: dict[int, int] = {}
    for p in program.parameters:
        dims = p.shape.dims
        if len(dims) == 2 and max(dims) > min(dims):
            found[max(dims)] = max(found.get(max(dims), 0), math.prod(dims))
    return found


def detect(program: Program) -> list[Finding]:
    vocabularies = _vocabularies(program)
    if not vocabularies:
        return []
    # A softmax over the vocabulary: an exponential of an array whose last axis is a
    # vocabulary, larger than the matrix (more tokens than hidden units), outside any loop.
    softmax = set()
    for inst in program.module.instructions.values():
        dims = inst.shape.dims
        if inst.opcode != "exponential" or not dims or program.in_loop(inst):
            continue
        matrix = vocabularies.get(dims[-1])
        if matrix is not None and math.prod(dims) > matrix:
            softmax.add((dims[-1], math.prod(dims)))
    out = []
    taken: set[tuple[str, str]] = set()
    for vocab, elements in sorted(softmax, key=lambda s: -s[0] * s[1]):
        chosen = []
        for v in program.values:
            if (v.instruction, v.index) in taken:
                continue
            shape = Shape(v.shape)
            found = program.module.get(v.instruction)
            if (
                v.kind in ("temp", "output")
                and found is not None
                and vocab in shape.dims
                and math.prod(shape.dims) == elements
                and not program.in_loop(found)
            ):
                chosen.append((v, found))
        taken |= {(v.instruction, v.index) for v, _ in chosen}
        nbytes = program.peak(v for v, _ in chosen)
        if not chosen or nbytes < MIN_SHARE * program.total:
            continue
        evidence = sorted((program.buffer(i, v) for v, i in chosen), key=lambda b: -b.size)
        out.append(
            finding(
                PATTERN,
                CASE,
                nbytes,
                evidence[:MAX_EVIDENCE],
                "Compute the loss a chunk of tokens (or a slice of the vocabulary) at a time "
                "under lax.scan with each chunk checkpointed, so that one chunk's logits exist "
                "at a time",
                copy="runbook.cases.vocab_logits.loss_vocab_tiles",
                detail=f"{len(chosen)} arrays of {elements // vocab:,} tokens x {vocab:,} "
                f"(the larger side of a matrix input) outside any loop, {fmt_bytes(nbytes)} "
                "live at once, around a softmax over the vocabulary.",
            )
        )
    return out
