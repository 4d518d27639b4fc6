"""Questions several detectors ask of a `Program`."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence

from .._hlo import Instruction, Value
from .._program import NearMiss, Parameter, Program
from .._render import fmt_bytes
from .._timeline import of_program

# copy-start/copy-done: the TPU compiler's asynchronous copies (prefetches between memory spaces).
_PASS = ("bitcast", "copy", "reshape", "convert", "copy-start", "copy-done")
PRODUCTS = ("dot", "convolution")


def reassembled(program: Program, inst: Instruction) -> Instruction | None:
    """The array `inst` is, when it is XLA's TPU compiler putting one back together: its
    asynchronous slices (``async-start``/``async-done`` of a ``slice``) bitcast into one
    array (a ``ConcatBitcast`` custom-call) of the sliced array's own shape; else None."""
    if inst.opcode != "custom-call" or '"ConcatBitcast"' not in inst.attributes:
        return None
    found = set()
    for k in range(len(inst.operands)):
        done = program.operand(inst, k)
        start = program.operand(done, 0) if done and done.opcode == "async-done" else None
        whole = program.operand(start, 0) if start and start.opcode == "async-start" else None
        if whole is None:
            return None
        found.add(whole.name)
    if len(found) != 1 or whole is None or whole.shape.dims != inst.shape.dims:
        return None
    return whole


def source_of(program: Program, inst: Instruction) -> Instruction:
    """What `inst` is made from when it only moves or reinterprets data (bitcast, copy)."""
    seen = set()
    while inst.name not in seen:
        seen.add(inst.name)
        if inst.opcode in _PASS and inst.operands:
            nxt = program.operand(inst, 0)
        else:
            nxt = reassembled(program, inst)
        if nxt is None:
            break
        inst = nxt
    return inst


def trip_count(program: Program, loop: Instruction) -> int | None:
    """A while loop's steps: XLA's record of them, else read from the loop itself, where
    XLA's TPU compiler records none. Its condition compares element k of the loop's state
    less than a constant, and the loop starts element k at a constant (a scan's or a
    fori_loop's counter, counting by one)."""
    if loop.trip_count:
        return loop.trip_count
    condition = re.search(r"\bcondition=%?([\w.\-]+)", loop.attributes)
    test = program.module.root(condition[1]) if condition else None
    if test is None or test.opcode != "compare" or "direction=LT" not in test.attributes:
        return None
    counter, bound = (program.module.get(n) for n in test.operands[:2])
    k = counter.tuple_index if counter and counter.opcode == "get-tuple-element" else None
    state = program.module.get(loop.operands[0]) if loop.operands else None
    if k is None or bound is None or state is None or state.opcode != "tuple":
        return None
    start = program.module.get(state.operands[k]) if k < len(state.operands) else None
    start = source_of(program, start) if start is not None else None
    if start is None or start.opcode != "constant" or bound.opcode != "constant":
        return None
    try:
        return int(bound.operands[0]) - int(start.operands[0])
    except (IndexError, ValueError):
        return None


def _parameters(program: Program) -> dict[int, Parameter]:
    """The program's inputs by HLO parameter number (the first, where two share one)."""
    found: dict[int, Parameter] = {}
    for p in program.parameters:
        found.setdefault(p.number, p)
    return found


def entry_parameter(program: Program, inst: Instruction) -> Parameter | None:
    """The program input `inst` is (through bitcasts and copies), or None."""
    inst = source_of(program, program.outside(inst))
    if inst.opcode != "parameter" or inst.computation != program.module.entry:
        return None
    number = inst.parameter_number
    return None if number is None else program.shared(_parameters).get(number)


def kept_for_backward(program: Program) -> frozenset[str]:
    """The instructions of temporaries outside any loop that the reverse-mode pass reads
    (`Program.read_by_backward`), decided once for the detectors that ask of each."""
    found = set()
    for v in program.values:
        inst = program.module.get(v.instruction)
        if v.kind != "temp" or inst is None or v.instruction in found or program.in_loop(inst):
            continue
        if program.read_by_backward(v.instruction):
            found.add(v.instruction)
    return frozenset(found)


