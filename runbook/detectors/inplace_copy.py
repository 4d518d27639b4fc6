"""`inplace-copy`: a whole buffer copied so that an in-place update can write the copy.

A dynamic-update-slice or a scatter writes into its first operand's memory when nothing else
needs the old values. When something still reads the old buffer (after the update, or with
nothing to order the read first), XLA copies the whole buffer and updates the copy. Seen in
the compiled program as a `copy` of a large buffer that an update then writes into, while the
copied buffer itself is read elsewhere.
"""

from __future__ import annotations

from .._hlo import Instruction
from .._program import Finding, Program, finding
from .._render import fmt_bytes

MIN_SHARE = 0.10  # of the program's total: smaller copies are not reported
PATTERN = "whole buffer copied for an in-place update"
CASE = "inplace-copy"
_UPDATES = ("dynamic-update-slice", "scatter")
_VIEWS = ("copy", "bitcast")  # what carries a buffer from the copy to the update unchanged
_CARRY = (*_VIEWS, "convert", "reshape")


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"a copy of a buffer, at least {MIN_SHARE:.0%} of the program's total, that a "
        "dynamic-update-slice or scatter then writes into, while the copied buffer is read by "
        "another instruction (an undonated input's copy is left to the donation detector)"
    )


def _through(program: Program, inst: Instruction | None) -> Instruction | None:
    """Look through ops that carry every element unchanged in place (a dtype's round trip
    included: XLA:CPU updates bf16 buffers as convert(update(convert(buffer))))."""
    while inst is not None and inst.opcode in _CARRY and inst.operands:
        inst = program.module.get(inst.operands[0])
    return inst


def _written_operand(program: Program, inst: Instruction, depth: int = 0) -> int | None:
    """Which operand `inst` updates: 0 for an update; for a fusion or an async start whose
    computation's root updates one of its parameters, that parameter's number."""
    if inst.opcode in _UPDATES:
        return 0
    if not inst.calls or depth > 4:
        return None
    root = _through(program, program.module.root(inst.calls[0]))
    k = _written_operand(program, root, depth + 1) if root is not None else None
    if root is None or k is None or k >= len(root.operands):
        return None
    written = _through(program, program.module.get(root.operands[k]))
    return written.parameter_number if written is not None else None


def _writes_into(user: Instruction, k: int | None, name: str) -> bool:
    return k is not None and k < len(user.operands) and user.operands[k] == name


def _views(program: Program, inst: Instruction) -> list[Instruction]:
    """`inst` and every copy or bitcast made of it, transitively: the same values."""
    found, todo, seen = [], [inst], set()
    while todo:
        current = todo.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        found.append(current)
        todo.extend(u for u in program.module.users.get(current.name, []) if u.opcode in _VIEWS)
    return found


def _copied_for_update(program: Program, copy: Instruction, source: Instruction) -> bool:
    """True when an in-place update writes into the copy or its source, and the old values
    are read by something else: the copy exists so that both can be had at once."""
    values = _views(program, source)
    names = {v.name for v in values}
    updated = readers = False
    for value in values:
        for user in program.module.users.get(value.name, []):
            if _writes_into(user, _written_operand(program, user), value.name):
                updated = True
            elif user.name not in names:
                readers = True
    return updated and readers


def _origin(program: Program, inst: Instruction) -> Instruction:
    while inst.opcode in _VIEWS and inst.operands:
        source = program.module.get(inst.operands[0])
        if source is None:
            break
        inst = source
    return inst


def _undonated_input(program: Program, inst: Instruction) -> bool:
    origin = _origin(program, inst)
    return (
        origin.opcode == "parameter"
        and origin.computation == program.module.entry
        and origin.parameter_number not in program.module.aliases.values()
    )


def detect(program: Program) -> list[Finding]:
    module = program.module
    chosen = []
    for inst in module.instructions.values():
        if inst.opcode != "copy" or not inst.operands:
            continue
        if inst.shape.nbytes < MIN_SHARE * program.total:
            continue
        source = module.get(inst.operands[0])
        if source is None or _undonated_input(program, source):
            continue
        if _copied_for_update(program, inst, source):
            chosen.append(inst)
    # A copy can take over the donated input's memory; the cost is the copies held as
    # temporaries (every copy when the buffer assignment is not known).
    temps = [v for i in chosen for v in program.values_of(i.name) if v.kind == "temp"]
    nbytes = program.peak(temps) if temps else sum(i.shape.nbytes for i in chosen)
    if not chosen or nbytes < MIN_SHARE * program.total:
        return []
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            [program.buffer(i) for i in chosen],
            "Make the update depend on what it replaces (read the old rows, then write "
            "buf.at[i].add(rows - old)), or order every read of the old buffer before the "
            "update with jax.lax.optimization_barrier; never read the old buffer after it",
            copy="runbook.cases.inplace_copy.update_from_read",
            detail=f"{len(chosen)} whole-buffer copies ({fmt_bytes(nbytes)}) written into by "
            "an in-place update while the original is still read.",
        )
    ]
