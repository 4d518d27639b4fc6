"""Compile-time memory of a JAX function, measured without allocating its inputs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import pathlib
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from . import _cache, _targets
from ._buffers import Buffer, allocation_sizes
from ._errors import DoesNotFitError, RunbookError
from ._hlo import read_dump
from ._inputs import as_jax, quiet_donation, staged
from ._provenance import Provenance
from ._quiet import start_backend

KINDS = ("argument", "output", "temp", "alias")  # memory_analysis()'s *_size_in_bytes


def analysis_bytes(stats: Any, space: str = "") -> dict[str, int]:
    """A ``memory_analysis()``'s bytes by kind, of the device (`space` ""), or of host memory
    (``"host_"``: its ``host_*_size_in_bytes``, 0 where a jaxlib reports none)."""
    return {k: int(getattr(stats, f"{space}{k}_size_in_bytes", 0) or 0) for k in KINDS}


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What XLA's buffer assignment says one compiled program needs, per device.

    ``total`` is argument + output + temp - alias: the bytes live at the program's peak.
    ``lower_bound`` is what must exist anyway (the arguments and the outputs; donated
    buffers that the output reuses counted once), unless a case supplies an analytic floor.
    ``figures`` holds what a case measures beyond the compiler's figures, by name (e.g. a
    real run's host resident set): bytes, or seconds for names ending in ``_seconds`` and
    a count for names ending in ``_count``; empty for most programs. ``host`` holds what the
    program keeps in host memory (offloaded values, ``pinned_host`` inputs), by the same
    kinds (argument, output, temp, alias), where a compiler keeps any apart from the device's:
    empty for most programs, and always on CPU, whose one memory is both.
    """

    name: str
    argument: int
    output: int
    temp: int
    alias: int
    provenance: Provenance
    role: str = ""
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    floor: int | None = None
    compile_seconds: float = 0.0
    buffers: tuple[Buffer, ...] = ()
    caveats: tuple[str, ...] = ()
    allocations: Mapping[str, int] = dataclasses.field(default_factory=dict)
    figures: Mapping[str, float] = dataclasses.field(default_factory=dict)
    host: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    @property
    def host_total(self) -> int:
        """Bytes in host memory at the program's peak: argument + output + temp - alias."""
        h = self.host
        return h.get("argument", 0) + h.get("output", 0) + h.get("temp", 0) - h.get("alias", 0)

    @property
    def lower_bound(self) -> int:
        if self.floor is not None:
            return self.floor
        return self.argument + self.output - self.alias

    @property
    def overhead(self) -> float:
        """total / lower bound: 1.0 means nothing beyond what must exist."""
        return self.total / self.lower_bound if self.lower_bound else float("inf")

    @classmethod
    def from_stats(cls, stats: Any, **fields: Any) -> MemoryReport:
        """The report of a compiled program's ``memory_analysis()``, with `fields` (name,
        provenance and the rest): the device's bytes, and the host's where it has any."""
        device, host = analysis_bytes(stats), analysis_bytes(stats, "host_")
        return cls(
            argument=device["argument"],
            output=device["output"],
            temp=device["temp"],
            alias=device["alias"],
            host=host if any(host.values()) else {},
            **fields,
        )

    def to_record(self) -> dict[str, Any]:
        """Everything, buffers and provenance included, as JSON-able data (`from_record`)."""
        record = dataclasses.asdict(self)
        record["params"] = dict(self.params)
        record["allocations"] = dict(self.allocations)
        record["figures"] = dict(self.figures)
        record["host"] = dict(self.host)
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> MemoryReport:
        """The report `to_record` wrote."""
        fields = dict(record)
        fields["provenance"] = Provenance(**fields["provenance"])
        fields["buffers"] = tuple(Buffer(**b) for b in fields.get("buffers", ()))
        fields["caveats"] = tuple(fields.get("caveats", ()))
        fields["allocations"] = dict(fields.get("allocations", {}))
        fields["figures"] = dict(fields.get("figures", {}))
        fields["host"] = dict(fields.get("host", {}))
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        """The CLI's per-variant object: bytes as integers."""
        return {
            "name": self.name,
            "role": self.role,
            "params": dict(self.params),
            "devices": self.provenance.devices,
            "bytes": {
                "argument": self.argument,
                "output": self.output,
                "temp": self.temp,
                "alias": self.alias,
                "total": self.total,
            },
            "lower_bound": self.lower_bound,
            "overhead": round(self.overhead, 6),
            "compile_seconds": round(self.compile_seconds, 3),
            **({"caveats": list(self.caveats)} if self.caveats else {}),
            **({"figures": dict(self.figures)} if self.figures else {}),
            **({"host_bytes": {**self.host, "total": self.host_total}} if self.host else {}),
        }


