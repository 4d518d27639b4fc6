"""`scan-residuals`: a scan's forward pass stacks per-step residuals for its backward pass.

Reverse mode through ``lax.scan`` keeps what each step's backward needs, for every step:
the forward loop writes them into ``(steps, ...)`` arrays that the backward loop reads.
Intermediates of the step a checkpointed body (``jax.checkpoint``) would recompute; the
step's inputs (the carry) are stored even then, which only nested checkpointing reduces.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from .._buffers import Buffer
from .._hlo import Instruction
from .._program import Finding, Program, finding
from .._render import fmt_bytes

MIN_SHARE = 0.10  # of the total: stacked intermediates a checkpointed body would not store
MIN_CARRY_SHARE = 0.25  # of the total: stacked carries, which only nesting reduces...
MIN_NEST_GAIN = 8  # ...reported where nesting stores this many times fewer (2 sqrt(T) of T)
PATTERN = "scan residuals stacked for the backward pass"
CASE = "scan-residuals"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "a while loop writes (steps, ...) arrays step by step (dynamic-update-slice) that a later "
        f"while loop reads; reported when the step's intermediates stored are at least "
        f"{MIN_SHARE:.0%} of the total, or its inputs (carries) alone at least "
        f"{MIN_CARRY_SHARE:.0%} over {(2 * MIN_NEST_GAIN) ** 2} steps or more, where nesting "
        f"would store {MIN_NEST_GAIN}x fewer"
    )


def _body(loop: Instruction) -> str | None:
    m = re.search(r"\bbody=%?([\w.\-]+)", loop.attributes)
    return m[1] if m else None


def _consumed_by_loop(program: Program, loop: Instruction, index: int) -> bool:
    """True when element `index` of `loop`'s result flows into another while loop."""
    todo = [
        u
        for u in program.module.users.get(loop.name, [])
        if u.opcode == "get-tuple-element" and u.tuple_index == index
    ]
    seen: set[str] = set()
    while todo:
        inst = todo.pop()
        if inst.name in seen:
            continue
        seen.add(inst.name)
        for user in program.module.users.get(inst.name, []):
            if user.opcode == "while" and user.name != loop.name:
                return True
            if user.opcode in ("tuple", "copy", "bitcast"):
                todo.append(user)
    return False


def _stacked(
    program: Program, loop: Instruction, steps: int
) -> Iterator[tuple[int, Instruction, Instruction]]:
    """(index, the per-step write, the value written) for each array the loop stacks."""
    body = _body(loop)
    root = program.module.root(body) if body else None
    if root is None or root.opcode != "tuple":
        return
    for index, name in enumerate(root.operands):
        write = program.module.get(name)
        if write is None or not write.shape.dims or write.shape.dims[0] != steps:
            continue
        dus = program.module.through(write)
        if dus.opcode != "dynamic-update-slice":
            continue
        target = program.operand(dus, 0)
        if target is None or target.opcode != "get-tuple-element" or target.tuple_index != index:
            continue
        update = program.operand(dus, 1)
        while update is not None and update.opcode in ("bitcast", "copy", "reshape"):
            update = program.operand(update, 0)
        if update is not None:
            yield index, write, update


def _carry(update: Instruction, body: str | None) -> bool:
    """True when the stored value is one of the step's inputs (a loop element, unchanged)."""
    return update.opcode == "get-tuple-element" and update.computation == body


def detect(program: Program) -> list[Finding]:
    out = []
    for loop in program.module.instructions.values():
        steps = loop.trip_count
        if loop.opcode != "while" or not steps or steps < 2:
            continue
        residuals = [
            (index, write, update)
            for index, write, update in _stacked(program, loop, steps)
            if _consumed_by_loop(program, loop, index)
        ]
        if not residuals:
            continue
        body = _body(loop)
        evidence, carried, computed = [], 0, 0
        for _, write, update in residuals:
            op, source = program.describe(update)
            if not source:
                op, source = program.describe(write)
            is_carry = _carry(update, body)
            kind = "carry" if is_carry else "intermediate"
            evidence.append(
                Buffer(
                    write.shape.nbytes,
                    str(write.shape),
                    f"stacked {kind}",
                    f"{write.name} ({write.opcode})",
                    op,
                    source,
                )
            )
            if is_carry:
                carried += write.shape.nbytes
            else:
                computed += write.shape.nbytes
        total = program.total
        if computed >= MIN_SHARE * total:
            sentence = (
                "Checkpoint the loop's body (lax.scan(jax.checkpoint(body), ...), or the same "
                "in lax.fori_loop) so that each step stores only its inputs, or nest checkpointed "
                "scans over segments of about sqrt(steps) steps to store fewer still"
            )
        elif carried >= MIN_CARRY_SHARE * total and steps >= (2 * MIN_NEST_GAIN) ** 2:
            sentence = (
                "Nest checkpointed scans: a scan over about sqrt(steps) segments, each a "
                "checkpointed scan over its steps, stores about 2 sqrt(steps) carries "
                "instead of one per step"
            )
        else:
            continue
        op = program.describe(loop)[0]
        out.append(
            finding(
                PATTERN,
                CASE,
                carried + computed,
                evidence,
                sentence,
                copy="runbook.cases.scan_residuals.loss_nested",
                detail=f"a {steps}-step loop ({op or loop.name}) stores "
                f"{len(residuals)} per-step array(s) that a later loop (its backward pass) "
                f"reads: {fmt_bytes(computed)} of step intermediates, {fmt_bytes(carried)} "
                "of step inputs (carries).",
            )
        )
    return out
