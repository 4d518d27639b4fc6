"""`grad-accumulation`: a training step that holds its whole batch's activations at once.

A training step (a program with a backward pass that returns new state computed from its
old state) reads, in its backward pass, what the forward pass computed from the batch. Those
activations grow with the batch; split into `k` micro-batches whose gradients are summed
before one update, a step holds one micro-batch's. Read from the dataflow: the temporaries
outside loops that the backward pass reads and that are computed from an input that is not
state (an array of two dimensions or more: the batch, not a PRNG key; its leading axis, the
examples, longer than one: a batch of one example cannot be split). Attention scores,
logits, vmapped temporaries and values computed whole on every device are their own
detectors': each value is named by one finding.

A step that also updates statistics of the batch (batch norm's running mean and variance:
state computed from the batch with no backward pass in its history) is not named: each
micro-batch would normalise over its own rows, so accumulating computes another result.
"""

from __future__ import annotations

from .._hlo import Instruction, Value
from .._program import Finding, NearMiss, Program, finding
from .._render import fmt_bytes
from . import attention_scores, resharding, vmap_materialize, vocab_logits
from ._common import StatePair, kept_for_backward, state_pairs

MIN_SHARE = 0.40  # of the program's total, held at once by the batch's activations
MAX_EVIDENCE = 6
PATTERN = "the whole batch's activations held for the backward pass"
CASE = "grad-accumulation"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "in a training step (a backward pass, and outputs that update inputs of their shape), "
        "temporaries outside any loop that the backward pass reads and that are computed from "
        "an input that is not state, of two dimensions or more and more than one example (the "
        "batch), at least "
        f"{MIN_SHARE:.0%} of the program's total live at once; attention scores, logits, "
        "vmapped temporaries and values computed whole on every device are left to their "
        "cases; not named where the step also updates statistics of the batch (batch norm)"
    )


def _batch(program: Program) -> tuple[set[int], set[int]]:
    """The step's state inputs, and its batch: the other inputs of two dimensions or more
    whose leading axis, the examples, could be split (a batch of one cannot)."""
    state = {p.parameter.number for p in state_pairs(program)}
    batch = {
        p.number
        for p in program.parameters
        if p.number not in state and len(p.shape.dims) >= 2 and p.shape.dims[0] >= 2
    }
    return state, batch


def batch_statistics(program: Program) -> list[StatePair]:
    """State updated from the batch by the forward pass alone (batch norm's running
    statistics), which micro-batches would each compute over their own rows."""
    _, batch = _batch(program)
    return [
        p
        for p in state_pairs(program)
        if batch & program.entry_parameters_of(p.output.name)
        and not program.backward_ancestry(p.output.name)
    ]


def claimed_elsewhere(program: Program) -> set[tuple[str, str]]:
    """The values other detectors name, each by one finding: attention scores, logits,
    values computed whole on every device and vmapped temporaries."""
    return (
        attention_scores.scores(program)
        | vocab_logits.logit_values(program)
        | resharding.whole(program)
        | {(v.instruction, v.index) for v, _ in program.shared(vmap_materialize.vmapped)[0]}
    )


def activations(program: Program) -> tuple[list[tuple[Value, Instruction]], int]:
    """The batch's activations that the backward pass reads, and the most live at once."""
    if not program.has_backward:
        return [], 0
    state, batch = _batch(program)
    if not state:
        return [], 0  # a gradient, not a step: nothing to accumulate into
    claimed = program.shared(claimed_elsewhere)
    chosen = []
    for v in program.values:
        inst = program.module.get(v.instruction)
        if v.kind != "temp" or inst is None or (v.instruction, v.index) in claimed:
            continue
        if inst.name not in program.shared(kept_for_backward):
            continue  # in a loop: one micro-batch's, or a scan's (scan-residuals')
        if batch & program.entry_parameters_of(inst.name):
            chosen.append((v, inst))
    return chosen, program.peak(v for v, _ in chosen)


def near_miss(program: Program) -> NearMiss | None:
    """The batch's activations below the share this detector names."""
    chosen, nbytes = program.shared(activations)
    if not chosen:
        return None
    stats = program.shared(batch_statistics)
    if stats and nbytes >= MIN_SHARE * program.total:
        return NearMiss(
            CASE,
            PATTERN,
            nbytes,
            f"{len(chosen)} activations of the batch that the backward pass reads hold "
            f"{fmt_bytes(nbytes)} at once, {nbytes / (program.total or 1):.0%} of the total, "
            f"but the step also updates statistics of the batch ({len(stats)} arrays, as batch "
            "norm's running mean and variance): micro-batches would each normalise over their "
            "own rows, another result",
        )
    if nbytes >= MIN_SHARE * program.total:
        return None
    return NearMiss(
        CASE,
        PATTERN,
        nbytes,
        f"{len(chosen)} activations of the batch that the backward pass reads hold "
        f"{fmt_bytes(nbytes)} at once, {nbytes / (program.total or 1):.0%} of the total "
        f"(named from {MIN_SHARE:.0%})",
    )


def names(program: Program) -> bool:
    """Whether this detector names the batch's activations: enough of them, and no
    statistics of the batch that micro-batches would compute otherwise."""
    chosen, nbytes = program.shared(activations)
    return (
        bool(chosen)
        and nbytes >= MIN_SHARE * program.total
        and not program.shared(batch_statistics)
    )


def detect(program: Program) -> list[Finding]:
    if not program.shared(names):
        return []
    chosen, nbytes = program.shared(activations)
    evidence = [program.buffer(inst, v) for v, inst in chosen]
    lines = sorted({program.describe(inst)[1] for _, inst in chosen} - {""})
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            sorted(evidence, key=lambda b: -b.size)[:MAX_EVIDENCE],
            "Split the batch into k micro-batches and sum their gradients before one update "
            "(optax.MultiSteps, one micro-batch per call; or lax.scan over them inside the "
            "step): a step holds about 1/k of these, plus an accumulator the size of the "
            "parameters",
            copy="runbook.cases.grad_accumulation.multisteps",
            detail=f"{len(chosen)} activations computed from the batch and read by the "
            f"backward pass, {fmt_bytes(nbytes)} live at once, "
            f"{nbytes / (program.total or 1):.0%} of the total, made at "
            f"{', '.join(lines[:3]) or 'lines XLA did not record'}.",
        )
    ]