def _is_pmap(fn: Any) -> bool:
    # jax.pmap gives a plain function with a `lower` attribute (a PmapFunction before 0.8).
    return hasattr(fn, "lower") and (inspect.isfunction(fn) or type(fn).__name__ == "PmapFunction")


def _lowerable(fn: Callable[..., Any]) -> Any:
    # jax.jit / jax.pmap objects lower themselves; plain functions get a jit.
    return fn if staged(fn) else jax.jit(fn)


def _first_line(error: Exception, limit: int = 200) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


# JAX's warning when a donated input matches no output (jax-ml/jax#1273, #9237).
UNUSABLE = "Some donated buffers were not usable"
_lowering = threading.Lock()  # warnings.catch_warnings is process-wide: one lowering at a time


@contextlib.contextmanager
def _collect_unusable(unusable: list[str] | None) -> Iterator[None]:
    """Inside, JAX's "not usable" donation warnings go to `unusable` instead of the terminal
    (their first line each); other warnings pass. A no-op when `unusable` is None."""
    if unusable is None:
        yield
        return
    with _lowering, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        text = str(w.message)
        if text.startswith(UNUSABLE):
            unusable.append(text.splitlines()[0])
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def compile_fn(
    fn: Callable[..., Any],
    *args: Any,
    compiler_options: Mapping[str, Any] | None = None,
    target: str | _targets.Target | None = None,
    unusable: list[str] | None = None,
) -> Any:
    """Lower and compile `fn` for `args` (arrays or `jax.ShapeDtypeStruct`s).

    With `target` (see `runbook.targets()`), compile with that device's compiler: the inputs
    are placed on its compile-only devices, and a program too large for one device raises
    `DoesNotFitError` with the compiler's figures. With `unusable`, JAX's warnings that
    donated buffers were not usable are appended to it instead of being shown.
    """
    t = _targets.resolve(target)
    lowered = lower_fn(fn, *args, target=t, unusable=unusable)
    return compile_lowered(lowered, name=_name(fn), compiler_options=compiler_options, target=t)


def _name(fn: Any) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


# What JAX says when a jit's shardings name devices other than its arguments'.
_WRONG_DEVICES = re.compile(r"incompatible devices|does not match memory kind")
# Inputs given no sharding are put on the target's first device; a jit whose in_shardings place
# them over a mesh then says so, and the inputs are passed on unplaced.
_JIT_PLACES = re.compile(
    r"Sharding passed to jit does not match the sharding on the respective arg"
)


def lower_fn(
    fn: Callable[..., Any],
    *args: Any,
    target: _targets.Target | None = None,
    unusable: list[str] | None = None,
) -> Any:
    """Trace and lower `fn` for `args`, on `target`'s compile-only devices if given."""
    name = _name(fn)
    if unusable is None and quiet_donation(fn):
        unusable = []  # collected, and so not shown
    fn, args = as_jax(fn, args)  # modules, filter_jit functions, non-array leaves
    if target is not None:
        with _targets.compiling_for(target):
            placed = _targets.place(args, target, unsharded=not _is_pmap(fn))
            try:
                try:
                    return lower_fn(fn, *placed, unusable=unusable)
                except RunbookError as e:  # a jit's own in_shardings place unsharded inputs
                    if not _JIT_PLACES.search(str(e.__cause__)):
                        raise
                    placed = _targets.place(args, target, unsharded=False)
                    return lower_fn(fn, *placed, unusable=unusable)
            except RunbookError as e:  # a mesh or sharding built on this process's devices
                if not _WRONG_DEVICES.search(str(e.__cause__)):
                    raise
                raise RunbookError(
                    f"`{name}` is built on this process's devices, not on target {target.name!r}: "
                    f"build its mesh and shardings on {_targets.mesh_hint(target)}"
                ) from e.__cause__
    lowerable = _lowerable(fn)
    start_backend()
    try:
        with _collect_unusable(unusable):
            return lowerable.lower(*args)
    except jax.errors.ConcretizationTypeError as e:  # also covers bool() of a tracer
        raise RunbookError(
            f"could not trace `{name}`: {_first_line(e)}. Likely cause: Python control flow "
            "or a NumPy call on a traced value; use lax.cond/lax.fori_loop or mark the "
            "argument static."
        ) from e
    except (TypeError, ValueError) as e:  # shape and type errors found while tracing
        raise RunbookError(f"could not trace `{name}`: {_first_line(e, 300)}") from e


