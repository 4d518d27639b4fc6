"""The compiled program as data: XLA's optimised HLO and buffer assignment, read back.

`runbook.measure` keeps the largest buffers; a diagnosis needs more: which instruction
feeds which, what a fusion computes, which values share memory and when each is live.
XLA writes all of it when asked to dump a compilation (``xla_dump_to``); this module
parses the dump into plain objects the detectors of `runbook.diagnose` query.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import TypeVar

from ._buffers import _COLOR, Buffer, _allocation_kind, _short_path, source_frames

_T = TypeVar("_T")

_ITEMSIZE = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2,
    "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"^([a-z]\w*)\[([\d,]*)\]")
_SPACE = re.compile(r"\]\{[^}]*:[^}]*S\((\d+)\)")
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
_NAME = re.compile(r"%?([\w.\-]+(?:#\d+)?)")
# Newer XLA prints an operand that is one element of a tuple as ``%while.12#2`` instead of
# a get-tuple-element instruction; the reader restores the instruction (named ``while.12#2``)
# so that every detector sees one program structure, whichever XLA printed it.
_PROJECTION = re.compile(r"^(.+)#(\d+)$")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)")
_CALLED = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INDEX = re.compile(r"\bindex=(\d+)")
# An op name of the calls a program was traced in alone: jit(f), pmap(f), shard_map.
_CALL = r"(?:(?:jit|pmap)\([^/]*\)|shard_map)"
_CALLS_ONLY = re.compile(rf"{_CALL}(?:/{_CALL})*")
# Read on every instruction line of a dump: compiled once.
_OPCODE = re.compile(r"([\w\-]+)\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE_LINE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')


@dataclasses.dataclass(frozen=True)
class Shape:
    """An array shape as HLO prints it (``f32[8,128]``); tuples have no dtype."""

    text: str

    @functools.cached_property
    def _parsed(self) -> tuple[str, tuple[int, ...]] | None:
        m = _ARRAY.match(self.text)
        if m is None:
            return None
        return m[1], tuple(int(d) for d in m[2].split(",") if d)

    @property
    def is_array(self) -> bool:
        return self._parsed is not None

    @property
    def dtype(self) -> str:
        return self._parsed[0] if self._parsed else ""

    @property
    def dims(self) -> tuple[int, ...]:
        return self._parsed[1] if self._parsed else ()

    @property
    def nbytes(self) -> int:
        if self._parsed is None:
            return 0
        return math.ceil(math.prod(self.dims) * _ITEMSIZE.get(self.dtype, 4))

    @property
    def memory_space(self) -> int:
        """The memory the layout puts the array in (``{1,0:S(5)}`` -> 5: the host on a GPU
        or a TPU); 0, the device's, where the layout names none."""
        found = _SPACE.search(self.text) if self.is_array else None
        return int(found[1]) if found else 0

    def __str__(self) -> str:
        return self.text.split("{")[0] if self.is_array else self.text


# Instructions whose called computation's parameters are the instruction's operands.
_PASSES_OPERANDS = ("fusion", "async-start", "call")
# XLA's rematerialization pass names each clone it makes after the original.
_REMAT = re.compile(r"\.remat\d*$")
# Compiler-made instructions that only move, re-type or re-lay out their operand.
_MOVES = ("copy", "bitcast", "reshape", "transpose", "convert", "copy-start", "copy-done")