# What moves or re-types an input on its way to a product: a cast to bfloat16, a transpose,
# a copy, the all-gather of a sharded weight.
MOVES = (*_PASS, "transpose", "all-gather")


def moved_input(program: Program, inst: Instruction | None) -> Instruction | None:
    """The program input (an entry parameter) that `inst` is, through moves and fusions that
    only move their operand; None for anything computed."""
    seen: set[str] = set()
    while inst is not None and inst.name not in seen:
        seen.add(inst.name)
        inst = program.outside(inst)
        if inst.opcode == "parameter":
            return inst if inst.computation == program.module.entry else None
        if inst.opcode == "fusion" and inst.calls:  # a fusion that only moves its operand
            root = program.module.root(inst.calls[0])
            inst = root if root is not None and root.opcode in (*MOVES, "parameter") else None
        elif inst.opcode in MOVES and inst.operands:
            inst = program.operand(inst, 0)
        else:
            inst = reassembled(program, inst)
    return None


# GPU library calls that multiply: cuBLAS's gemms, and cuDNN's convolutions (forward, and
# the gradient's, on input and on filter), which a GPU compiler calls for every convolution.
_LIBRARY_PRODUCTS = ("gemm", "matmul", "__cudnn$conv")


def is_product(inst: Instruction) -> bool:
    """A matrix product or a convolution: XLA's own, or a GPU library call (a cuBLAS gemm,
    a cuDNN convolution)."""
    return inst.opcode in PRODUCTS or (
        inst.opcode == "custom-call" and any(k in inst.attributes for k in _LIBRARY_PRODUCTS)
    )


def fusion_part(program: Program, inst: Instruction) -> list[Instruction] | None:
    """When `inst` is one result of a multi-output fusion (a get-tuple-element of it), the
    instructions inside the fusion that compute that result; else None."""
    if inst.opcode != "get-tuple-element" or not inst.operands:
        return None
    fusion = program.module.get(inst.operands[0])
    if fusion is None or fusion.opcode != "fusion" or not fusion.calls:
        return None
    root = program.module.root(fusion.calls[0])
    k = inst.tuple_index
    if root is None or root.opcode != "tuple" or k is None or k >= len(root.operands):
        return None
    element = root.operands[k]
    found = (program.module.get(n) for n in {element} | program.module.ancestors(element))
    return [i for i in found if i is not None]


def reads(program: Program, inst: Instruction) -> list[Instruction]:
    """What `inst` computes its result from: its operands, or, for one result of a
    multi-output fusion, the operands that result's part of the fusion reads."""
    part = fusion_part(program, inst)
    if part is not None:
        return [program.outside(i) for i in part if i.opcode == "parameter"]
    found = (program.operand(inst, k) for k in range(len(inst.operands)))
    return [i for i in found if i is not None]


@dataclasses.dataclass(frozen=True)
class StatePair:
    """An output computed elementwise from an input of its own shape: new state from old."""

    index: tuple[int, ...]
    output: Instruction
    parameter: Parameter
    aliased: bool


def state_pairs(program: Program) -> list[StatePair]:
    """Outputs that update an input of the same shape and dtype (``p - lr * g``, ``b * m``),
    found once per program (several detectors ask).

    An output is paired with an input of its shape that the instruction computing it reads
    directly (a fusion's operands count): a new value computed from the old one. Outputs
    that are the input itself, passed through, are not updates. Each input pairs once;
    where an output reads several candidates (``m`` and ``g`` in ``0.9 * m + 0.1 * g``),
    the one fewest outputs read is its state (``g`` feeds several updates, ``m`` one).
    """
    return program.shared(_state_pairs)


