"""`attention-scores`: attention's T x T score matrix materialised, and kept for the gradient.

Attention compares every token with every other: ``q k^T`` is a ``T x T`` matrix per head,
its softmax another, and the gradient needs them again. Where the compiled program holds
arrays with two axes of the sequence's length, larger than any input, around an
exponential of that shape, the memory grows with the square of the length. Computing the
attention in blocks with its own gradient (or a fused kernel) holds one block at a time.
"""

from __future__ import annotations

import math
import re

from .._hlo import Instruction, Shape, Value
from .._program import Finding, NearMiss, Program, finding
from .._render import fmt_bytes
from . import resharding
from ._common import held_at_peak, is_product, made_from, moved_input, off_peak

MIN_SHARE = 0.10  # of the program's total, held at once by T x T arrays
MIN_TOKENS = 128  # a shorter sequence's scores are small whatever the program does
MAX_EVIDENCE = 6
PATTERN = "T x T attention scores"
CASE = "attention-scores"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"arrays with two axes of length T (at least {MIN_TOKENS}: an axis of an input, or one "
        "an exponential has twice), more "
        "elements than any input, in a program that exponentiates arrays of that shape made "
        "(with no further product) from a product (a dot) of at least T x T elements with T "
        "among their axes that sums over an axis of two operands each with a T axis: a "
        "softmax of scores; "
        f"reported at {MIN_SHARE:.0%} of the program's total live at once, and as much "
        "live at the program's peak"
    )


def _square(dims: tuple[int, ...], tokens: int) -> bool:
    return dims.count(tokens) >= 2


def _lengths(program: Program) -> dict[int, int]:
    """Each candidate length T -> the most elements of an input. A candidate is an axis of
    an input, or an axis twice in an exponential's shape (tokens a model makes itself, such
    as a ViT's patches and class token)."""
    largest = max((math.prod(p.shape.dims) for p in program.parameters if p.shape.dims), default=0)
    axes = {d for p in program.parameters for d in p.shape.dims}
    for inst in program.module.instructions.values():
        if inst.opcode == "exponential":
            dims = inst.shape.dims
            axes |= {d for d in dims if dims.count(d) >= 2}
    return dict.fromkeys((d for d in axes if d >= MIN_TOKENS), largest)


def _contracts(product: Instruction) -> bool:
    """Whether `product` sums over an axis of its operands: a dot with contracting
    dimensions, or a convolution (XLA's TPU compiler writes batched matrix products as
    convolutions whose feature axes are the summed ones)."""
    if product.opcode == "convolution":
        return "dim_labels=" in product.attributes
    return product.opcode == "dot" and bool(
        re.search(r"lhs_contracting_dims=\{\d[\d,]*\}", product.attributes)
    )


def _compares(program: Program, dot: Instruction, tokens: int) -> bool:
    """Whether `dot` sums over a shared axis of two operands that each have T among their
    axes (or a multiple of T, heads merged in): tokens compared with tokens (q k^T). Not an
    outer product (a state-space model's step times its state matrix has two axes of one
    length, and contracts nothing), nor a projection: one factor a program input (a
    weight), the other computed (a state-space model's step sizes, tokens x rank @ rank x
    channels, the channels a multiple of T). Both may be inputs: attention called alone."""
    sides = [program.operand(dot, k) for k in range(2)]
    if not _contracts(dot) or any(side is None for side in sides):
        return False
    inputs = {moved_input(program, side) is not None for side in sides}
    return len(inputs) == 1 and all(  # T may be merged with heads into one axis: (h * T, d)
        any(d >= tokens and d % tokens == 0 for d in side.shape.dims)
        for side in sides
        if side is not None
    )


def _scored(program: Program, tokens: int) -> bool:
    """True when the program exponentiates T x T arrays made, by operations that multiply
    no further, from a product of T x T elements or more with T among its axes (other axes
    may be merged into T's): a softmax of scores. An image's H x W activations have two
    axes of one length, but their exponential (a sigmoid) is made from a convolution."""
    products = set()
    for inst in program.module.instructions.values():
        dims = inst.shape.dims
        if tokens not in dims or math.prod(dims) < tokens * tokens:
            continue
        # A product may print the scores with other axes merged into T's: (b, h * T, T). A
        # GPU library call's operands are not read: its shape is all there is to go on.
        if is_product(inst) and (inst.opcode == "custom-call" or _compares(program, inst, tokens)):
            products.add(inst.name)
    return bool(products) and any(
        inst.opcode == "exponential"
        and _square(inst.shape.dims, tokens)
        and made_from(program, inst, products)
        for inst in program.module.instructions.values()
    )


def _claimed(program: Program) -> list[tuple[int, list[tuple[Value, Instruction]]]]:
    """For each length T whose scores the program makes: the T x T arrays, each value
    counted under one T only."""
    out = []
    taken = resharding.whole(program)  # computed whole: splitting the batch first
    for tokens, largest in sorted(_lengths(program).items(), reverse=True):
        if not _scored(program, tokens):
            continue
        chosen = []
        for v in program.values:
            dims = Shape(v.shape).dims
            found = program.module.get(v.instruction)
            if (
                v.kind in ("temp", "output")
                and found is not None
                and (v.instruction, v.index) not in taken
                and _square(dims, tokens)
                and math.prod(dims) > largest
            ):
                chosen.append((v, found))
        taken |= {(v.instruction, v.index) for v, _ in chosen}
        out.append((tokens, chosen))
    return out


def scores(program: Program) -> set[tuple[str, str]]:
    """The values this detector reads as attention scores (another detector leaves them)."""
    return {(v.instruction, v.index) for _, chosen in program.shared(_claimed) for v, _ in chosen}


def detect(program: Program) -> list[Finding]:
    out = []
    for tokens, chosen in program.shared(_claimed):
        nbytes = held_at_peak(program, [v for v, _ in chosen], MIN_SHARE)
        if nbytes is None:
            continue  # too few, or not held at the peak: blocks would lower another point
        evidence = sorted((program.buffer(i, v) for v, i in chosen), key=lambda b: -b.size)
        out.append(
            finding(
                PATTERN,
                CASE,
                nbytes,
                evidence[:MAX_EVIDENCE],
                "Compute the attention in blocks of queries and keys with its own gradient, "
                "keeping each row's log-sum-exp instead of the scores (or use a fused "
                "attention kernel, cuDNN's on an NVIDIA GPU)",
                copy="runbook.cases.attention_scores.attention_blockwise",
                detail=f"{len(chosen)} arrays with two axes of {tokens:,} tokens, larger than "
                f"any input, {fmt_bytes(nbytes)} live at once, around a product and an "
                "exponential of that shape.",
            )
        )
    return out


def near_miss(program: Program) -> NearMiss | None:
    """Attention scores held at once, but not at the program's peak."""
    for tokens, chosen in program.shared(_claimed):
        seen = f"{len(chosen)} arrays with two axes of {tokens:,} tokens"
        miss = off_peak(program, CASE, PATTERN, seen, [v for v, _ in chosen], MIN_SHARE)
        if miss is not None:
            return miss
    return None
