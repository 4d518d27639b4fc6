"""`vocab-logits`: tokens x vocabulary logits materialised for a softmax.

A language model's loss multiplies every token's hidden state by a ``(hidden,
vocabulary)`` matrix; the logits, their softmax and its gradient are
``tokens x vocabulary`` arrays, usually far larger than the matrix itself. Computing the
loss a chunk of tokens (or a slice of the vocabulary) at a time, with the chunk's logits
recomputed in the backward pass, holds one chunk's.
"""

from __future__ import annotations

import math
import re

from .._hlo import Instruction, Shape, Value
from .._program import Finding, NearMiss, Program, finding
from .._render import fmt_bytes
from . import resharding
from ._common import PRODUCTS, held_at_peak, made_from, moved_input, off_peak

MIN_SHARE = 0.05  # of the program's total, held at once by tokens x vocabulary arrays
MAX_EVIDENCE = 6
PATTERN = "tokens x vocabulary logits"
CASE = "vocab-logits"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "a product (outside any loop) with a matrix input, larger than the matrix, whose result "
        "carries a side V of the matrix (its vocabulary); an exponential over a last axis V and "
        "a maximum, both made from those products with no further product (a softmax or "
        "log-softmax of the logits: a sigmoid takes no maximum, attention multiplies again); "
        "every tokens x V array outside loops counts, reported at "
        f"{MIN_SHARE:.0%} of the program's total live at once, and as much live at the "
        "program's peak"
    )


def _matrix_input(program: Program, inst: Instruction | None) -> tuple[int, ...] | None:
    """The sides of the two-axis program input `inst` is, through moves, or None. Axes of
    one are dropped: under pmap each device's input keeps a device axis of one."""
    found = moved_input(program, inst)
    sides = tuple(d for d in found.shape.dims if d != 1) if found is not None else ()
    return sides if len(sides) == 2 else None


def _logits(program: Program) -> dict[tuple[int, int], set[str]]:
    """(V, elements) -> the products with a matrix input, larger than the matrix, whose
    result has a side V of the matrix, outside loops: logits, seen by where they come from."""
    found: dict[tuple[int, int], set[str]] = {}
    for inst in program.module.instructions.values():
        if inst.opcode not in PRODUCTS or len(inst.operands) != 2 or program.in_loop(inst):
            continue
        dims = inst.shape.dims
        elements = math.prod(dims)
        for k in range(2):  # two computed factors (attention's q and k) give nothing
            matrix = _matrix_input(program, program.operand(inst, k))
            if matrix is None or elements <= math.prod(matrix):
                continue
            for v in matrix:
                if dims.count(v) == 1:
                    found.setdefault((v, elements), set()).add(inst.name)
    return found


def _maxima(program: Program) -> list[Instruction]:
    """The maxima a program takes: a softmax over V takes one per row (XLA may reduce in
    stages). A ``reduce`` whose computation's root is a ``maximum``, or that keeps the larger
    of two values and a second result with it: an argmax, into which the compiler may merge
    a softmax's maximum (a model's accuracy takes one over the same logits)."""
    instructions = program.module.instructions.values()
    keeps_larger = {
        i.computation
        for i in instructions
        if i.opcode == "compare" and re.search(r"direction=G[TE]\b", i.attributes)
    }
    found = []
    for inst in instructions:
        if inst.opcode != "reduce" or not inst.calls:
            continue
        applied = program.module.root(inst.calls[0])
        if applied is not None and (
            applied.opcode == "maximum"
            or (applied.opcode == "tuple" and inst.calls[0] in keeps_larger)
        ):
            found.append(inst)
    return found


def _claimed(
    program: Program,
) -> list[tuple[int, int, list[tuple[Value, Instruction]], list[Value]]]:
    """(V, elements, the tokens x V arrays, those of them computed whole on every device)
    for each softmax of logits; each value under one. The arrays computed whole are
    `resharding`'s to name, but a chunked loss frees them too: they count towards whether
    the logits are live at the program's peak (`detect`), never towards their bytes."""
    logits = _logits(program)
    if not logits:
        return []
    # Their softmax: an exponential over a last axis V, outside loops, and a maximum (which
    # a sigmoid has not), both made from the products. The exponential may hold fewer
    # elements than the products (a partitioner computes the logits whole on every device,
    # then slices each device's rows): both sizes count.
    sizes: dict[tuple[int, int], set[int]] = {}
    for inst in program.module.instructions.values():
        dims = inst.shape.dims
        if inst.opcode != "exponential" or not dims or program.in_loop(inst):
            continue
        for key in (k for k in logits if k[0] == dims[-1] and math.prod(dims) <= k[1]):
            if made_from(program, inst, logits[key]):  # the exponential of those very products
                sizes.setdefault(key, {key[1]}).add(math.prod(dims))
    maxima = _maxima(program)
    softmax = {
        key: found
        for key, found in sizes.items()
        if any(made_from(program, m, logits[key]) for m in maxima)
    }
    out = []
    whole = resharding.whole(program)  # computed whole: splitting the batch first
    taken = set(whole)
    for (vocab, elements), counts in sorted(softmax.items(), key=lambda s: -s[0][0] * s[0][1]):
        chosen, computed_whole = [], []
        for v in program.values:
            shape = Shape(v.shape)
            found = program.module.get(v.instruction)
            if not (
                v.kind in ("temp", "output")
                and found is not None
                and vocab in shape.dims
                and math.prod(shape.dims) in counts
                and not program.in_loop(found)
            ):
                continue
            if (v.instruction, v.index) in whole:
                computed_whole.append(v)
            elif (v.instruction, v.index) not in taken:
                chosen.append((v, found))
        taken |= {(v.instruction, v.index) for v, _ in chosen}  # each value under one V
        out.append((vocab, elements, chosen, computed_whole))
    return out


def logit_values(program: Program) -> set[tuple[str, str]]:
    """The values this detector reads as logits (another detector leaves them)."""
    claimed = program.shared(_claimed)
    return {(v.instruction, v.index) for _, _, chosen, _ in claimed for v, _ in chosen}


def detect(program: Program) -> list[Finding]:
    out = []
    for vocab, _, chosen, computed_whole in program.shared(_claimed):
        # Logits computed whole on every device count towards the peak: a chunked loss frees
        # them too (they are resharding's bytes).
        nbytes = held_at_peak(program, [v for v, _ in chosen], MIN_SHARE, computed_whole)
        if nbytes is None:
            continue
        evidence = sorted((program.buffer(i, v) for v, i in chosen), key=lambda b: -b.size)
        tokens = max(math.prod(Shape(v.shape).dims) for v, _ in chosen) // vocab  # per device
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
                detail=f"{len(chosen)} arrays of up to {tokens:,} tokens x {vocab:,} (the "
                "side of the matrix input they are a product with) outside any loop, "
                f"{fmt_bytes(nbytes)} live at once, around a softmax over the vocabulary.",
            )
        )
    return out


def near_miss(program: Program) -> NearMiss | None:
    """Logits held at once, but not at the program's peak."""
    for vocab, _, chosen, computed_whole in program.shared(_claimed):
        values = [v for v, _ in chosen]
        seen = f"{len(values)} tokens x {vocab:,} arrays around a softmax over the vocabulary"
        miss = off_peak(program, CASE, PATTERN, seen, values, MIN_SHARE, computed_whole)
        if miss is not None:
            return miss
    return None
