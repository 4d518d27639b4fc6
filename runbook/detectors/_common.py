"""Questions several detectors ask of a `Program`."""

from __future__ import annotations

import dataclasses

from .._hlo import Instruction
from .._program import Parameter, Program

_PASS = ("bitcast", "copy", "reshape", "convert")


def source_of(program: Program, inst: Instruction) -> Instruction:
    """What `inst` is made from when it only moves or reinterprets data (bitcast, copy)."""
    seen = set()
    while inst.opcode in _PASS and inst.operands and inst.name not in seen:
        seen.add(inst.name)
        nxt = program.operand(inst, 0)
        if nxt is None:
            break
        inst = nxt
    return inst


def entry_parameter(program: Program, inst: Instruction) -> Parameter | None:
    """The program input `inst` is (through bitcasts and copies), or None."""
    inst = source_of(program, program.outside(inst))
    if inst.opcode != "parameter" or inst.computation != program.module.entry:
        return None
    return next((p for p in program.parameters if p.number == inst.parameter_number), None)


@dataclasses.dataclass(frozen=True)
class StatePair:
    """An output computed elementwise from an input of its own shape: new state from old."""

    index: tuple[int, ...]
    output: Instruction
    parameter: Parameter
    aliased: bool


def state_pairs(program: Program) -> list[StatePair]:
    """Outputs that update an input of the same shape and dtype (``p - lr * g``, ``b * m``).

    An output is paired with an input of its shape that the instruction computing it reads
    directly (a fusion's operands count): a new value computed from the old one. Outputs
    that are the input itself, passed through, are not updates. Each input pairs once.
    """
    taken: set[int] = set()
    pairs = []
    for index, inst in program.outputs():
        if not inst.shape.is_array or entry_parameter(program, inst) is not None:
            continue  # a tuple, or an input passed through unchanged
        producer = source_of(program, inst)
        for k in range(len(producer.operands)):
            operand = program.operand(producer, k)
            param = entry_parameter(program, operand) if operand is not None else None
            if (
                param is not None
                and param.number not in taken
                and param.shape.dims == inst.shape.dims
                and param.shape.dtype == inst.shape.dtype
            ):
                taken.add(param.number)
                pairs.append(StatePair(index, inst, param, program.aliased_output(index)))
                break
    return pairs