def compile_lowered(
    lowered: Any,
    *,
    name: str,
    compiler_options: Mapping[str, Any] | None = None,
    target: _targets.Target | None = None,
) -> Any:
    """Compile what `lower_fn` lowered (for the same `target`); `name` labels errors."""
    if target is not None:
        t = target
        with _targets.compiling_for(t):
            options = {**_targets.compiler_options(t), **(compiler_options or {})}
            compiled = compile_lowered(lowered, name=name, compiler_options=options)
        platforms = {d.platform for d in _devices(compiled)}
        if platforms - set(
            t.device_platforms
        ):  # e.g. a jax.pmap built without the target's devices
            raise RunbookError(
                f"`{name}` compiled for {', '.join(sorted(platforms))}, "
                f"not for target {t.name!r}: build its mesh and shardings on "
                f"{_targets.mesh_hint(t)}"
            )
        return compiled
    try:
        return lowered.compile(dict(compiler_options or {}))
    except Exception as e:  # XLA reports bad options and failed compiles as plain errors
        found = _targets.oom_figures(str(e))
        if found is not None:
            needed, limit, what = found
            raise DoesNotFitError(
                f"`{name}` does not fit one device: the compiler needs {needed:,} bytes of "
                f"{what}, the device allows {limit:,}",
                needed=needed,
                limit=limit,
                what=what,
            ) from e
        raise RunbookError(f"XLA could not compile `{name}`: {_first_line(e, 300)}") from e


def _devices(compiled: Any) -> set[Any]:
    """The devices the compiled program's inputs live on."""
    try:
        shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    except Exception:  # noqa: BLE001 - older releases keep no input shardings
        return set()
    return {d for s in shardings for d in s.device_set}


def _devices_used(compiled: Any) -> int:
    """How many devices the compiled program runs on."""
    return max(len(_devices(compiled)), 1)


def measure(
    fn: Callable[..., Any],
    *args: Any,
    name: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    buffers: bool = False,
    target: str | _targets.Target | None = None,
) -> MemoryReport:
    """Compile `fn` for `args` and report its memory, allocating nothing.

    Args:
        fn: a function, a `jax.jit`/`jax.pmap` object, an `equinox.filter_jit` function,
            or a module called as one (equinox, flax NNX): its weights are inputs.
        *args: concrete arrays or `jax.ShapeDtypeStruct`s, in any pytrees (modules too);
            leaves that are not arrays (functions, strings, flags) are static.
        name: label for tables; defaults to the function's name.
        compiler_options: XLA options for this compilation only, e.g.
            ``{"xla_cpu_experimental_ynn_fusion_type": ""}``.
        buffers: also read back the buffer assignment, to list the largest buffers.
        target: compile for this device instead of this process's backend (a name from
            `runbook.targets()`, e.g. ``"h100"`` or ``"v5e"``): a compile-time prediction
            for a device this machine need not have. A slice (``"v5e-16"``, ``"h100x8"``)
            takes inputs sharded over `runbook.slice_mesh`, or over a mesh of as many of
            this process's devices; the report is per device (`runbook.fit` says whether
            it fits).

    Returns:
        A `MemoryReport` with bytes per device. JAX's warnings that donated buffers were not
        usable are recorded as its caveats instead of being shown.

    Raises:
        DoesNotFitError: the target's compiler refused the program as too large for one
            device; the error carries the bytes it needs and the device's limit.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
        >>> report = measure(lambda a: jnp.sin(a) @ a, x)
        >>> report.argument, report.output
        (4194304, 4194304)
        >>> report.lower_bound
        8388608
    """
    options = dict(compiler_options or {})
    unusable: list[str] = []
    t = _targets.resolve(target)
    lowered = lower_fn(fn, *args, target=t, unusable=unusable)
    label = name or _name(fn)
    compute = functools.partial(
        _measure_lowered, lowered, label, options, buffers, t, tuple(unusable)
    )
    if _cache.directory() is None:
        return _known(compute(), fn, args, t, options)
    # Keyed by the program itself (its lowered text, source locations included): the same
    # program measured again, by another page or after an unrelated edit, is not recompiled.
    request = {
        "kind": "program", "program": program_hash(lowered), "name": label, "options": options,
        "buffers": buffers, "target": t.name if t else None, "unusable": unusable,
    }  # fmt: skip
    report = MemoryReport.from_record(_cache.cached(request, lambda: compute().to_record()))
    return _known(report, fn, args, t, options)


