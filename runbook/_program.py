"""What a diagnosis reads: one compiled program, its HLO, its buffers and its inputs.

`Program.compile` compiles a function the way `runbook.measure` does, keeps XLA's dump
and answers the questions the detectors of `runbook.detectors` ask: which buffers are live
together, which instruction made a value and from what, which inputs are donated or
replicated. A detector reads only this: the compiled program, never the function's name or
source text.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import pathlib
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import jax

from . import _targets
from ._buffers import Buffer, allocation_sizes, assignment_bytes
from ._errors import DoesNotFitError, RunbookError
from ._hlo import Dump, Instruction, Shape, Value, read_dump
from ._inputs import as_jax, quiet_donation
from ._measure import YNN_OPTION, MemoryReport, _backend_caveats, _devices_used, compile_fn
from ._provenance import Provenance
from ._quiet import start_backend
from ._render import fmt_bytes

_T = TypeVar("_T")

SITE_FIX = "cases/{case}.html#fix"
# Instructions that move a value without computing from it: a residual read through them is
# still read.
_MOVES = frozenset({"bitcast", "copy", "get-tuple-element", "tuple", "reshape", "transpose"})
# Fused instructions that compute nothing of either pass, whatever op name they carry.
_NO_PASS = ("constant", "parameter")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One known mechanism recognised in a compiled program.

    Attributes:
        pattern: the mechanism, in a few words (``"index copy for a gather"``).
        case: the runbook case that explains it (a name from `runbook.case_names()`), or
            None.
        bytes: the bytes the finding accounts for, per device.
        evidence: the buffers behind it, largest first: size, shape, kind, the HLO
            instruction, the JAX operation and the source line that made each.
        fix: what to change, in one sentence, with the case page's fix section and the
            package function to copy where the case exists.
        detail: what was seen in the compiled program, in one sentence.
        informational: worth knowing, not a problem at this size (e.g. small replicated
            inputs).
        saving: bytes the fix saved when it could be applied mechanically and measured
            (e.g. donating an argument); None when it was not measured.
        link: the case page's fix section, relative to the site root, when the case exists.
        copy: the package function to copy, when the case exists.
    """

    pattern: str
    case: str | None
    bytes: int
    evidence: tuple[Buffer, ...]
    fix: str
    detail: str = ""
    informational: bool = False
    saving: int | None = None
    link: str | None = None
    copy: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "case": self.case,
            "bytes": self.bytes,
            "informational": self.informational,
            "saving": self.saving,
            "detail": self.detail,
            "fix": self.fix,
            "link": self.link,
            "copy": self.copy,
            "evidence": [dataclasses.asdict(b) for b in self.evidence],
        }


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A known mechanism a detector saw part of, below what it takes to name it.

    Attributes:
        case: the runbook case it would have named.
        pattern: the mechanism, in a few words (the detector's ``PATTERN``).
        bytes: the bytes the partial evidence accounts for, per device (the score: the
            largest near miss is the closest).
        reason: what was seen, and why it was not named (which test failed, with its
            threshold), in one sentence.
    """

    case: str
    pattern: str
    bytes: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _importable(dotted: str) -> bool:
    module, _, name = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def finding(
    pattern: str,
    case: str | None,
    nbytes: int,
    evidence: Iterable[Buffer],
    sentence: str,
    *,
    copy: str | None = None,
    **fields: Any,
) -> Finding:
    """A `Finding` whose fix is `sentence`, with the case's fix link and `copy` when the case
    exists in this runbook (a case not yet registered gets the sentence alone)."""
    from ._case import case_names

    link = SITE_FIX.format(case=case) if case in case_names() else None
    copy = copy if link and copy and _importable(copy) else None
    fix = sentence.rstrip(".")
    if link:
        fix += f" ({link}" + (f"; copy `{copy}`" if copy else "") + ")"
    evidence = tuple(sorted(evidence, key=lambda b: -b.size))
    return Finding(pattern, case, int(nbytes), evidence, fix + ".", link=link, copy=copy, **fields)


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One input of the compiled program (a leaf of the arguments JAX kept)."""

    number: int  # the HLO parameter number
    path: str  # the argument path JAX recorded, e.g. "params[0][0]"
    shape: Shape
    argnum: int | None  # the positional argument it belongs to
    aliased: bool  # donated: an output may reuse its buffer
    replicated: bool  # the whole array on every device of a multi-device program
    instruction: Instruction


def _merged(op: str) -> list[str]:
    """The op names an instruction XLA merged from several carries: ``"p/(a:b)"`` gives
    ``["p/(a:b)", "p/a", "p/b"]``; any other name, itself."""
    found = [op]
    if not op.endswith(")") or "/(" not in op:
        return found
    prefix, _, inner = op.rpartition("/(")
    depth, start = 0, 0
    for k, c in enumerate(inner[:-1]):
        depth += (c == "(") - (c == ")")
        if c == ":" and depth == 0:
            found.append(f"{prefix}/{inner[start:k]}")
            start = k + 1
    if start:
        found.append(f"{prefix}/{inner[start:-1]}")
    return found


def cpu_accounting_options() -> dict[str, Any]:
    """XLA options that make XLA:CPU's buffer assignment count every kernel's memory.

    jaxlib 0.10's XLA:CPU fuses matrix products into YNNPACK kernels whose working memory
    the buffer assignment leaves out (see `runbook.measure`'s caveats); a diagnosis needs
    those products as buffers. Empty on other backends and on jaxlibs without the option.
    """
    start_backend()  # with the plugins' start-up chatter filtered
    return dict(_cpu_accounting()) if jax.default_backend() == "cpu" else {}


@functools.cache
def _cpu_accounting() -> tuple[tuple[str, Any], ...]:
    try:
        jax.jit(lambda a: a).lower(1.0).compile({YNN_OPTION: ""})
    except Exception:  # noqa: BLE001 - older jaxlib: no such option, and no such fusion
        return ()
    return ((YNN_OPTION, ""),)


class Program:
    """A compiled program and everything XLA said about it.

    Attributes:
        fn, args: what was compiled (a detector may recompile a mechanical fix).
        report: its `MemoryReport`, buffers included.
        module: the optimised HLO (`runbook._hlo.Module`).
        values: every value of the buffer assignment, but its phis.
        phis: the values a loop carries (`runbook._hlo.Value.phi`): each shares memory
            with one of `values`, at other times of the schedule.
        live: each value's live range in the schedule, where XLA wrote one.
        schedule: the instruction at each position of the schedule (see
            `runbook._hlo.parse_schedule`); empty where XLA wrote no live ranges.
        parameters: the inputs, by HLO parameter number.
        devices: how many devices the program runs on.
        target: the target it was compiled for, or None for this process's backend.
        options: the XLA options it was compiled with.
        measure_fixes: whether a detector may compile a mechanical fix to measure it.
        refused: where the target's compiler refused the program as too large (and
            `compile` was asked to keep it), the compiler's figures (``needed``, ``limit``,
            ``what``): the program is the one it wrote before refusing. Else None.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        report: MemoryReport,
        dump: Dump,
        compiled: Any,
        target: _targets.Target | None,
        options: Mapping[str, Any],
        *,
        measure_fixes: bool = False,
        refused: dict[str, Any] | None = None,
    ) -> None:
        self.fn, self.args, self.report = fn, tuple(args), report
        self.measure_fixes, self.refused = measure_fixes, refused
        self.module, self.values, self.live = dump.module, dump.values, dump.live
        self.phis, self.schedule = dump.phis, dump.schedule
        self.partitions, self._whole = dump.partitions, dump.whole
        self.target, self.options = target, dict(options)
        self.devices = _device_count(compiled, dump)
        self.parameters = self._parameters(compiled)
        self._shared: dict[Callable[[Program], Any], Any] = {}

    def shared(self, analysis: Callable[[Program], _T]) -> _T:
        """`analysis(self)`, computed once: a detector and its near-miss read the same."""
        if analysis not in self._shared:
            self._shared[analysis] = analysis(self)
        result: _T = self._shared[analysis]
        return result

    @classmethod
    def compile(
        cls,
        fn: Callable[..., Any],
        *args: Any,
        target: _targets.Target | None = None,
        compiler_options: Mapping[str, Any] | None = None,
        name: str | None = None,
        measure_fixes: bool = False,
        keep_refused: bool = False,
    ) -> Program:
        """Compile `fn` for `args` (abstract welcome) and read back XLA's dump.

        With `keep_refused`, a program `target`'s compiler refuses as too large for one
        device is read from the dump it wrote before refusing (its figures from the buffer
        assignment, `refused` set); `DoesNotFitError` is raised only where it wrote none.
        """
        name = name or str(getattr(fn, "__name__", type(fn).__name__))
        unusable: list[str] | None = [] if quiet_donation(fn) else None
        fn, args = as_jax(fn, args)  # what is kept is what was compiled
        options = cpu_accounting_options() if target is None else {}
        options.update(compiler_options or {})
        refusal: DoesNotFitError | None = None
        with tempfile.TemporaryDirectory(prefix="runbook-diagnose-") as dump_dir:
            start = time.perf_counter()
            try:
                compiled = compile_fn(
                    fn,
                    *args,
                    compiler_options={**options, "xla_dump_to": dump_dir},
                    target=target,
                    unusable=unusable,
                )
            except DoesNotFitError as e:
                if not keep_refused:
                    raise
                compiled, refusal = None, e
            seconds = time.perf_counter() - start
            dump = read_dump(pathlib.Path(dump_dir))
            if refusal is not None and dump is None:
                raise refusal
            stats = compiled.memory_analysis() if compiled is not None else None
            assigned = assignment_bytes(pathlib.Path(dump_dir)) if refusal is not None else {}
            sizes = allocation_sizes(pathlib.Path(dump_dir))
            buffers = tuple(dump.buffers()) if dump is not None else ()
        where = target.name if target else jax.default_backend()
        if dump is None or (stats is None and refusal is None):
            raise RunbookError(f"the {where} compiler reports no buffer assignment to diagnose.")
        devices = _device_count(compiled, dump)
        fields: dict[str, Any] = {
            "name": name,
            "provenance": Provenance.for_target(target, devices)
            if target
            else Provenance.current(),
            "compile_seconds": seconds,
            "buffers": buffers,
            "allocations": sizes,
        }
        refused = None
        if refusal is None:
            caveats = () if target else _backend_caveats(compiled, options)
            report = MemoryReport.from_stats(stats, caveats=caveats, **fields)
        else:
            refused = {"needed": refusal.needed, "limit": refusal.limit, "what": refusal.what}
            said = (
                f"The {where} compiler refused this program: it needs {refusal.needed:,} bytes "
                f"of {refusal.what}, the device allows {refusal.limit:,}. These figures are "
                "the buffer assignment it wrote before refusing."
            )
            fields.update(assigned)  # argument, output, temp and alias
            report = MemoryReport(caveats=(said,), **fields)
        program = cls(
            fn,
            args,
            report,
            dump,
            compiled,
            target,
            options,
            measure_fixes=measure_fixes,
            refused=refused,
        )
        if target is None and jax.default_backend() == "cpu" and (note := program._widened()):
            program.report = dataclasses.replace(report, caveats=(*report.caveats, note))
        return program

    def _through_bf16(self, inst: Instruction) -> bool:
        """Whether `inst` converts a bfloat16 value (inside its fusion, or its operand)."""
        inner = [inst, *self.module.inner_ops(inst)]
        operand = self.module.operand(inst, 0)
        return any(i.shape.dtype == "bf16" for i in inner) or (
            operand is not None and operand.shape.dtype == "bf16"
        )

    @functools.cached_property
    def widened(self) -> frozenset[str]:
        """XLA:CPU multiplies bfloat16 in float32: the products it widened (a float32 dot of
        bfloat16 operands converted up, whose result is converted back down) and those
        operand copies, by instruction name. Empty for a target's compiler."""
        if self.target is not None or jax.default_backend() != "cpu":
            return frozenset()
        m = self.module

        def made(inst: Instruction, dtype: str) -> bool:  # a convert (fused or not) to dtype
            root = m.through(inst)
            return inst.shape.dtype == dtype and root.opcode in ("convert", "bitcast")

        widened: set[str] = set()
        for dot in m.entry_instructions:
            if dot.opcode != "dot" or dot.shape.dtype != "f32":
                continue
            copies = [o for k in range(2) if (o := m.operand(dot, k)) is not None]
            upcast = [o for o in copies if made(o, "f32") and self._through_bf16(o)]
            if len(upcast) == 2 and any(made(u, "bf16") for u in m.users.get(dot.name, [])):
                widened |= {i.name for i in (dot, *upcast)}
            else:  # a float32 input cast to bfloat16 (a model's compute dtype), then back up
                widened |= {o.name for o in upcast if self._round_trip(o)}
        return frozenset(widened)

    def _round_trip(self, inst: Instruction) -> bool:
        """Whether `inst` is a float32 value converted to bfloat16 and back inside itself."""
        operand = self.module.operand(inst, 0)
        root = self.module.through(inst)
        return (
            inst.opcode == "fusion"
            and operand is not None
            and operand.shape.dtype == "f32"
            and root.opcode == "convert"
            and any(
                i.opcode == "convert" and i.shape.dtype == "bf16"
                for i in self.module.inner_ops(inst)
            )
        )

    def _widened(self) -> str | None:
        """`widened` as a caveat with the most bytes those values hold at once; None if none."""
        values = [v for n in self.widened for v in self.values_of(n) if v.kind == "temp"]
        if not values:
            return None
        products = sum(1 for n in self.widened if self.module.instructions[n].opcode == "dot")
        copies = len(self.widened) - products
        return (
            f"XLA:CPU multiplies bfloat16 in float32: {products} bfloat16 product(s) and "
            f"{copies} bfloat16 operand(s) are float32 buffers here, "
            f"{fmt_bytes(self.peak(values))} at most at once (half that in bfloat16). A GPU or "
            "TPU compiler may keep them in bfloat16: diagnose with target= to see."
        )

    # --- inputs and outputs ---------------------------------------------------------------

    def _parameters(self, compiled: Any) -> list[Parameter]:
        try:  # one sharding per leaf of the arguments; None for a leaf JAX pruned as unused
            shardings, _ = jax.tree_util.tree_flatten(
                compiled.input_shardings[0], is_leaf=lambda x: x is None
            )
        except Exception:  # noqa: BLE001 - older releases: assume every leaf was kept
            shardings = []
        owners = [
            i
            for i, arg in enumerate(self.args)
            for _ in jax.tree_util.tree_leaves(arg, is_leaf=lambda x: x is None)
        ]
        params = self.module.parameters()
        kept = [(i, s) for i, s in enumerate(shardings) if s is not None] if shardings else []
        if compiled is None and len(params) == len(owners):  # refused: each leaf a parameter
            kept = [(i, None) for i in range(len(owners))]
        aliased = set(self.module.aliases.values())
        out = []
        for k, inst in enumerate(params):
            leaf, sharding = kept[k] if k < len(kept) else (None, None)
            number = inst.parameter_number if inst.parameter_number is not None else k
            replicated = bool(
                sharding is not None
                and len(sharding.device_set) > 1
                and sharding.is_fully_replicated
            )
            out.append(
                Parameter(
                    number,
                    inst.op_name or inst.name,
                    inst.shape,
                    owners[leaf] if leaf is not None and leaf < len(owners) else None,
                    number in aliased,
                    replicated,
                    inst,
                )
            )
        return out

    def outputs(self) -> list[tuple[tuple[int, ...], Instruction]]:
        """(output index, the instruction that computes it) for each output of the program."""
        root = self.module.root(self.module.entry)
        if root is None:
            return []
        if root.opcode != "tuple":
            return [((), root)]
        found: list[tuple[tuple[int, ...], Instruction]] = []
        for i, name in enumerate(root.operands):
            inst = self.module.get(name)
            if inst is not None:
                found.append(((i,), inst))
        return found

    def aliased_output(self, index: tuple[int, ...]) -> bool:
        return index in self.module.aliases

    # --- what made a value ----------------------------------------------------------------

    @property
    def total(self) -> int:
        return self.report.total

    def describe(self, inst: Instruction) -> tuple[str, str]:
        """The JAX op name and source line of `inst` (see `Module.describe`)."""
        return self.module.describe(inst)

    def buffer(self, inst: Instruction, value: Value | None = None) -> Buffer:
        """Evidence for `inst` (its buffer-assignment value where it has one), named by the
        operation that made it, past the calls it was traced in (`Module.describe`)."""
        op, source = self.module.describe(inst, past_calls=True)
        if value is None:
            value = next((v for v in self.values_of(inst.name)), None)
        size = value.size if value else inst.shape.nbytes
        shape = value.shape if value else str(inst.shape)
        kind = value.kind if value else "fused"
        return Buffer(size, shape, kind, f"{inst.name} ({inst.opcode})", op, source)

    @functools.cached_property
    def _values_by_name(self) -> dict[str, list[Value]]:
        found: dict[str, list[Value]] = {}
        for v in self.values:
            found.setdefault(v.instruction, []).append(v)
        return found

    def values_of(self, name: str) -> list[Value]:
        """The buffer-assignment values of instruction `name` (empty when it has none)."""
        return self._values_by_name.get(name, [])

    def peak(self, values: Iterable[Value]) -> int:
        """The most bytes `values` hold in the device's memory at one point of the schedule.

        Values that share memory (the same allocation and offset) count once; without live
        ranges from XLA, every distinct piece of memory counts. A value in another memory
        space (a TPU's on-chip memory, the host's) holds none of the device memory the
        program's total counts.
        """
        chosen = list({(v.instruction, v.index): v for v in values if v.space == 0}.values())
        found = [self.live.get((v.instruction, v.index)) for v in chosen]
        if not chosen:
            return 0
        ranges = [r for r in found if r is not None]
        if len(ranges) < len(found):
            return sum({v.extent[:2]: v.size for v in chosen}.values())
        best = 0
        for start, _ in ranges:
            live = {
                v.extent[:2]: v.size
                for v, (a, b) in zip(chosen, ranges, strict=True)
                if a <= start <= b
            }
            best = max(best, sum(live.values()))
        return best

    def operand(self, inst: Instruction, k: int) -> Instruction | None:
        """The `k`-th operand of `inst`; a fusion's parameter resolved to the caller's operand."""
        return self.module.operand(inst, k)

    def outside(self, inst: Instruction) -> Instruction:
        """For a parameter of a fused computation: the operand the fusion was called with."""
        return self.module.outside(inst)

    @property
    def callers(self) -> dict[str, Instruction]:
        """Computation name -> the instruction that calls it (the first one found)."""
        return self.module.callers

    def in_loop(self, inst: Instruction) -> bool:
        """True when `inst` runs inside a while loop's body (a scan, a fori_loop, lax.map)."""
        computation, seen = inst.computation, set()
        while computation in self.callers and computation not in seen:
            seen.add(computation)
            caller = self.callers[computation]
            if caller.opcode == "while":
                return True
            computation = caller.computation
        return False

    def stacked_per_step(self) -> dict[str, int]:
        """Arrays a while loop writes one step at a time: instruction name -> the loop's steps.

        An instruction of a loop's body (or of a loop inside it) that computes a
        dynamic-update-slice, with a leading dimension equal to the loop's known trip count:
        a scan's stacked outputs, and what a gradient stores per step for its backward pass.
        The loop's own result element that carries such an array out of the loop is listed
        too, as ``"while.3{2}"`` (the name and tuple index a timeline's buffer carries).
        """
        found: dict[str, int] = {}
        for loop in self.module.instructions.values():
            steps = loop.trip_count
            if loop.opcode != "while" or not steps or steps < 2:
                continue
            body = re.search(r"\bbody=%?([\w.\-]+)", loop.attributes)
            for inst in self.module.computations.get(body[1], ()) if body else ():
                dims = inst.shape.dims if inst.shape.is_array else ()
                if (
                    dims
                    and dims[0] == steps
                    and self.module.through(inst).opcode == "dynamic-update-slice"
                ):
                    found.setdefault(inst.name, steps)
            root = self.module.root(body[1]) if body else None
            if root is not None and root.opcode == "tuple":
                for k, name in enumerate(root.operands):
                    if name in found:
                        found.setdefault(f"{loop.name}{{{k}}}", steps)
        return found

    @functools.cached_property
    def has_backward(self) -> bool:
        """True when the program holds a reverse-mode pass (ops JAX names ``transpose(...)``)."""
        return any("transpose(" in i.op_name for i in self.module.instructions.values())

    def backward_ancestry(self, name: str) -> bool:
        """True when instruction `name` is computed from the reverse-mode pass: read from one
        walk down the users of every instruction of that pass, made once per program (a
        training step's updates are hundreds of values whose histories share most of it)."""
        return name in self._from_backward

    @functools.cached_property
    def _backward(self) -> frozenset[str]:
        """The instructions that belong to the reverse-mode pass (ops JAX names
        ``transpose(...)``), a fusion when an operation fused into it does. Not a constant:
        the compiler shares one among both passes, under either's name."""
        return frozenset(
            i.name
            for i in self.module.instructions.values()
            if i.opcode not in _NO_PASS
            and (
                "transpose(" in i.op_name
                or (
                    i.opcode == "fusion"
                    and any(
                        "transpose(" in o.op_name
                        for o in self.module.inner_ops(i)
                        if o.opcode not in _NO_PASS
                    )
                )
            )
        )

    @functools.cached_property
    def _from_backward(self) -> frozenset[str]:
        """Every instruction `backward_ancestry` is true of."""
        todo = list(self._backward)
        seen: set[str] = set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(u.name for u in self.module.users.get(n, ()))
        return frozenset(seen)

    def read_by_backward(self, name: str) -> bool:
        """True when forward-pass instruction `name`'s value is read by the reverse-mode pass
        (through moves that compute nothing, and the compiler's own recomputations for that
        pass): a residual the gradient keeps, which rolling the loop that made it would
        stack, not free."""
        if name in self._from_backward:
            return False
        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for user in self.module.users.get(n, ()):
                if user.name in self._backward:
                    return True
                if (
                    user.opcode in _MOVES
                    or self.module.relays(user)
                    or self.module.recomputes(user)
                ):
                    todo.append(user.name)
        return False

    def whole_on_each_device(self, value: Value) -> bool:
        """In a program split over devices (SPMD), whether `value` holds on each device as
        many elements as the JAX op that made it does in the whole program: the partitioner
        computed it whole, on every device. Matched by op name with the module before
        partitioning; False outside a partitioned program or where the op is not found."""
        inst = self.module.get(value.instruction)
        if self.partitions < 2 or inst is None:
            return False
        op, _ = self.describe(inst)
        elements = math.prod(Shape(value.shape).dims)
        return any(elements in self._whole.get(name, ()) for name in _merged(op))

    def entry_parameters_of(self, name: str) -> set[int]:
        """The entry parameters instruction `name` depends on (HLO parameter numbers)."""
        mask = self._parameter_mask(name)
        return {i for i in range(mask.bit_length()) if mask >> i & 1}

    def _parameter_mask(self, name: str) -> int:
        """`entry_parameters_of` as a bit mask, each instruction's decided once per program
        (a detector asks for hundreds that share most of their history)."""
        entry = self.module.entry

        def mask(inst: Instruction, operands: list[int]) -> int:
            own = inst.opcode == "parameter" and inst.computation == entry
            found = 1 << (inst.parameter_number or 0) if own else 0
            for got in operands:
                found |= got
            return found

        return self.module.fold(name, mask, self.shared(_parameter_masks), 0)


def _device_count(compiled: Any, dump: Dump) -> int:
    """How many devices the program runs on: a refused one (no compiled object) has its
    SPMD partitions."""
    return _devices_used(compiled) if compiled is not None else max(dump.partitions, 1)


def _parameter_masks(program: Program) -> dict[str, int]:
    """Each instruction's entry parameters, as a bit mask, filled in as they are asked for."""
    return {}