def itemsize(dtype: str) -> float:
    """Bytes per element of an HLO dtype (``"s16"`` -> 2)."""
    return _ITEMSIZE.get(dtype, 4)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: what it computes, from what, and the JAX op and line behind it."""

    name: str
    computation: str
    shape: Shape
    opcode: str
    operands: tuple[str, ...]
    attributes: str  # everything after the operand list, as printed
    op_name: str = ""
    source: str = ""
    root: bool = False

    @functools.cached_property
    def calls(self) -> tuple[str, ...]:
        """Computations this instruction runs (a fusion's body, a while's body and condition)."""
        # Cached: the detectors walk the module through these many times.
        found = _CALLS.findall(self.attributes)
        if m := _CALLED.search(self.attributes):
            found += [n.strip().lstrip("%") for n in m[1].split(",") if n.strip()]
        return tuple(found)

    @property
    def trip_count(self) -> int | None:
        """A while loop's known trip count, when XLA recorded one."""
        m = _TRIP_COUNT.search(self.attributes)
        return int(m[1]) if m else None

    @property
    def parameter_number(self) -> int | None:
        if self.opcode != "parameter":
            return None
        return int(self.operands[0]) if self.operands and self.operands[0].isdigit() else None

    @property
    def tuple_index(self) -> int | None:
        m = _INDEX.search(self.attributes)
        return int(m[1]) if m else None