def _known(
    report: MemoryReport,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    target: _targets.Target | None,
    options: dict[str, Any],
) -> MemoryReport:
    """`report`, knowing the program it measured (for `runbook.timeline(report)`; not a
    field: records and comparisons leave it out)."""
    object.__setattr__(report, "_origin", (fn, args, target, options))
    return report


def program_hash(lowered: Any) -> str:
    """A hash of a lowered program's text, with its source locations where JAX gives them."""
    try:
        text = lowered.as_text(debug_info=True)
    except TypeError:  # releases before debug_info was an option
        text = lowered.as_text()
    return hashlib.sha256(portable(text).encode()).hexdigest()


# Where this checkout, Python's library (installed packages included, in a virtual
# environment inside the checkout too, as nox makes them) and a notebook's cells (a folder
# per kernel process) lie on this machine.
_CHECKOUT = str(_cache.PACKAGE.parent) + "/"
_LIBRARY = re.compile(r'"/[^"]*?/(lib/python3\.\d+/)')
_CELLS = re.compile(r'"/[^"]*?/ipykernel_\d+/')
# A location alias's definition; a call site of one alias at another (callee first); a use.
_ALIAS = re.compile(r"^(#loc\d*) = loc\((.*)\)$")
_CALLSITE = re.compile(r"callsite\((#loc\d*) at #loc\d*\)")
_REFERENCE = re.compile(r"#loc\d*\b")
# The line and column of a frame in Python's standard library or in the notebook kernel that
# runs a page's cells: the call stack under a cell's code, which differs by Python and
# kernel release and is never the program's.
_CALLER = re.compile(
    r'("lib/python3\.\d+/(?:site-packages/(?:IPython|ipykernel|tornado|traitlets)/'
    r'|site-packages/ipykernel_launcher\.py|(?!site-packages/))[^"]*")'
    r":\d+:\d+(?: to (?:\d+)?:\d+)?"
)


def portable(text: str) -> str:
    """`text` with each operation's location cut to its innermost frame, and absolute source
    paths made relative, to Python's library, to this checkout or to a notebook kernel's
    cells: the same program hashes alike in every process on every machine, so that a
    program compiled for a target is measured once for all of them (`runbook._cache`'s
    store).

    The frames that called the traced code (a page's cell, the kernel under it, whichever
    function of the package traced the program first) differ between builds and never
    change the compiled program; the innermost frame is the line that made each operation.
    """
    text = _innermost(text)
    text = _LIBRARY.sub(r'"\1', text).replace('"' + _CHECKOUT, '"')
    return _CALLER.sub(r"\1", _CELLS.sub('"ipykernel/', text))


def _innermost(text: str) -> str:
    """Lowered text with its location aliases (``#loc12 = loc(...)``) resolved and inlined,
    every call site cut to its callee: what is left does not depend on the callers."""
    aliases: dict[str, str] = {}
    body = []
    for line in text.splitlines():
        found = _ALIAS.match(line)
        if found:
            aliases[found[1]] = _CALLSITE.sub(r"\1", found[2])
        else:
            body.append(line)
    resolved: dict[str, str] = {}

    def resolve(name: str) -> str:
        if name not in resolved:
            resolved[name] = name  # a cycle, never printed by MLIR, stays a name
            definition = aliases.get(name)
            if definition is not None:
                resolved[name] = _REFERENCE.sub(lambda m: resolve(m[0]), definition)
        return resolved[name]

    return "\n".join(_REFERENCE.sub(lambda m: resolve(m[0]), line) for line in body)


def _measure_lowered(
    lowered: Any,
    name: str,
    options: dict[str, Any],
    buffers: bool,
    target: _targets.Target | None,
    unusable: tuple[str, ...],
) -> MemoryReport:
    with tempfile.TemporaryDirectory(prefix="runbook-dump-") as dump:
        if buffers:
            options = {**options, "xla_dump_to": dump}
        start = time.perf_counter()
        compiled = compile_lowered(lowered, name=name, compiler_options=options, target=target)
        seconds = time.perf_counter() - start
        stats = compiled.memory_analysis()
        read = read_dump(pathlib.Path(dump)) if buffers else None
        found = tuple(read.buffers()) if read is not None else ()
        sizes = allocation_sizes(pathlib.Path(dump)) if buffers else {}
    if stats is None:
        where = target.name if target else jax.default_backend()
        raise RunbookError(f"the {where} compiler reports no memory analysis.")
    if target:
        provenance = Provenance.for_target(target, _devices_used(compiled))
    else:  # the devices this program runs on (a process may have more), where JAX says
        here = Provenance.current()
        provenance = dataclasses.replace(here, devices=len(_devices(compiled)) or here.devices)
    caveats = (
        _target_caveats(stats, target) if target else _backend_caveats(compiled, options)
    ) + tuple(f"JAX warned: {text}" for text in unusable)
    return MemoryReport.from_stats(
        stats,
        name=name,
        provenance=provenance,
        compile_seconds=seconds,
        buffers=found,
        caveats=caveats,
        allocations=sizes,
    )


