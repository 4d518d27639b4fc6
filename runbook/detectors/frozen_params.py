"""`frozen-params`: parameters that get no gradient still cost gradient-sized memory.

Differentiating a whole parameter tree when part of it is frozen (under
``lax.stop_gradient``, or unused) gives full-size zero gradients: real arrays the size of
the frozen weights. In a training step the optimizer then keeps and updates state for
them with no gradient at all. Differentiating only the trainable subtree avoids both.

Freezing by a zero learning rate instead (``optax.sgd(0.0)`` for the frozen labels, or an
update multiplied by zero) is worse: the frozen part's whole gradient is computed, its
backward pass and all, and then multiplied by zero. XLA cannot drop a product with zero
(``0 * inf`` is not zero), so the compiled program keeps it: the detector finds products
with a constant zero whose other factor comes from the reverse-mode pass, and everything
the program computes only to feed them. Freezing by a mask that keeps the optimizer's
state (``optax.chain(optax.adam(...), optax.masked(optax.set_to_zero(), frozen))``)
computes the gradient for that state: parameters returned unchanged beside
gradient-fed state of their shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .._buffers import Buffer
from .._hlo import Instruction, Value
from .._program import Finding, NearMiss, Parameter, Program, finding
from .._render import fmt_bytes
from ._common import entry_parameter, state_pairs

MIN_SHARE = 0.05  # of the program's total
PATTERN = "frozen parameters differentiated"
CASE = "frozen-params"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "in a program with a reverse-mode pass: outputs that are broadcast zeros shaped like an "
        "input, state outputs updated from the old state alone (nothing from the backward "
        "pass or the data), what the program computes only to multiply by a constant zero "
        "(a gradient times a zero learning rate or mask; the most it holds at once), and "
        "gradient-fed state shaped like parameters returned unchanged, together at least "
        f"{MIN_SHARE:.0%} of the program's total"
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


_THROUGH = ("broadcast", "bitcast", "copy", "reshape", "convert", "transpose")


def _is_zero(program: Program, inst: Instruction | None) -> bool:
    """True when `inst` is the constant zero, or a broadcast/reshape/convert of it (inside a
    fusion or passed into one)."""
    seen: set[str] = set()
    while inst is not None and inst.name not in seen:
        seen.add(inst.name)
        if inst.opcode == "parameter":
            outer = program.outside(inst)
            if outer is inst:
                return False
            inst = outer
        elif inst.opcode in _THROUGH and inst.operands:
            inst = program.module.get(inst.operands[0])
        elif inst.opcode == "fusion":
            inst = program.module.through(inst) if inst.calls else None
            if inst is not None and inst.opcode == "fusion":
                return False
        else:
            return inst.opcode == "constant" and bool(inst.operands) and inst.operands[0] in _ZERO
    return False


def _needed_in(program: Program, computation: str) -> tuple[set[str], list[Instruction]]:
    """What `computation`'s root needs, not counting a factor multiplied by a constant zero,
    and the products with zero whose other factor it therefore does not need."""
    root = program.module.root(computation)
    return _needed_from(program, [root] if root is not None else [])


def _needed_from(
    program: Program,
    start: list[Instruction],
    stop: Callable[[Instruction], bool] | None = None,
) -> tuple[set[str], list[Instruction]]:
    """What `start` needs (themselves included), products with zero aside. One result of a
    multi-output fusion needs only what its part of the fusion reads. With `stop`, the walk
    ends at the first instruction past `start` that `stop` accepts (it is in the set)."""
    starts = {i.name for i in start}
    needed: set[str] = set()
    done: set[tuple[str, int | None]] = set()
    zeroing: list[Instruction] = []
    todo: list[tuple[Instruction, int | None]] = [(i, None) for i in start]
    while todo:
        inst, element = todo.pop()
        if (inst.name, element) in done or (inst.name, None) in done:
            continue
        done.add((inst.name, element))
        needed.add(inst.name)
        if stop is not None and inst.name not in starts and stop(inst):
            break
        operands = [program.module.get(o) for o in inst.operands]
        if inst.opcode == "multiply" and len(operands) == 2:
            zero = [k for k, o in enumerate(operands) if _is_zero(program, o)]
            if zero:
                zeroing.append(inst)
                operands = [operands[zero[0]]]
        if inst.opcode == "fusion" and inst.calls and inst.computation == program.module.entry:
            used = _fusion_inputs(program, inst.calls[0], element)
            operands = [o for k, o in enumerate(operands) if k in used]
        if inst.opcode == "get-tuple-element" and operands and operands[0] is not None:
            todo.append((operands[0], inst.tuple_index))
            continue
        todo += [(o, None) for o in operands if o is not None]
    return needed, zeroing


def _fusion_table(program: Program) -> dict[tuple[str, int | None], set[int]]:
    return {}


def _fusion_inputs(program: Program, computation: str, element: int | None = None) -> set[int]:
    """The parameters of a fused computation its root (or element `element` of a tuple
    root) needs, products with zero aside (once per program: every walk asks again)."""
    table = program.shared(_fusion_table)
    if (computation, element) not in table:
        table[computation, element] = _read_fusion_inputs(program, computation, element)
    return table[computation, element]


def _read_fusion_inputs(program: Program, computation: str, element: int | None) -> set[int]:
    root = program.module.root(computation)
    if root is not None and element is not None and root.opcode == "tuple":
        part = program.module.get(root.operands[element]) if element < len(root.operands) else None
        root = part or root
    needed, _ = _needed_from(program, [root] if root is not None else [])
    return {
        i.parameter_number
        for i in program.module.computations.get(computation, ())
        if i.opcode == "parameter" and i.name in needed and i.parameter_number is not None
    }


@dataclasses.dataclass(frozen=True)
class _Zeroed:
    """What the entry computation computes only to multiply it by zero."""

    instructions: list[Instruction]
    held: int  # the most of their bytes live at once


def _backward(program: Program, inst: Instruction) -> bool:
    """True when `inst` belongs to the reverse-mode pass (JAX names it ``transpose(...)``)."""
    if "transpose(" in inst.op_name:
        return True
    return inst.opcode == "fusion" and any(
        "transpose(" in i.op_name for i in program.module.inner_ops(inst)
    )


def _zeroed(program: Program, useless: set[str], kept: set[str]) -> _Zeroed:
    """What the entry computation computes for nothing: only to multiply it by zero, or
    only for the `useless` outputs (state of parameters returned unchanged), with the
    forward values kept alive for that alone (read by nothing else of the backward pass)."""
    entry = program.module.entry
    useful = [i for _, i in program.outputs() if i.name not in useless]
    needed, _ = _needed_from(program, useful)
    body = program.module.computations.get(entry, [])
    wasted = [
        i
        for i in body
        if i.name not in needed
        and i.opcode not in ("parameter", "constant", "get-tuple-element", "tuple")
        and i.shape.is_array
    ]
    if not any(program.backward_ancestry(i.name) for i in wasted):
        return _Zeroed([], 0)  # a product with zero, but not of a gradient
    names = {i.name for i in wasted}
    kept_alive = []
    for i in body:
        if i.name not in needed or i.opcode in ("parameter", "constant"):
            continue
        users = program.module.users.get(i.name, [])
        if any(u.name in names for u in users) and not any(
            _backward(program, u) for u in users if u.name not in names
        ):
            kept_alive.append(i)

    def temps(chosen: list[Instruction]) -> list[Value]:
        return [
            v
            for i in chosen
            for v in program.values_of(i.name)
            if v.kind in ("temp", "thread-local") or (v.kind == "output" and i.name in kept)
        ]

    if not program.values:  # no buffer assignment: the wasted values, all at once
        return _Zeroed(wasted, sum(i.shape.nbytes for i in wasted))
    # The forward values would exist anyway, two at a time (one layer's input and output):
    # what the waste costs is their being kept for it.
    alone = program.peak(temps(wasted))
    largest = max((i.shape.nbytes for i in kept_alive), default=0)
    held = max(alone, program.peak(temps(wasted + kept_alive)) - 2 * largest)
    return _Zeroed(sorted(wasted, key=lambda i: -i.shape.nbytes), held)


def _kept_state(program: Program) -> list[Instruction]:
    """Gradient-fed state outputs shaped like parameters the program returns unchanged (the
    optimizer's moments of a frozen part), in proportion to how many parameters of that
    shape are unchanged."""
    outputs = program.outputs()
    unchanged: dict[tuple[str, tuple[int, ...]], int] = {}
    for _, inst in outputs:
        param = _unchanged(program, inst)
        if param is not None and param.shape.nbytes > 8:
            key = (param.shape.dtype, param.shape.dims)
            unchanged[key] = unchanged.get(key, 0) + 1
    if not unchanged:
        return []
    fed: dict[tuple[str, tuple[int, ...]], list[Instruction]] = {}
    for pair in state_pairs(program):
        key = (pair.output.shape.dtype, pair.output.shape.dims)
        if (
            key in unchanged
            and program.backward_ancestry(pair.output.name)
            and _unchanged(program, pair.output) is None  # a frozen parameter itself
        ):
            fed.setdefault(key, []).append(pair.output)
    found = []
    for key, outs in fed.items():
        same = sum(
            1 for p in program.parameters if (p.shape.dtype, p.shape.dims) == key
        )  # every input of that shape: parameters and state alike
        params = max(same - len(outs), unchanged[key])
        share = min(1.0, unchanged[key] / params) if params else 1.0
        found += outs[: round(share * len(outs))]
    return found


def _unchanged_found(program: Program) -> dict[str, Parameter | None]:
    """`_unchanged`'s answers so far, by instruction (it is asked of each output, and of
    each state update, by more than one test)."""
    return {}


def _unchanged(program: Program, inst: Instruction) -> Parameter | None:
    """The input `inst` returns unchanged: passed through, or plus something times zero
    (``p - 0.0 * update``, a zero learning rate)."""
    found = program.shared(_unchanged_found)
    if inst.name not in found:
        found[inst.name] = _decide_unchanged(program, inst)
    return found[inst.name]


def _decide_unchanged(program: Program, inst: Instruction) -> Parameter | None:
    param = entry_parameter(program, inst)
    if param is not None:
        return param
    # Anything computed on the way means it is not; most outputs show that a step away.
    needed, _ = _needed_from(program, [inst], stop=_computed)
    scalars = _scalars(program)
    found = [
        i
        for i in program.module.entry_instructions
        if i.name in needed and i.opcode == "parameter" and i.parameter_number not in scalars
    ]
    if len(found) != 1 or found[0].shape.dims != inst.shape.dims:
        return None
    computed = [
        i
        for i in program.module.entry_instructions
        if i.name in needed and i.name != inst.name and _computed(i)
    ]
    if computed:
        return None  # computed from more than that input: not the input plus zero
    if not program.entry_parameters_of(inst.name) - scalars - {found[0].parameter_number}:
        return None  # computed from that input alone: an update, not a product with zero
    return entry_parameter(program, found[0])


def _computed(inst: Instruction) -> bool:
    return inst.opcode not in ("parameter", "constant", "broadcast", *_THROUGH)


@dataclasses.dataclass(frozen=True)
class _Seen:
    zero: list[Buffer]
    untouched: list[Instruction]
    names: str
    zeroed: _Zeroed
    kept: list[Instruction]

    @property
    def bytes(self) -> int:
        # The kept state is among what `zeroed` holds (outputs computed for nothing).
        return (
            sum(b.size for b in self.zero)
            + sum(i.shape.nbytes for i in self.untouched)
            + self.zeroed.held
        )


def _see(program: Program) -> _Seen:
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
    names = ", ".join(p.parameter.path for p in untouched[:3])
    names += ", ..." if len(untouched) > 3 else ""
    outputs = {p.output.name for p in untouched}
    kept = [i for i in _kept_state(program) if i.name not in outputs]
    useless = {i.name for i in kept} | {
        i.name
        for _, i in program.outputs()
        if entry_parameter(program, i) is None and _unchanged(program, i) is not None
    }
    zeroed = _zeroed(program, useless, {i.name for i in kept})
    return _Seen(zero, [p.output for p in untouched], names, zeroed, kept)


def detect(program: Program) -> list[Finding]:
    if not program.has_backward:
        return []  # zeros and untouched state mean frozen parameters only beside a gradient
    seen = program.shared(_see)  # detect and near_miss read it once
    if seen.bytes < MIN_SHARE * program.total or not seen.bytes:
        return []
    parts = []
    if seen.zero:
        parts.append(
            f"{len(seen.zero)} output(s) are full-size zeros shaped like inputs, "
            f"{fmt_bytes(sum(b.size for b in seen.zero))}"
        )
    if seen.untouched:
        parts.append(
            f"{len(seen.untouched)} state output(s) ({seen.names}) are updated from the old "
            "state alone, with no gradient: "
            f"{fmt_bytes(sum(i.shape.nbytes for i in seen.untouched))}"
        )
    if seen.zeroed.instructions:
        kept = (
            f", among them {len(seen.kept)} state output(s) fed a gradient for parameters "
            "the program returns unchanged"
            if seen.kept
            else ""
        )
        parts.append(
            f"{len(seen.zeroed.instructions)} instruction(s) compute a gradient only to "
            "multiply it by zero (a zero learning rate or mask) or to keep optimizer state "
            f"for parameters that do not change{kept}, holding "
            f"{fmt_bytes(seen.zeroed.held)} at once with the forward values kept for them"
        )
    evidence = (
        seen.zero
        + [program.buffer(i) for i in seen.untouched + seen.kept]
        + [program.buffer(i) for i in seen.zeroed.instructions[:8]]
    )
    return [
        finding(
            PATTERN,
            CASE,
            seen.bytes,
            evidence,
            "Differentiate only the trainable parameters (pass them as their own argument to "
            "jax.grad, the frozen ones closed over or as another argument) and give the "
            "optimizer only those; a zero learning rate or a mask still computes the frozen "
            "part's gradient",
            copy="runbook.cases.frozen_params.grad_trainable",
            detail="; ".join(parts) + ".",
        )
    ]


def near_miss(program: Program) -> NearMiss | None:
    """Frozen-parameter evidence below the threshold, or outside a gradient program."""
    if not program.has_backward:
        return None  # without a gradient, nothing here is about frozen parameters
    seen = program.shared(_see)  # detect and near_miss read it once
    if not seen.bytes or seen.bytes >= MIN_SHARE * program.total:
        return None
    reason = (
        f"zero gradients, gradient-free state, zeroed gradients and state kept for unchanged "
        f"parameters account for {fmt_bytes(seen.bytes)}, "
        f"{seen.bytes / (program.total or 1):.0%} of the total (named from {MIN_SHARE:.0%})"
    )
    return NearMiss(CASE, PATTERN, seen.bytes, reason)


def _scalars(program: Program) -> set[int]:
    """Inputs of a single element (a step count, a learning rate): state-like, not data."""
    return program.shared(_scalar_inputs)  # asked once per output: read the inputs once


def _scalar_inputs(program: Program) -> set[int]:
    return {p.number for p in program.parameters if p.shape.nbytes <= 8}
