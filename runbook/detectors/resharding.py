"""`resharding`: values the partitioner computes whole on every device.

In a program split over devices (SPMD), temporaries that hold on each device as many
elements as the JAX op that made them has in the whole program (read from the module before
partitioning): where nothing says how to split a value, such as the activations and logits
of a step whose weights are split on their model dimension, the partitioner may compute it
for the whole global batch on every device. Attention scores and logits computed whole
count here, not under their own cases: splitting the batch is what divides them first.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from .._hlo import Shape, Value
from .._program import Finding, Program, finding
from .._render import fmt_bytes

MIN_SHARE = 0.25  # of the program's total
MIN_VALUE = 0.005  # of the total: smaller temporaries are not worth naming one by one
MAX_EVIDENCE = 6
PATTERN = "values computed whole on every device"
CASE = "resharding"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "in a program split over devices (SPMD), temporaries that hold on each device all the "
        "elements their JAX op makes in the whole program, alive together, at least "
        f"{MIN_SHARE:.0%} of its total (with or without a backward pass; attention scores and "
        "logits among them count here, not under their own cases); values shaped like an "
        "input, or like one layer of one, are left out"
    )


def whole_values(program: Program) -> list[Value]:
    """The temporaries of an SPMD program that each device computes whole (see
    `Program.whole_on_each_device`), leaving out what has a sign or a reason of its own:
    values shaped like an input or one layer of a stacked input (weights gathered, their
    gradients, each device's partial sums of a gradient)."""
    if program.partitions < 2:
        return []
    weights = _input_elements(program)
    found = []
    for v in program.values:
        if (
            v.kind == "temp"
            and v.size >= MIN_VALUE * program.total
            and math.prod(Shape(v.shape).dims) not in weights
            and _whole_on_each_device(program, v)
        ):
            found.append(v)
    return found


def _whole_on_each_device(program: Program, v: Value) -> bool:
    """`Program.whole_on_each_device`, and for an instruction the compiler made with no JAX
    op of its own (a TPU compile's async collective, which gathers the logits' gradient
    whole), the same question of each of its operands, at this value's shape: what it moved."""
    if program.whole_on_each_device(v):
        return True
    inst = program.module.get(v.instruction)
    if inst is None or program.describe(inst)[0]:
        return False
    return any(
        program.whole_on_each_device(dataclasses.replace(v, instruction=o)) for o in inst.operands
    )


def _input_elements(program: Program) -> set[int]:
    """The element counts of the program's inputs, whole, and of one layer of each."""
    found = set()
    for leaf in jax.tree_util.tree_leaves(program.args):
        dims = tuple(getattr(leaf, "shape", ()))
        if dims:
            found |= {math.prod(dims), math.prod(dims[1:])}
    return found


def whole(program: Program) -> set[tuple[str, str]]:
    """`whole_values`, as the set other detectors leave out (each value in one finding),
    with every value in the same memory (an H100 compile all-gathers the logits into the
    very bytes of the product that made them)."""
    return set(program.shared(_whole_keys))  # three detectors ask: read the values once


def _whole_keys(program: Program) -> frozenset[tuple[str, str]]:
    extents = {v.extent for v in program.shared(whole_values)}
    return frozenset((v.instruction, v.index) for v in program.values if v.extent in extents)


def detect(program: Program) -> list[Finding]:
    if program.devices < 2:
        return []
    values = program.shared(whole_values)
    nbytes = program.peak(values)
    if nbytes < MIN_SHARE * program.total:
        return []
    insts = {v.instruction: program.module.instructions[v.instruction] for v in values}
    evidence = [program.buffer(inst) for inst in insts.values()]
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            sorted(evidence, key=lambda b: -b.size)[:MAX_EVIDENCE],
            "Say how to split the activations: jax.lax.with_sharding_constraint(x, "
            "NamedSharding(mesh, P('data'))) on the batch axis after the embedding, after each "
            "block and on the logits, so that each device computes its share of the batch",
            copy="runbook.cases.resharding.activations_on",
            detail=f"{len(values)} temporaries hold on each of {program.partitions} devices as "
            f"many elements as their JAX op makes in the whole program: {fmt_bytes(nbytes)} of "
            f"them alive at once, of a total of {fmt_bytes(program.total)}.",
        )
    ]