def _split_shape(rest: str) -> tuple[str, str]:
    """``"(f32[2]{0}, s32[]) tuple(...)"`` -> (shape text, the remainder)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    shape, _, remainder = rest.partition(" ")
    return shape, remainder


def _split_call(text: str) -> tuple[str, str, str] | None:
    """``"fusion(%a, %b), kind=kLoop"`` -> ("fusion", "%a, %b", ", kind=kLoop")."""
    m = _OPCODE.match(text)
    if m is None:
        return None
    depth, start = 0, m.end() - 1
    for i in range(start, len(text)):
        depth += text[i] in "({"
        depth -= text[i] in ")}"
        if depth == 0:
            return m[1], text[start + 1 : i], text[i + 1 :]
    return m[1], text[start + 1 :], ""


@dataclasses.dataclass
class Module:
    """A compiled HLO module: its computations, instructions and who uses what."""

    name: str
    entry: str
    computations: dict[str, list[Instruction]]
    aliases: dict[tuple[int, ...], int]  # output index -> parameter number it may reuse

    @functools.cached_property
    def instructions(self) -> dict[str, Instruction]:
        return {i.name: i for body in self.computations.values() for i in body}

    @functools.cached_property
    def users(self) -> dict[str, list[Instruction]]:
        found: dict[str, list[Instruction]] = {}
        for body in self.computations.values():
            for inst in body:
                for op in inst.operands:
                    found.setdefault(op, []).append(inst)
        return found

    def root(self, computation: str) -> Instruction | None:
        return next((i for i in self.computations.get(computation, ()) if i.root), None)

    def get(self, name: str) -> Instruction | None:
        return self.instructions.get(name)

    @property
    def entry_instructions(self) -> list[Instruction]:
        return self.computations.get(self.entry, [])

    def parameters(self, computation: str | None = None) -> list[Instruction]:
        """The parameters of `computation` (the entry by default), by number."""
        body = self.computations.get(computation or self.entry, [])
        found = [i for i in body if i.opcode == "parameter"]
        return sorted(found, key=lambda i: i.parameter_number or 0)

    def relays(self, inst: Instruction) -> bool:
        """Whether `inst` only carries its operand's value to another memory space or place:
        XLA's TPU compiler evicts a value to HBM and prefetches it back (copy-start and
        copy-done), takes it in slices (an async-start of a slice, and its async-done) and
        puts the slices back together (its ConcatBitcast call)."""
        if inst.opcode in ("copy-start", "copy-done"):
            return True
        if inst.opcode == "custom-call":
            return 'custom_call_target="ConcatBitcast"' in inst.attributes
        if inst.opcode == "async-done" and inst.operands:
            start = self.get(inst.operands[0])
            return start is not None and start.opcode == "async-start" and self.relays(start)
        if inst.opcode == "async-start" and inst.calls:
            root = self.root(inst.calls[0])
            return root is not None and root.opcode in ("slice", "dynamic-slice", "copy")
        return False

    @staticmethod
    def recomputes(inst: Instruction) -> bool:
        """Whether `inst` is a clone XLA's rematerialization pass made (``fusion.7.remat2``):
        the same computation again, for the users it was cloned for."""
        return _REMAT.search(inst.name) is not None

    def inner_ops(self, inst: Instruction) -> Iterator[Instruction]:
        """Every instruction of the computations `inst` calls, recursively (a fusion's body)."""
        seen: set[str] = set()
        stack = list(inst.calls)
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for i in self.computations.get(name, ()):
                yield i
                stack.extend(i.calls)

    def through(self, inst: Instruction) -> Instruction:
        """What `inst` computes, looking through bitcasts, copies and one-op fusions' roots."""
        seen = set()
        while inst.name not in seen:
            seen.add(inst.name)
            if inst.opcode in ("bitcast", "copy", "reshape") and inst.operands:
                nxt = self.get(inst.operands[0])
            elif inst.opcode == "fusion" and inst.calls:
                nxt = self.root(inst.calls[0])
            else:
                break
            if nxt is None:
                break
            inst = nxt
        return inst

    @functools.cached_property
    def callers(self) -> dict[str, Instruction]:
        """Computation name -> the instruction that calls it (the first one found)."""
        found: dict[str, Instruction] = {}
        for body in self.computations.values():
            for inst in body:
                for c in inst.calls:
                    found.setdefault(c, inst)
        return found

    def outside(self, inst: Instruction) -> Instruction:
        """For a parameter of a fused computation: the operand the fusion was called with
        (likewise for the computation an async-start or a call runs)."""
        seen = set()
        while inst.opcode == "parameter" and inst.computation not in seen:
            seen.add(inst.computation)
            caller = self.callers.get(inst.computation)
            number = inst.parameter_number
            if caller is None or caller.opcode not in _PASSES_OPERANDS or number is None:
                break
            nxt = self.get(caller.operands[number]) if number < len(caller.operands) else None
            if nxt is None:
                break
            inst = nxt
        return inst

    def returned(self, inst: Instruction) -> Instruction:
        """For the root of a computation a call runs: the call, whose result it is (likewise
        out of nested calls; XLA:CPU at jax 0.12 runs a loop as a call of its own); else
        `inst`. What `outside` is to a parameter, this is to a result."""
        while inst.root:
            caller = self.callers.get(inst.computation)
            if caller is None or caller.opcode != "call":
                break
            inst = caller
        return inst

    def operand(self, inst: Instruction, k: int) -> Instruction | None:
        """The `k`-th operand of `inst`; a fusion's parameter resolved to the caller's operand."""
        if k >= len(inst.operands):
            return None
        found = self.get(inst.operands[k])
        return self.outside(found) if found is not None else None

    def describe(self, inst: Instruction, *, past_calls: bool = False) -> tuple[str, str]:
        """The JAX op name and source line of `inst`, or, where the compiler made it and
        recorded none (a tuple element of a multi-output fusion, a copy, a layout change;
        most of a TPU program's buffers), of the nearest instruction it is made from that
        has them: into a fusion's root, through tuple elements, back through moves.

        With `past_calls`, what only names the call the program was traced in (an op name
        of `jit`, `pmap` and `shard_map` alone, such as ``jit(step)/jit(step)``, with the
        jit's own call line) is passed over. Where nothing `inst` is made from names an
        operation (the zeros a loop's stacked outputs start from, and their copies, carry
        the call's name alone), the nearest instruction that uses it and names one does
        (the loop); only where none does, the call."""
        op, source = inst.op_name, inst.source
        call = ("", "")
        if past_calls and names_a_call(op):
            op, source = "", ""
        for current in _nearest(inst, self._made_from):
            if op and source:
                break
            if past_calls and names_a_call(current.op_name):
                call = call if call[0] else (current.op_name, current.source)
            else:
                op, source = op or current.op_name, source or current.source
        if call[0] and not op:
            op, source = self._used_by(inst)
        return (op, source) if op else (call[0], source or call[1])

    def _used_by(self, inst: Instruction) -> tuple[str, str]:
        """The op name and source line of the nearest instruction that uses `inst`, directly
        or through others, and names an operation (`names_a_call`); empty where none does."""
        for current in _nearest(inst, lambda i: self.users.get(i.name, [])):
            if current is not inst and current.op_name and not names_a_call(current.op_name):
                return current.op_name, current.source
        return "", ""

    def _made_from(self, inst: Instruction) -> list[Instruction]:
        """What `inst` is made from, for `describe`: a called computation's root (or its
        tuple's elements), the element a get-tuple-element takes, a move's operand."""
        if inst.opcode == "get-tuple-element" and inst.operands:
            source = self.get(inst.operands[0])
            k = inst.tuple_index
            root = self.root(source.calls[0]) if source and source.calls else source
            if root is not None and root.opcode == "tuple" and k is not None:
                element = self.get(root.operands[k]) if k < len(root.operands) else None
                return [element] if element is not None else []
            return [source] if source is not None else []
        if inst.calls:
            root = self.root(inst.calls[0])
            if root is not None and root.opcode == "tuple":
                return [i for n in root.operands if (i := self.get(n)) is not None]
            return [root] if root is not None else []
        if inst.opcode == "parameter":
            outside = self.outside(inst)
            return [outside] if outside is not inst else []
        if inst.opcode in _MOVES and inst.operands:
            found = self.operand(inst, 0)
            return [found] if found is not None else []
        return []

    def fold(
        self,
        name: str,
        value: Callable[[Instruction, list[_T]], _T],
        memo: dict[str, _T],
        missing: _T,
    ) -> _T:
        """``value(inst, its operands' values)`` for `name`, each instruction's computed once
        into `memo` (post order, without recursion: a deep program has long chains);
        `missing` for a name the module does not hold."""
        stack = [(name, False)]
        while stack:
            n, expanded = stack.pop()
            if n in memo:
                continue
            inst = self.instructions.get(n)
            if inst is None:
                memo[n] = missing
            elif not expanded:
                stack.append((n, True))
                stack.extend((op, False) for op in inst.operands if op not in memo)
            else:
                memo[n] = value(inst, [memo.get(op, missing) for op in inst.operands])
        return memo[name]

    def dependent(self, names: set[str]) -> set[str]:
        """The members of `names` that depend on another member (through their operands,
        transitively): one walk for the whole set, each instruction decided once, where
        `ancestors` per member walks the shared history again for every one."""
        memo: dict[str, bool] = {}

        def reaches(inst: Instruction, operands: list[bool]) -> bool:
            return any(op in names or got for op, got in zip(inst.operands, operands, strict=True))

        return {n for n in names if self.fold(n, reaches, memo, False)}

    def ancestors(self, name: str, limit: int = 100_000) -> set[str]:
        """Every instruction `name` depends on in its computation (operands, transitively)."""
        seen: set[str] = set()
        first = self.get(name)
        stack = list(first.operands) if first is not None else []
        while stack and len(seen) < limit:
            n = stack.pop()
            if n in seen or n not in self.instructions:
                continue
            seen.add(n)
            stack.extend(self.instructions[n].operands)
        return seen


def _nearest(
    start: Instruction, step: Callable[[Instruction], list[Instruction]], limit: int = 64
) -> Iterator[Instruction]:
    """`start`, then what `step` leads to from it, breadth first, each instruction once and
    at most `limit` of them: the nearest first."""
    todo, seen = [start], set[str]()
    while todo and len(seen) < limit:
        current = todo.pop(0)
        if current.name in seen:
            continue
        seen.add(current.name)
        yield current
        todo += step(current)


def parse_module(text: str) -> Module:
    """Parse the text XLA prints for an optimised module (``compiled.as_text()`` or a dump)."""
    frames = source_frames(text)
    shapes: dict[str, Shape] = {}  # one object per distinct text: each parsed once
    computations: dict[str, list[Instruction]] = {}
    entry = name = computation = ""
    aliases: dict[tuple[int, ...], int] = {}
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("HloModule "):
            name = line.split()[1].rstrip(",")
            if (m := re.search(r"input_output_alias=\{(.*?)\s\}(?:,|$)", line)) is not None:
                for out, param in re.findall(r"\{([\d,\s]*)\}: \((\d+), \{", m[1]):
                    key = tuple(int(x) for x in out.split(",") if x.strip())
                    aliases[key] = int(param)
            continue
        if (c := _COMPUTATION.match(line)) is not None and " = " not in line.split("(")[0]:
            computation = c[2]
            computations[computation] = []
            if c[1]:
                entry = computation
            continue
        if " = " not in stripped or not computation:
            continue
        lhs, _, rest = stripped.partition(" = ")
        root = lhs.startswith("ROOT ")
        inst_name = lhs.removeprefix("ROOT ").lstrip("%")
        shape, rest = _split_shape(rest)
        call = _split_call(rest)
        if call is None:
            continue
        opcode, operand_text, attributes = call
        operand_text = _COMMENT.sub("", operand_text)  # "/*index=5*/%a" -> "%a"
        if opcode in ("parameter", "constant", "iota"):
            operands = tuple(o.strip() for o in operand_text.split(",") if o.strip())[:1]
        else:
            operands = tuple(
                m[1]
                for o in operand_text.split(",")
                if (m := _NAME.search(o.strip().split(" ")[-1]))
            )
        op_name = m[1].replace("\\'", "'") if (m := _OP_NAME.search(attributes)) else ""
        source = ""
        if (m := _FRAME_ID.search(attributes)) is not None:
            source = frames.get(m[1], "")
        elif (m := _SOURCE_LINE.search(attributes)) is not None:
            source = f"{_short_path(m[1])}:{m[2]}"
        computations[computation].append(
            Instruction(
                inst_name,
                computation,
                shapes.setdefault(shape, Shape(shape)),
                opcode,
                operands,
                attributes,
                op_name,
                source,
                root,
            )
        )
    _restore_projections(computations)
    return Module(name, entry, computations, aliases)


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One fused kernel of a compiled program: what it reads and which operations it holds."""

    name: str
    shape: str
    operands: tuple[str, ...]
    ops: tuple[str, ...]  # the operations inside, in order of first appearance


# What a fusion's body holds that is no operation of the kernel's own.
_PLUMBING = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple")


def fusions(text: str) -> list[Fusion]:
    """The fusions of a compiled program's entry computation (from ``compiled.as_text()``),
    multi-output ones included.

    Shows where a compiler put an operation: the GPU compiler, for one, computes the
    gather-grad index copy inside the scatter's kernel instead of in a buffer of its own.
    """
    module = parse_module(text)

    def ops(computation: str, seen: frozenset[str]) -> list[str]:
        found: list[str] = []
        for inst in module.computations.get(computation, []):
            if inst.opcode not in _PLUMBING:
                found.append(inst.opcode)
            if inst.opcode == "fusion" and inst.calls and inst.calls[0] not in seen:
                found += ops(inst.calls[0], seen | {inst.calls[0]})
        return list(dict.fromkeys(found))

    def shape(s: Shape) -> str:
        return str(s) if s.is_array else f"({', '.join(map(shape, _elements(s)))})"

    return [
        Fusion(inst.name, shape(inst.shape), inst.operands, tuple(ops(inst.calls[0], frozenset())))
        for inst in module.entry_instructions
        if inst.opcode == "fusion" and inst.calls
    ]


def _elements(shape: Shape) -> list[Shape]:
    return [Shape(e) for e in _tuple_elements(shape.text)]


def _tuple_elements(shape: str) -> list[str]:
    """``"(s32[], f32[2]{0}, /*index=2*/f32[3])"`` -> ``["s32[]", "f32[2]{0}", "f32[3]"]``."""
    inner = re.sub(r"/\*.*?\*/", "", shape.strip())[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += ch in "({["
        depth -= ch in ")}]"
        if ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    return [*parts, inner[start:].strip()] if inner.strip() else parts


def _restore_projections(computations: dict[str, list[Instruction]]) -> None:
    """Add a get-tuple-element for each ``x#k`` operand, before its first user."""
    shapes = {i.name: i.shape.text for body in computations.values() for i in body}
    for computation, body in computations.items():
        made: set[str] = set()
        out: list[Instruction] = []
        for inst in body:
            for operand in inst.operands:
                m = _PROJECTION.match(operand)
                if m is None or operand in made or m[1] not in shapes:
                    continue
                elements = _tuple_elements(shapes[m[1]])
                k = int(m[2])
                shape = elements[k] if k < len(elements) else ""
                out.append(Instruction(operand, computation, Shape(shape), "get-tuple-element",
                                       (m[1],), f", index={k}"))  # fmt: skip
                made.add(operand)
            out.append(inst)
        body[:] = out


# --- the buffer assignment -----------------------------------------------------------------

_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
# A value a loop carries is printed with a mark: ``<45 arg_tuple.3{1} (phi) @0>``.
_VALUE = re.compile(
    r"^ value: <\d+ ([^ >]+)( \(phi\))?(?: @[^>]*)?> \(size=(\d+),offset=(\d+)\): (\S+)"
)
_LIVE = re.compile(r"^\s+([\w.\-]+)(\{[\d,]*\}):(\d+)-(\d+)$")
_STEP = re.compile(r"^\s+(\d+):([\w.\-]+)$")


@dataclasses.dataclass(frozen=True)
class Value:
    """One value of the buffer assignment: an instruction's result (or one tuple element)."""

    instruction: str
    index: str  # "{}" for the whole result, "{1}" for element 1 of a tuple
    size: int
    offset: int
    allocation: int
    kind: str  # argument, output, temp, constant or thread-local
    shape: str
    # XLA's colour of the allocation: 0 is the device's main memory; TPU compilers put
    # on-chip scratch (VMEM) in 1 and scalar memory in 2.
    space: int = 0
    # A phi: what a loop carries into its body, out of it, or from one iteration to the
    # next. It shares memory with a value XLA lists without the mark, at another time of
    # the schedule: it has a live range of its own, and no bytes of its own.
    phi: bool = False

    @property
    def extent(self) -> tuple[int, int, int]:
        """(allocation, offset, size): two values with the same extent share memory."""
        return self.allocation, self.offset, self.size


def names_a_call(op: str) -> bool:
    """Whether JAX op name `op` names only the calls a program was traced in (jit, pmap,
    shard_map), no operation: ``jit(step)/jit(step)``, ``jit(_fun)/shard_map``."""
    return bool(_CALLS_ONLY.fullmatch(op))


def parse_assignment(text: str) -> list[Value]:
    """Every value of a dumped buffer assignment, in the order XLA lists them (phis marked)."""
    values: list[Value] = []
    kind, alloc, space = "temp", -1, 0
    for line in text.splitlines():
        if (a := _ALLOC.match(line)) is not None:
            kind, alloc = _allocation_kind(a[3]), int(a[1])
            space = int(c[1]) if (c := _COLOR.search(a[3])) is not None else 0
        elif (v := _VALUE.match(line)) is not None:
            name, _, index = v[1].partition("{")
            values.append(
                Value(
                    name,
                    "{" + index if index else "{}",
                    int(v[3]),
                    int(v[4]),
                    alloc,
                    kind,
                    v[5].split("{")[0],
                    space,
                    bool(v[2]),
                )
            )
        elif line.startswith(("Used values", "HloLiveRange", "Total bytes")):
            break
    return values


def parse_live_ranges(text: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(instruction, index) -> (first, last) position in the schedule, from a live-range dump."""
    ranges: dict[tuple[str, str], tuple[int, int]] = {}
    inside = False
    for line in text.splitlines():
        if line.strip() == "BufferLiveRange:":
            inside = True
            continue
        if inside:
            m = _LIVE.match(line)
            if m is None:
                if line.strip() and not line.startswith("    "):
                    break
                continue
            ranges[(m[1], m[2])] = (int(m[3]), int(m[4]))
    return ranges


def parse_schedule(text: str) -> list[str]:
    """The instruction at each position of the schedule, from a live-range dump.

    XLA flattens the program into one sequence: the entry computation's instructions, with
    those of the computations a while loop or a conditional runs (its condition, its body
    once, each branch) inserted before it. Live ranges index this sequence; a value live to
    the end of the program ends at ``len(schedule)``.
    """
    steps: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.strip() == "InstructionSequence:":
            inside = True
        elif inside:
            if (m := _STEP.match(line)) is None:
                break
            steps.append(m[2])
    return steps


@dataclasses.dataclass
class Dump:
    """What XLA dumped for one compiled program."""

    module: Module
    values: list[Value]  # the phis apart: each shares memory with a value listed here
    live: dict[tuple[str, str], tuple[int, int]]
    schedule: list[str] = dataclasses.field(default_factory=list)  # see `parse_schedule`
    phis: list[Value] = dataclasses.field(default_factory=list)
    # A program split over devices (SPMD): how many parts, and, from the module before
    # partitioning, the element counts each JAX op's results have in the whole program.
    partitions: int = 1
    whole: dict[str, frozenset[int]] = dataclasses.field(default_factory=dict)

    def buffers(self) -> list[Buffer]:
        """Every value with the JAX op and source line that made it, largest first."""
        found = []
        for v in self.values:
            inst = self.module.get(v.instruction)
            op, source = (
                self.module.describe(inst, past_calls=True) if inst is not None else ("", "")
            )
            name = f"{v.instruction} ({inst.opcode})" if inst is not None else v.instruction
            found.append(Buffer(v.size, v.shape, v.kind, name, op, source))
        return sorted(found, key=lambda b: b.size, reverse=True)


_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_RESULT = re.compile(r' = \w+\[([\d,]*)\][^\n]*?op_name="([^"]*)"')


def partitions(text: str) -> int:
    """How many parts an SPMD program is split into (its module's ``num_partitions``)."""
    m = _PARTITIONS.search(text.partition("\n")[0])
    return int(m[1]) if m else 1


def whole_elements(text: str) -> dict[str, frozenset[int]]:
    """For a module before optimisation, whose shapes are still the whole program's: each
    JAX op name -> the element counts of the arrays its instructions make."""
    found: dict[str, set[int]] = {}
    for dims, op in _RESULT.findall(text):
        found.setdefault(op, set()).add(math.prod(int(d) for d in dims.split(",") if d))
    return {op: frozenset(counts) for op, counts in found.items()}


def read_dump(directory: pathlib.Path) -> Dump | None:
    """The largest program's optimised module, buffer assignment and live ranges."""
    assignments = sorted(directory.glob("*after_optimizations-buffer-assignment.txt"))
    if not assignments:
        return None
    assignment = max(assignments, key=lambda p: p.stat().st_size)
    stem = assignment.name.removesuffix("-buffer-assignment.txt")
    hlo = assignment.with_name(stem + ".txt")
    live = assignment.with_name(stem + "-live-range.txt")
    ranges = live.read_text() if live.exists() else ""
    values = parse_assignment(assignment.read_text())
    text = hlo.read_text() if hlo.exists() else ""
    parts, whole = partitions(text), {}
    number = re.match(r"module_(\d+)\.", assignment.name)
    before = (
        sorted(directory.glob(f"module_{number[1]}.*before_optimizations.txt")) if number else []
    )
    if parts > 1 and before:  # only a partitioned program's shapes change
        whole = whole_elements(before[0].read_text())
    return Dump(
        parse_module(text),
        [v for v in values if not v.phi],
        parse_live_ranges(ranges),
        parse_schedule(ranges),
        [v for v in values if v.phi],
        parts,
        whole,
    )
