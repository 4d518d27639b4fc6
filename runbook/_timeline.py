"""`runbook.timeline`: the bytes live at each point of a compiled program, without the device.

XProf's memory viewer draws a program's memory over its schedule from a profile taken on
the device. XLA's compiler already knows it: its buffer assignment says which memory each
value occupies, and its live ranges say from which point of the schedule to which each
value is alive. Read together, they give the live bytes at every position of the compiled
schedule, for any target this machine can compile for, and the buffers live at the peak
with the JAX operation and source line that made each (jax-ml/jax#9530, #8096).
"""

from __future__ import annotations

import dataclasses
import heapq
import html
import itertools
import textwrap
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from . import _targets
from ._buffers import Buffer
from ._errors import RunbookError
from ._hlo import Value
from ._locator import call_located
from ._measure import MemoryReport
from ._program import Program
from ._provenance import Provenance
from ._render import Table, _unit, buffer_line, buffer_table, fmt_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["KINDS", "Timeline", "timeline", "timeline_locator"]

# What the compiled total counts, as `MemoryReport` splits it. Constants are compiled into
# the executable and thread-local values live in a kernel's own scratch: neither is in
# `MemoryReport.total`, and a timeline keeps them apart (`Timeline.constants`,
# `Timeline.thread_local`). Values in other memory spaces (a TPU's on-chip VMEM, its
# scalar memory) are apart too (`Timeline.elsewhere`): the figures count device memory.
KINDS = ("argument", "temp", "output")
_COLORS = {"argument": "#4c72b0", "temp": "#dd8452", "output": "#55a868"}


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The bytes a compiled program holds at each position of its schedule, by kind.

    A position is one instruction of the schedule XLA compiled (``instructions``): the entry
    computation's, with those of the computations a while loop or a conditional runs (its
    condition, its body once: one iteration stands for all, each branch in turn) inserted
    before the loop. A value is live from the position that defines it to its last use,
    both included (XLA's live ranges); a value live at the end of the program (an output,
    an argument) is live to the last position.

    Memory, not values, is counted: values at the same allocation and offset at the same
    position (a bitcast, an in-place update, what a loop carries) are one piece of memory,
    counted once with the largest of their sizes. Each piece counts as the kind of its
    allocation, as `MemoryReport` does: an output written into a donated argument is an
    argument, and a temporary that XLA places in an output's memory before the output is
    written counts as output. Constants (compiled into the program), thread-local values
    (a kernel's own scratch, with no live range) and other memory spaces than the
    device's main memory (a TPU's on-chip VMEM) are left out, as the total leaves them out,
    and given apart.

    The peak and the compiled total (`MemoryReport.total`, argument + output + temp -
    alias): XLA reserves each allocation of its buffer assignment for the whole run. On
    CPU and on GPU targets the allocations add up to the total exactly (``allocated``;
    an output written into a donated argument shares its allocation, which is the alias
    the total subtracts), and at the peak part of them holds no live value (``idle``): an
    output written after the peak, a temporary allocation packed for values live at other
    positions, padding. So ``peak + sum(idle.values()) == total``, and the peak is the
    total exactly when no allocation is idle at the peak. A TPU compiler's total is not
    the sum of its allocations (its temp figure is sometimes 0 beside a temporary
    allocation, sometimes larger than all of them; the difference is ``unassigned``, of
    either sign): on a TPU target the peak describes the buffer assignment, and can exceed
    the total.

    Attributes:
        report: the compiled program's `MemoryReport` (buffers included).
        instructions: the HLO instruction at each position of the schedule.
        live: kind (argument, temp, output) -> the bytes live at each position.
        peak: the most bytes live at one position, all kinds together.
        position: the first position where the peak is reached.
        at_peak: the memory live at the peak, largest first, each with its size, shape,
            kind, HLO instruction, the JAX operation and the source line that made it.
        allocated: kind -> the bytes of device memory the buffer assignment reserves for
            it for the whole run.
        constants: bytes of constants (compiled into the program; not in the total).
        thread_local: bytes XLA gives kernels to use inside them, with no live range (not
            in the total).
        elsewhere: bytes in memory spaces other than the device's main memory (a TPU's
            on-chip memory; not in the total).
        unranged: values of the counted kinds XLA printed no live range for, left out of
            the live bytes (none in any case's programs, on CPU, GPU or TPU targets).
        peak_instruction: the instruction at `position`, with the JAX operation and the
            source line that made it.
    """

    report: MemoryReport
    instructions: tuple[str, ...]
    live: Mapping[str, tuple[int, ...]]
    peak: int
    position: int
    at_peak: tuple[Buffer, ...]
    allocated: Mapping[str, int]
    constants: int = 0
    thread_local: int = 0
    elsewhere: int = 0
    unranged: tuple[Buffer, ...] = ()
    peak_instruction: str = ""

    @property
    def name(self) -> str:
        return self.report.name

    @property
    def total(self) -> int:
        """The compiled total, `MemoryReport.total` (argument + output + temp - alias)."""
        return self.report.total

    @property
    def provenance(self) -> Provenance:
        """Where the figures come from: backend or target, device, JAX version, devices."""
        return self.report.provenance

    @property
    def positions(self) -> range:
        return range(len(self.instructions))

    @property
    def bytes(self) -> tuple[int, ...]:
        """The bytes live at each position, all kinds together."""
        return tuple(sum(col) for col in zip(*(self.live[k] for k in KINDS), strict=True))

    @property
    def idle(self) -> dict[str, int]:
        """kind -> the bytes reserved for it that hold no live value at the peak."""
        return {k: self.allocated.get(k, 0) - self.live[k][self.position] for k in KINDS}

    @property
    def unassigned(self) -> int:
        """How much the compiled total exceeds the allocations of the buffer assignment,
        0 on CPU and GPU targets; on a TPU target the compiler's own total differs from
        them (either sign)."""
        return self.total - sum(self.allocated.get(k, 0) for k in KINDS)

    def _where(self) -> str:
        return f"position {self.position} of {len(self.instructions)} ({self.peak_instruction})"

    def _caption(self) -> str:
        idle = {k: v for k, v in self.idle.items() if v}
        gap = (
            " (idle at the peak: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in idle.items()) + ")"
            if idle
            else ""
        )
        u = self.unassigned
        beyond = (
            f"; the compiler's total is {fmt_bytes(abs(u))} {'above' if u > 0 else 'below'} "
            "the allocations of its buffer assignment"
            if u
            else ""
        )
        return (
            f"{self.name}: peak {fmt_bytes(self.peak)} live at {self._where()}; compiled "
            f"total {fmt_bytes(self.total)}{gap}{beyond}. {self.provenance.label()}."
        )

    def table(self, n: int = 10) -> Table:
        """The `n` largest buffers live at the peak (`runbook.buffer_table`'s columns)."""
        return buffer_table(self.at_peak[:n], self._caption())

    def __str__(self) -> str:
        lines = [f"Timeline of {self._caption()}", "Largest live at the peak:"]
        lines += [f"  {buffer_line(b)}" for b in self.at_peak[:5]]
        if len(self.at_peak) > 5:
            lines.append(f"  ... and {len(self.at_peak) - 5} more")
        if self.unranged:
            lines.append(
                f"Not drawn: {len(self.unranged)} value(s), "
                f"{fmt_bytes(sum(b.size for b in self.unranged))}, with no live range from XLA."
            )
        lines += [f"Caveat: {c}" for c in self.report.caveats]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return (
            f'<div class="runbook-timeline"><p>{html.escape(self._caption())}</p>'
            f"{buffer_table(self.at_peak[:10])._repr_html_()}</div>"
        )

    def plot(self, ax: Any = None, *, title: str = "", top: int | None = None) -> Axes:
        """Live bytes over program order, stacked by kind, the peak and the total marked.

        Position ``p`` is drawn from ``p`` to ``p + 1``; the title names what produced the
        figures: the backend or the target, and the JAX version.

        Args:
            ax: the axes to draw on (default: a new figure's).
            title: the first line of the title (default: the program's name).
            top: the bytes the y-axis reaches, in the unit that suits them (default: the
                larger of this program's total and peak). Give two timelines the larger of
                theirs to draw them on one scale.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.6))
        top = max(self.total, self.peak) if top is None else top
        unit, scale = _unit(max(top, 1))
        n = len(self.instructions)
        xs = list(range(n + 1))
        below = [0.0] * (n + 1)
        for kind in KINDS:
            values = [*self.live[kind], self.live[kind][-1]]  # the last step drawn too
            above = [b + v / scale for b, v in zip(below, values, strict=True)]
            ax.fill_between(
                xs, below, above, step="post", color=_COLORS[kind], label=kind, linewidth=0
            )
            below = above
        ax.axhline(
            self.total / scale, color="black", linestyle="--", linewidth=1, label="compiled total"
        )
        ax.axvline(self.position, color="crimson", linewidth=1)
        right = self.position > n / 2  # the label on the side with room
        ax.annotate(
            f"peak {fmt_bytes(self.peak)}",
            (self.position, self.peak / scale),
            xytext=(-4 if right else 4, 4),
            textcoords="offset points",
            ha="right" if right else "left",
            color="crimson",
            fontsize="small",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
        ax.set_xlim(0, n)
        ax.set_ylim(0, max(top, 1) / scale * 1.12)
        ax.set_xlabel("position in the compiled schedule (program order)")
        ax.set_ylabel(f"{unit} live per device")
        ax.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize="small", frameon=False
        )
        head = title or f"{self.name}: live bytes over program order"
        # A target's label is long: wrapped, it stays inside the chart's width.
        label = textwrap.fill(self.provenance.label(), 90)
        ax.set_title(f"{head}\n{label}", fontsize="medium")
        ax.figure.tight_layout()
        return cast("Axes", ax)

    def to_json(self) -> dict[str, Any]:
        """One JSON-able object: the series, the peak and its buffers, the provenance."""
        p = self.provenance
        return {
            "name": self.name,
            "backend": p.backend,
            "target": p.target or None,
            "device_kind": p.device_kind,
            "devices": p.devices,
            "jax": p.jax,
            "jaxlib": p.jaxlib,
            "instructions": list(self.instructions),
            "live": {k: list(v) for k, v in self.live.items()},
            "peak": self.peak,
            "position": self.position,
            "peak_instruction": self.peak_instruction,
            "total": self.total,
            "bytes": self.report.to_json()["bytes"],
            "allocated": dict(self.allocated),
            "idle": self.idle,
            "unassigned": self.unassigned,
            "constants": self.constants,
            "thread_local": self.thread_local,
            "elsewhere": self.elsewhere,
            "unranged": [dataclasses.asdict(b) for b in self.unranged],
            "at_peak": [dataclasses.asdict(b) for b in self.at_peak],
        }

    def to_record(self) -> dict[str, Any]:
        """Everything, the report and its buffers included, as JSON-able data (`from_record`):
        what a cache stores, or a child process hands back."""
        return {
            "report": self.report.to_record(),
            "instructions": list(self.instructions),
            "live": {k: list(v) for k, v in self.live.items()},
            "peak": self.peak,
            "position": self.position,
            "at_peak": [dataclasses.asdict(b) for b in self.at_peak],
            "allocated": dict(self.allocated),
            "constants": self.constants,
            "thread_local": self.thread_local,
            "elsewhere": self.elsewhere,
            "unranged": [dataclasses.asdict(b) for b in self.unranged],
            "peak_instruction": self.peak_instruction,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Timeline:
        """The timeline `to_record` wrote."""
        return cls(
            report=MemoryReport.from_record(record["report"]),
            instructions=tuple(record["instructions"]),
            live={k: tuple(v) for k, v in record["live"].items()},
            peak=int(record["peak"]),
            position=int(record["position"]),
            at_peak=tuple(Buffer(**b) for b in record["at_peak"]),
            allocated=dict(record["allocated"]),
            constants=int(record.get("constants", 0)),
            thread_local=int(record.get("thread_local", 0)),
            elsewhere=int(record.get("elsewhere", 0)),
            unranged=tuple(Buffer(**b) for b in record.get("unranged", ())),
            peak_instruction=str(record.get("peak_instruction", "")),
        )


def timeline(
    fn: Callable[..., Any] | MemoryReport,
    *args: Any,
    target: str | _targets.Target | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    name: str | None = None,
) -> Timeline:
    """Compile `fn` for `args` and read the bytes live at each point of its schedule.

    Args:
        fn: what `runbook.diagnose` takes: a function, a `jax.jit` / `jax.pmap` object,
            an `equinox.filter_jit` function or a module called as one. Or a
            `MemoryReport` that `runbook.measure` returned in this process, alone: its
            program, arguments, target and options (compiled again, as below, so its total
            can differ from the report's where XLA:CPU's YNNPACK fusion ran).
        *args: concrete arrays or `jax.ShapeDtypeStruct`s (nothing is allocated).
        target: compile for this device (a name from `runbook.targets()`) instead of this
            process's backend.
        compiler_options: XLA options for the compilation. On CPU, XLA:CPU's YNNPACK
            fusion is off unless given (its kernels' memory is not in the buffer
            assignment), as for `runbook.diagnose`.
        name: a label for the program (default: the function's name).

    Returns:
        The `Timeline`: to print, to show as a table or a chart, or to turn into JSON.

    A program the target's compiler refuses as too large for one device is drawn from the
    buffer assignment it wrote before refusing (its report's caveat says so): where an
    out-of-memory error comes from.

    Raises:
        DoesNotFitError: the target's compiler refused the program as too large and wrote
            no buffer assignment first.
        RunbookError: the compiler wrote no buffer assignment or no live ranges.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def f(x):
        ...     return jnp.cos(jnp.sin(x))
        >>> t = timeline(f, jax.ShapeDtypeStruct((1024,), jnp.float32))
        >>> t.peak == t.total == 2 * 4096  # x, and cos(sin(x)) (one fused kernel)
        True
    """
    if isinstance(fn, MemoryReport):
        origin = getattr(fn, "_origin", None)
        if origin is None or args:
            raise RunbookError(
                f"report {fn.name!r} does not know its program (only a report "
                "runbook.measure returned in this process does, passed alone): call "
                "runbook.timeline(fn, *args) instead"
            )
        measured, args, target, options = origin
        return timeline(measured, *args, target=target, compiler_options=options, name=fn.name)
    t = _targets.resolve(target)
    program = Program.compile(
        fn,
        *args,
        target=t,
        compiler_options=compiler_options,
        name=name,
        measure_fixes=False,
        keep_refused=True,
    )
    return of_program(program)


def timeline_locator(
    locator: str, args_locator: str | None = None, *, target: str | None = None
) -> Timeline:
    """`timeline` for a locator ``file.py:function``, its arguments from the locator
    ``file.py:make_args`` (see `runbook._locator.call_located`): the command line's
    ``python -m runbook timeline``."""
    return call_located(
        locator,
        args_locator,
        lambda fn, args, name: timeline(fn, *args, target=target, name=name),
    )


def write_png(found: Timeline, path: str) -> None:
    """`found`'s chart (`Timeline.plot`) written to the PNG file `path`, without pyplot."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 3.6))
    found.plot(ax=figure.subplots())
    figure.savefig(path, dpi=120)


@dataclasses.dataclass
class _Piece:
    """One piece of memory: the values at one allocation and offset, over time."""

    kind: str
    values: list[tuple[Value, int, int]]  # (value, first, last position)

    def segments(self) -> list[tuple[int, int, int]]:
        """(first, last, bytes): where the piece is live, with the largest of the values
        live there (values at one offset at one time share their memory)."""
        cuts = sorted({a for _, a, _ in self.values} | {b + 1 for _, _, b in self.values})
        starts = sorted(((a, b, v.size) for v, a, b in self.values), reverse=True)
        live: list[tuple[int, int]] = []  # a heap of (-size, last position)
        found: list[tuple[int, int, int]] = []
        for a, end in itertools.pairwise(cuts):
            while starts and starts[-1][0] <= a:
                _, b, size = starts.pop()
                heapq.heappush(live, (-size, b))
            while live and live[0][1] < a:
                heapq.heappop(live)
            size = -live[0][0] if live else 0
            if not size:
                continue
            if found and found[-1][1] == a - 1 and found[-1][2] == size:
                found[-1] = (found[-1][0], end - 1, size)
            else:
                found.append((a, end - 1, size))
        return found

    def at(self, position: int) -> Value | None:
        """The value live at `position` that stands for the piece: the largest, an
        instruction's own result before a value a loop carries."""
        live = [v for v, a, b in self.values if a <= position <= b]
        return min(live, key=lambda v: (-v.size, v.phi)) if live else None


def of_program(program: Program) -> Timeline:
    """The `Timeline` of a compiled `Program` (see `timeline`)."""
    n = len(program.schedule)
    if n == 0:
        where = program.target.name if program.target else program.report.provenance.backend
        raise RunbookError(
            f"the {where} compiler wrote no live ranges for `{program.report.name}`: a "
            "timeline needs the live-range dump XLA writes beside its buffer assignment."
        )
    pieces: dict[tuple[int, int], _Piece] = {}
    unranged: list[Value] = []
    for v in [*program.values, *program.phis]:
        if v.space != 0 or v.kind not in KINDS:
            continue
        found = program.live.get((v.instruction, v.index))
        if found is None:
            if not v.phi:
                unranged.append(v)
            continue
        first, last = found[0], min(found[1], n - 1)
        piece = pieces.setdefault((v.allocation, v.offset), _Piece(v.kind, []))
        piece.values.append((v, first, last))
    steps = {k: [0] * (n + 1) for k in KINDS}
    for piece in pieces.values():
        for a, b, size in piece.segments():
            steps[piece.kind][a] += size
            steps[piece.kind][b + 1] -= size
    live = {k: tuple(itertools.accumulate(steps[k][:n])) for k in KINDS}
    totals = [sum(live[k][i] for k in KINDS) for i in range(n)]
    peak = max(totals)
    position = totals.index(peak)
    at_peak = [_evidence(program, w) for p in pieces.values() if (w := p.at(position)) is not None]
    at_peak.sort(key=lambda b: -b.size)
    sizes = program.report.allocations  # bytes by kind, "(memory space N)" apart
    allocated = {k: sizes.get(k, 0) for k in KINDS}
    inst = program.module.get(program.schedule[position])
    made = ""
    if inst is not None:
        op, source = program.module.describe(inst, past_calls=True)
        made = f"{inst.name} ({inst.opcode})" + "".join(f", {x}" for x in (op, source) if x)
    return Timeline(
        report=program.report,
        instructions=tuple(program.schedule),
        live=live,
        peak=peak,
        position=position,
        at_peak=tuple(at_peak),
        allocated=allocated,
        constants=sizes.get("constant", 0),
        thread_local=sizes.get("thread-local", 0),
        elsewhere=sum(v for k, v in sizes.items() if "memory space" in k),
        unranged=tuple(_evidence(program, v) for v in unranged),
        peak_instruction=made or program.schedule[position],
    )


def _evidence(program: Program, value: Value) -> Buffer:
    """`value` as evidence: its size, shape, kind and what made it."""
    shape = "tuple" if value.shape.startswith("(") else value.shape  # a table of pointers
    inst = program.module.get(value.instruction)
    if inst is None:
        return Buffer(value.size, shape, value.kind, value.instruction, "", "")
    found = program.buffer(inst, value)
    name = value.instruction + (value.index if value.index != "{}" else "")
    return dataclasses.replace(found, shape=shape, instruction=f"{name} ({inst.opcode})")
