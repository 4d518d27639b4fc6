"""`sharding-replicated`: a training step's state whole on every device, every layer's
gathered weights alive at once, or values the partitioner computes whole on every device.

Three signs in a multi-device program, the first two where it has a backward pass:

- inputs the step updates into outputs of their own shape (parameters, optimizer moments)
  whose sharding is the whole array on every device: each device holds all of the state,
  where splitting it over the devices would divide it by their number;
- all-gathers outside any loop whose results, gathered from split inputs, are alive
  together: the compiler gathered the weights of many layers before using them, so the
  split state is whole again in the temporaries. Layers run one at a time (a scan over
  stacked layers, with checkpointing) gather one layer at a time, inside the loop;
- temporaries that hold on each device as many elements as the JAX op that made them has in
  the whole program (read from the module before partitioning): where nothing says how to
  split a value, such as the activations and logits of a step whose weights are split on
  their model dimension, the partitioner may compute it for the whole global batch on
  every device.
"""

from __future__ import annotations

import math

import jax

from .._hlo import Instruction, Shape, Value
from .._program import Finding, Parameter, Program, finding
from .._render import fmt_bytes
from ._common import state_pairs

MIN_SHARE = 0.25  # of the program's total, for either sign
MAX_EVIDENCE = 6
STATE = "training state replicated on every device"
GATHERED = "every layer's gathered weights alive at once"
WHOLE = "values computed whole on every device"
MIN_VALUE = 0.005  # of the total: smaller temporaries are not worth naming one by one
PATTERN = f"{STATE}, {GATHERED}, or {WHOLE}"
CASE = "sharding-replicated"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "in a multi-device program with a backward pass: inputs it updates into outputs of "
        f"their shape, whole on every device, together at least {MIN_SHARE:.0%} of its total; "
        "or all-gathers outside any loop, of at least two inputs, whose results are alive "
        f"together at a point of the schedule, at least {MIN_SHARE:.0%} of its total; or, in "
        "a program split over devices (SPMD), temporaries that hold on each device all the "
        "elements their JAX op makes in the whole program, alive together, at least "
        f"{MIN_SHARE:.0%} of its total (with or without a backward pass; attention scores and "
        "logits among them count here, not under their own cases)"
    )


def replicated_state(program: Program) -> list[Parameter]:
    """The inputs a training step updates (new state from old) that every device holds whole.

    Empty unless the program runs on several devices and holds a reverse-mode pass.
    """
    if program.devices < 2 or not program.has_backward:
        return []
    return [p.parameter for p in state_pairs(program) if p.parameter.replicated]


def _gathers(program: Program) -> list[Instruction]:
    return [
        inst
        for inst in program.module.instructions.values()
        if inst.opcode.startswith("all-gather") and not program.in_loop(inst)
    ]


def _state_finding(program: Program) -> list[Finding]:
    chosen = replicated_state(program)
    nbytes = sum(p.shape.nbytes for p in chosen)
    if not chosen or nbytes < MIN_SHARE * program.total:
        return []
    names = ", ".join(p.path for p in chosen[:3]) + (", ..." if len(chosen) > 3 else "")
    return [
        finding(
            STATE,
            CASE,
            nbytes,
            [program.buffer(p.instruction) for p in chosen][:MAX_EVIDENCE],
            "Split the parameters and the optimizer state over the devices (a NamedSharding "
            "that divides one axis of each array, e.g. P('fsdp', None)), so that each device "
            "holds its share, and run the layers one at a time (lax.scan with jax.checkpoint)",
            copy="runbook.cases.sharding_replicated.fsdp",
            detail=f"{len(chosen)} input(s) the step updates ({names}) are whole on each of "
            f"{program.devices} devices: {fmt_bytes(nbytes)} per device, of a total of "
            f"{fmt_bytes(program.total)}.",
        )
    ]


def _gathered_finding(program: Program) -> list[Finding]:
    gathers = _gathers(program)
    sources = {
        n for inst in gathers for n in program.entry_parameters_of(inst.name)
    }  # the inputs they gather
    if len(sources) < 2:
        return []
    values = [v for inst in gathers for v in program.values_of(inst.name)]
    nbytes = program.peak(values)
    largest = max((v.size for v in values), default=0)
    if nbytes < MIN_SHARE * program.total or nbytes < 2 * largest:
        return []
    evidence = [program.buffer(inst) for inst in gathers]
    return [
        finding(
            GATHERED,
            CASE,
            nbytes,
            sorted(evidence, key=lambda b: -b.size)[:MAX_EVIDENCE],
            "Stack the layers into one array and run them with lax.scan, the body under "
            "jax.checkpoint, so that each layer's weights are gathered inside the loop, one "
            "layer at a time",
            copy="runbook.cases.sharding_replicated.scanned_train_step",
            detail=f"{len(gathers)} all-gathers outside any loop, of {len(sources)} inputs: "
            f"{fmt_bytes(nbytes)} of gathered values alive at once (the largest one "
            f"{fmt_bytes(largest)}), of a total of {fmt_bytes(program.total)}.",
        )
    ]


def whole_values(program: Program) -> list[Value]:
    """The temporaries of an SPMD program that each device computes whole (see
    `Program.whole_on_each_device`), leaving out what has a sign or a reason of its own:
    values shaped like an input or one layer of a stacked input (weights gathered, their
    gradients, each device's partial sums of a gradient). Attention scores and logits
    computed whole count here, not in their own detectors: splitting the batch is what
    divides them first."""
    if program.partitions < 2:
        return []
    weights = _input_elements(program)
    found = []
    for v in program.values:
        if (
            v.kind == "temp"
            and v.size >= MIN_VALUE * program.total
            and math.prod(Shape(v.shape).dims) not in weights
            and program.whole_on_each_device(v)
        ):
            found.append(v)
    return found


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


def _whole_finding(program: Program) -> list[Finding]:
    values = program.shared(whole_values)
    nbytes = program.peak(values)
    if nbytes < MIN_SHARE * program.total:
        return []
    insts = {v.instruction: program.module.instructions[v.instruction] for v in values}
    evidence = [program.buffer(inst) for inst in insts.values()]
    return [
        finding(
            WHOLE,
            CASE,
            nbytes,
            sorted(evidence, key=lambda b: -b.size)[:MAX_EVIDENCE],
            "Say how to split the activations: jax.lax.with_sharding_constraint(x, "
            "NamedSharding(mesh, P('data'))) on the batch axis after the embedding, after each "
            "block and on the logits, so that each device computes its share of the batch",
            detail=f"{len(values)} temporaries hold on each of {program.partitions} devices as "
            f"many elements as their JAX op makes in the whole program: {fmt_bytes(nbytes)} of "
            f"them alive at once, of a total of {fmt_bytes(program.total)}.",
        )
    ]


def detect(program: Program) -> list[Finding]:
    if program.devices < 2:
        return []
    steps = _state_finding(program) + _gathered_finding(program) if program.has_backward else []
    return steps + _whole_finding(program)  # values computed whole: with or without a gradient
