"""`sharding-replicated`: a training step's state whole on every device, or every layer's
gathered weights alive at once.

Two signs in a multi-device program with a backward pass (values the partitioner computes
whole on every device are `resharding`'s):

- inputs the step updates into outputs of their own shape (parameters, optimizer moments)
  whose sharding is the whole array on every device: each device holds all of the state,
  where splitting it over the devices would divide it by their number;
- all-gathers outside any loop whose results, gathered from split inputs, are alive
  together: the compiler gathered the weights of many layers before using them, so the
  split state is whole again in the temporaries. Layers run one at a time (a scan over
  stacked layers, with checkpointing) gather one layer at a time, inside the loop.
"""

from __future__ import annotations

from .._hlo import Instruction
from .._program import Finding, Parameter, Program, finding
from .._render import fmt_bytes
from ._common import state_pairs

MIN_SHARE = 0.25  # of the program's total, for either sign
MAX_EVIDENCE = 6
STATE = "training state replicated on every device"
GATHERED = "every layer's gathered weights alive at once"
PATTERN = f"{STATE}, or {GATHERED}"
CASE = "sharding-replicated"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "in a multi-device program with a backward pass: inputs it updates into outputs of "
        f"their shape, whole on every device, together at least {MIN_SHARE:.0%} of its total; "
        "or all-gathers outside any loop, of at least two inputs, whose results are alive "
        f"together at a point of the schedule, at least {MIN_SHARE:.0%} of its total"
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


def detect(program: Program) -> list[Finding]:
    if program.devices < 2:
        return []
    if not program.has_backward:
        return []
    return _state_finding(program) + _gathered_finding(program)