def _state_pairs(program: Program) -> list[StatePair]:
    candidates: list[tuple[tuple[int, ...], Instruction, list[Parameter]]] = []
    for index, inst in program.outputs():
        if not inst.shape.is_array or entry_parameter(program, inst) is not None:
            continue  # a tuple, or an input passed through unchanged
        found: dict[int, Parameter] = {}
        for operand in reads(program, source_of(program, inst)):
            param = entry_parameter(program, operand)
            if (
                param is not None
                and param.shape.dims == inst.shape.dims
                and param.shape.dtype == inst.shape.dtype
            ):
                found.setdefault(param.number, param)
        if found:
            candidates.append((index, inst, list(found.values())))
    readers = Counter(p.number for *_, params in candidates for p in params)
    taken: set[int] = set()
    pairs = []
    for index, inst, params in sorted(candidates, key=lambda c: len(c[2])):
        free = [p for p in params if p.number not in taken]
        if free:
            param = min(free, key=lambda p: (readers[p.number], p.number))
            taken.add(param.number)
            pairs.append(StatePair(index, inst, param, program.aliased_output(index)))
    return sorted(pairs, key=lambda p: p.index)


def at_peak(program: Program, values: list[Value]) -> int | None:
    """The bytes of `values` live at the program's peak (memory they share counted once):
    the most a fix that frees them all can save. None where XLA wrote no live ranges."""
    if not program.schedule:
        return None
    position = program.shared(of_program).position
    live: dict[tuple[int, int], int] = {}
    for v in values:
        found = program.live.get((v.instruction, v.index))
        if found is not None and found[0] <= position <= found[1]:
            live[v.allocation, v.offset] = max(v.size, live.get((v.allocation, v.offset), 0))
    return sum(live.values())


def held_at_peak(
    program: Program, values: list[Value], min_share: float, also: Sequence[Value] = ()
) -> int | None:
    """The bytes `values` hold at once, where a detector that names only what is live at the
    program's peak names them: at least `min_share` of the total at once, and at the peak
    (where XLA wrote live ranges). `also`: values the same fix frees that another detector
    names; they count towards the peak, never towards the bytes. Else None."""
    nbytes = program.peak(values)
    if not values or nbytes < min_share * program.total:
        return None
    peak = at_peak(program, [*values, *also])
    return None if peak is not None and peak < min_share * program.total else nbytes


def off_peak(
    program: Program,
    case: str,
    pattern: str,
    seen: str,
    values: list[Value],
    min_share: float,
    also: Sequence[Value] = (),
) -> NearMiss | None:
    """The near miss of a detector that names only what is live at the program's peak
    (`held_at_peak`): `values` (`seen`, in a phrase) hold at least `min_share` of the total
    at once, less at the peak. None where they are named, or too few to be."""
    nbytes = program.peak(values)
    peak = at_peak(program, [*values, *also])
    if nbytes < min_share * program.total or peak is None or peak >= min_share * program.total:
        return None
    where = program.shared(of_program).peak_instruction.split(",")[0]
    return NearMiss(
        case,
        pattern,
        nbytes,
        f"{seen} hold {fmt_bytes(nbytes)} at once, {nbytes / program.total:.0%} of the total, "
        f"but {fmt_bytes(peak)} at the program's peak ({where}): its fix lowers another point "
        f"of the schedule (named from {min_share:.0%} at the peak)",
    )


def _multiplying_fusions(program: Program) -> dict[str, set[str]]:
    """Each fusion that holds a product (a GPU's gemm fusions) -> the products inside it."""
    found: dict[str, set[str]] = {}
    for inst in program.module.instructions.values():
        if inst.opcode == "fusion":
            inside = {i.name for i in program.module.inner_ops(inst) if i.opcode in PRODUCTS}
            if inside:
                found[inst.name] = inside
    return found


def made_from(program: Program, inst: Instruction, products: set[str], limit: int = 256) -> bool:
    """Whether `inst` is computed from one of `products` by operations that multiply no
    further (through fusions' parameters): a softmax of those products themselves (of
    logits, not of attention scores made from a projection by a second product). A fusion
    that holds a product (a GPU compiler wraps each matrix product in one) stands for it; a
    library call that multiplies (a cuDNN convolution) ends the walk as a product does."""
    fused = program.shared(_multiplying_fusions)
    todo, seen = [inst], set[str]()
    while todo and len(seen) < limit:
        current = program.outside(todo.pop(0))
        inside = fused.get(current.name, set())
        if current.name in products or inside & products:
            return True
        if current.name in seen:
            continue
        seen.add(current.name)
        if is_product(current) or inside:
            continue
        todo += [i for n in current.operands if (i := program.module.get(n)) is not None]
    return False
