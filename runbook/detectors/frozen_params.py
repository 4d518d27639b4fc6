"""`frozen-params`: parameters that get no gradient still cost gradient-sized memory.

Differentiating a whole parameter tree when part of it is frozen (under
``lax.stop_gradient``, or unused) gives full-size zero gradients: real arrays the size of
the frozen weights. In a training step the optimizer then keeps and updates state for
them with no gradient at all. Differentiating only the trainable subtree avoids both.
"""

from __future__ import annotations

from .._buffers import Buffer
from .._hlo import Instruction
from .._program import Finding, Program, finding
from .._render import fmt_bytes
from ._common import state_pairs

MIN_SHARE = 0.05  # of the program's total
PATTERN = "frozen parameters differentiated"
CASE = "frozen-params"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "in a program with a reverse-mode pass: outputs that are broadcast zeros shaped like an "
        "input, and state outputs updated from the old state alone (nothing from the backward "
        f"pass or the data), together at least {MIN_SHARE:.0%} of the program's total"
    )


_ZERO = {"0", "-0", "0.0", "-0.0", "false"}


def _zeros(program: Program, inst: Instruction) -> bool:
    """True when `inst` is a broadcast of the constant zero (``jnp.zeros``, materialised)."""
    found = program.module.through(inst)
    if found.opcode != "broadcast" or not found.operands:
        return False
    scalar = program.operand(found, 0)
    return (
        scalar is not None
        and scalar.opcode == "constant"
        and bool(scalar.operands)
        and scalar.operands[0] in _ZERO
    )


def detect(program: Program) -> list[Finding]:
    if not program.has_backward:
        return []  # zeros and untouched state mean frozen parameters only beside a gradient
    shapes = {(p.shape.dtype, p.shape.dims) for p in program.parameters}
    zero: list[Buffer] = []
    for _, inst in program.outputs():
        key = (inst.shape.dtype, inst.shape.dims)
        if inst.shape.is_array and key in shapes and _zeros(program, inst):
            zero.append(program.buffer(inst))
    # State updated without any gradient: its new value depends on nothing but the state.
    pairs = state_pairs(program)
    state = {p.parameter.number for p in pairs}
    untouched = [
        p
        for p in pairs
        if p.output.shape.nbytes > 8  # a step count is state too, but not a frozen weight
        and not _zeros(program, p.output)
        and program.entry_parameters_of(p.output.name) <= state | _scalars(program)
        and not program.backward_ancestry(p.output.name)
    ]
    zero_bytes = sum(b.size for b in zero)
    state_bytes = sum(p.output.shape.nbytes for p in untouched)
    if zero_bytes + state_bytes < MIN_SHARE * program.total:
        return []
    parts = []
    if zero:
        parts.append(
            f"{len(zero)} output(s) are full-size zeros shaped like inputs, {fmt_bytes(zero_bytes)}"
        )
    if untouched:
        names = ", ".join(p.parameter.path for p in untouched[:3])
        parts.append(
            f"{len(untouched)} state output(s) ({names}{', ...' if len(untouched) > 3 else ''}) "
            f"are updated from the old state alone, with no gradient: {fmt_bytes(state_bytes)}"
        )
    return [
        finding(
            PATTERN,
            CASE,
            zero_bytes + state_bytes,
            zero + [program.buffer(p.output) for p in untouched],
            "Differentiate only the trainable parameters (pass them as their own argument to "
            "jax.grad, the frozen ones closed over or as another argument) and give the "
            "optimizer only those",
            copy="runbook.cases.frozen_params.grad_trainable",
            detail="; ".join(parts) + ".",
        )
    ]


def _scalars(program: Program) -> set[int]:
    """Inputs of a single element (a step count, a learning rate): state-like, not data."""
    return {p.number for p in program.parameters if p.shape.nbytes <= 8}