# XLA:CPU (jaxlib 0.10 and newer) can fuse matrix products and their consumers into YNNPACK
# kernels; a fused kernel's working memory is not in the buffer assignment. A real run tells
# whether it was needed: on the pmap-loop and guide pages it was, for gather-grad it was not.
YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"


# XLA's TPU compiler (libtpu 0.0.50, jax 0.12) can report temporaries of 0 bytes while its
# own peak, and its peak heap, count megabytes past the arguments and outputs: a scan's
# residual stacks, for one. Its GPU compiler's peak equals the sum (the measuring page).
TPU_PEAK = (
    "XLA's TPU compiler counts more in its own peak (peak_memory_in_bytes) than in the "
    "temporaries it reports: on this target the sum can fall short of what the program "
    'needs (the measuring page\'s "Which memory number to trust").'
)


def _target_caveats(stats: Any, target: _targets.Target) -> tuple[str, ...]:
    """What a target compiler's accounting leaves out of the figures, in words."""
    peak = getattr(stats, "peak_memory_in_bytes", None)
    # XLA's peak counts what a program holds in host memory (offloading) too.
    counted = sum(
        b["argument"] + b["output"] + b["temp"] - b["alias"]
        for b in (analysis_bytes(stats), analysis_bytes(stats, "host_"))
    )
    if target.platform == "tpu" and peak is not None and peak_exceeds(peak, counted):
        return (TPU_PEAK,)
    return ()


def peak_exceeds(peak: int, total: int) -> bool:
    """Whether XLA's `peak` passes the runbook's `total` by more than 1% and 1 MiB."""
    return peak > 1.01 * total + 2**20


def _backend_caveats(compiled: Any, options: Mapping[str, Any]) -> tuple[str, ...]:
    """What this backend's accounting may leave out of the figures, in words."""
    if jax.default_backend() != "cpu" or options.get(YNN_OPTION) == "":
        return ()
    fused = (compiled.as_text() or "").count("__ynn_fusion")
    if not fused:
        return ()
    caveat = (
        f"XLA:CPU fused {fused} operation group(s) into YNNPACK kernels, whose working memory "
        "its buffer assignment does not count: the real peak may be higher. A real run says "
        "(runbook.runtime_peak). Compiling with "
        f"compiler_options={{{YNN_OPTION!r}: ''}} counts that memory but builds another "
        "program; the measuring page compares both figures with real peaks."
    )
    return (caveat,)


def largest_buffers(
    report: MemoryReport, count: int = 5, *, kind: str | None = None
) -> list[Buffer]:
    """The `count` largest buffers of a report made with ``buffers=True``.

    Args:
        report: from `measure(..., buffers=True)`.
        count: how many to return.
        kind: only buffers of this kind ("argument", "output", "temp", ...).
    """
    if not report.buffers:
        raise RunbookError(
            f"`report` {report.name!r} has no buffers: measure it with `buffers=True`."
        )
    chosen = [b for b in report.buffers if kind is None or b.kind == kind]
    return chosen[:count]


def xla_usage_report_total(
    fn: Callable[..., Any], *args: Any, compiler_options: Mapping[str, Any] | None = None
) -> int | None:
    """The "Total bytes" line of XLA's own memory-usage report for the compiled program.

    An independent reading of the same buffer assignment (the one jax-ml/jax#30015 quotes);
    None when this backend or release writes no such report.
    """
    with tempfile.TemporaryDirectory(prefix="runbook-dump-") as dump:
        compile_fn(fn, *args, compiler_options={**(compiler_options or {}), "xla_dump_to": dump})
        reports = sorted(pathlib.Path(dump).glob("*memory-usage-report.txt"))
        if not reports:
            return None
        first = max(reports, key=lambda p: p.stat().st_size).read_text().splitlines()
    for line in first:
        if line.startswith("Total bytes:"):
            return int(line.split()[2])
    return None
