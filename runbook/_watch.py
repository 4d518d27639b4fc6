"""`runbook.watch`: watch your own loop step by step, and name what grows, and why.

`runbook.diagnose` reads one compiled program. Three problems never show there: live
memory that grows across the steps of a loop, a function compiled again and again, and a
compilation that itself takes seconds and host memory. `watch` records, at each
`Watch.step()`:

- the live `jax.Array`s: their bytes per device and, grouped by shape and dtype, which
  ones accumulate (and what holds them: `gc.get_referrers` and the variables of the frames
  around the loop); the device allocator's bytes in use where JAX reports them;
- every compilation: JAX's own log of it (``jax_log_compiles``: the function, its argument
  types, XLA's seconds) and of why the cache missed (``jax_explain_cache_misses``), how
  much the host's peak resident set rose meanwhile, and the evidence of constant folding:
  the bytes of constants in the program XLA compiled, and XLA's slow-folding alarms;
- the host's resident set.

The rules of `runbook._watch_rules` turn that record into `Finding`s, the type
`runbook.diagnose` returns, each naming a case and its fix.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import html
import logging
import os
import re
import sys
import threading
import time
import weakref
from typing import Any, Self

import jax

from . import _watch_rules
from ._errors import RunbookError
from ._hlo import Shape
from ._locator import one_line
from ._program import Finding
from ._quiet import WARNING, warnings_in
from ._render import Table, fmt_bytes
from ._watch_holders import frame_value, holder
from ._watch_rules import Compile, Growth, StepRecord, Thresholds

__all__ = ["Compile", "Growth", "StepRecord", "Thresholds", "Watch", "watch"]

_FLAGS = ("jax_log_compiles", "jax_explain_cache_misses")
_COMPILING = re.compile(
    r"^Compiling (.+?) with global shapes and types (.*?)\. Argument mapping", re.DOTALL
)
_FINISHED = re.compile(r"^Finished XLA compilation of (.+?) in ([0-9.eE+-]+) sec")
_LOWERED = re.compile(r"^Finished jaxpr to MLIR module conversion (.+?) in [0-9.eE+-]+ sec")
_CONSTANT = re.compile(r"= (\S+) constant\(")  # an HLO constant's shape, e.g. f32[2048,4096]{1,0}
_MISS = re.compile(
    r"^TRACING CACHE MISS at (.+?)(?: costing [^\n]*?)?(?: because)?:\n(.*)", re.DOTALL
)
_MISS_FN = re.compile(r"(?:for (\S+) defined at|never seen function:\s*\n\s*(\S+) id=)")
_STATIC = re.compile(
    r"at input path (\S+), now .*?Static\(val=(.*?)\) and before .*?Static\(val=(.*?)\)"
)
_TYPE = re.compile(r"ShapedArray\(([^)]*)\)")
_CHATTER = ("Finished tracing", "Finished jaxpr to MLIR", "Finished XLA compilation", "Compiling ")

_ACTIVE: Watch | None = None


def _short(name: str) -> str:
    """``jit(f)`` and ``f`` name the same function (old releases log the bare name)."""
    m = re.fullmatch(r"jit\((.*)\)", name)
    return m.group(1) if m else name


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _shape(key: tuple[tuple[int, ...], Any]) -> str:
    """``float32[512,256]`` for a group's key (shape, dtype)."""
    shape, dtype = key
    return f"{dtype}[{','.join(map(str, shape))}]"


def _shard_bytes(a: Any) -> int:
    size = int(a.dtype.itemsize)
    for n in a.sharding.shard_shape(a.shape):
        size *= n
    return size


def _program_constants() -> int | None:
    """Bytes of the constants in the program XLA has just compiled (its optimised HLO: what
    XLA folded, and arrays the function closes over), or None where the watch cannot reach
    the program. Called under JAX's "Finished XLA compilation" record: the executable is
    then a local of JAX's compile function on the stack."""
    f: Any = sys._getframe(1)
    exe = None
    for _ in range(32):
        if f is None:
            break
        if str(f.f_globals.get("__name__", "")).startswith("jax"):
            exe = frame_value(f, lambda v: hasattr(type(v), "hlo_modules"))
            if exe is not None:
                break
        f = f.f_back
    del f
    if exe is None:
        return None
    total = 0
    try:
        for module in exe.hlo_modules():  # type: ignore[attr-defined]
            for shape in _CONSTANT.findall(module.to_string()):
                total += Shape(shape).nbytes
        return total
    except Exception:  # noqa: BLE001 - a release whose executables print no HLO
        return None


def _flush_stderr() -> None:
    with contextlib.suppress(Exception):
        if sys.stderr is not None:
            sys.stderr.flush()


class _XlaLog:
    """XLA's C++ log while XLA compiles, read on its way to the terminal.

    XLA logs below Python, to the process's file descriptor 2; its slow-folding alarm
    ("Constant folding an instruction is taking > 1s", `runbook._quiet.WARNING`) is
    evidence that a slow compilation folds constants. While a compilation runs (from JAX's
    "Finished jaxpr to MLIR" record to its "Finished XLA compilation" record)
    the descriptor goes into a pipe, and a thread writes every byte on to where it went
    before as it comes, nothing held back, counting the alarms on the way. Compilations in
    several threads share one pipe.
    """

    def __init__(self) -> None:
        self.alarms = 0
        self.failed = ""
        self._lock = threading.Lock()
        self._users = 0
        self._saved = -1
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Read the log (until `stop`); False where descriptor 2 cannot be redirected."""
        with self._lock:
            if self._users == 0:
                if self.failed:
                    return False
                try:
                    self._open()
                except OSError as e:
                    self.failed = f"{type(e).__name__}: {e}"
                    return False
            self._users += 1
            return True

    def _open(self) -> None:
        _flush_stderr()
        r, w = os.pipe()
        try:
            saved = os.dup(2)
        except OSError:
            os.close(r)
            os.close(w)
            raise
        with contextlib.suppress(OSError, AttributeError, ImportError):
            import fcntl  # room for bursts of log (Linux); the thread empties it as it comes

            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 2**20)  # type: ignore[attr-defined,unused-ignore]
        thread = threading.Thread(
            target=self._copy, args=(r, saved), name="runbook-watch-xla-log", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as e:  # no thread to be had: leave descriptor 2 alone
            for fd in (r, w, saved):
                os.close(fd)
            raise OSError(str(e)) from None
        try:
            os.dup2(w, 2)
        finally:
            # descriptor 2 is now the pipe's only writer: restoring it ends the thread (which
            # closes `r` and `saved`); if dup2 failed, closing `w` ends it at once
            os.close(w)
        self._saved, self._thread = saved, thread

    def stop(self, everyone: bool = False) -> None:
        """One compilation's reading ends; the last (or `everyone`) puts descriptor 2 back
        and waits until the thread has written and read everything."""
        with self._lock:
            if self._users == 0:
                return
            self._users = 0 if everyone else self._users - 1
            if self._users:
                return
            _flush_stderr()
            with contextlib.suppress(OSError):  # else the thread goes on passing it on
                os.dup2(self._saved, 2)
            thread, self._thread, self._saved = self._thread, None, -1
        if thread is not None:
            thread.join(timeout=1.0)  # a child process that inherited the pipe keeps it open

    def _copy(self, r: int, out: int) -> None:
        tail = b""
        mark = WARNING.encode()
        try:
            while chunk := os.read(r, 2**16):
                with contextlib.suppress(OSError):  # stderr gone: keep emptying the pipe
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out, view) :]
                *lines, tail = (tail + chunk).split(b"\n")
                tail = tail[-(2**14) :]
                self._count(lines, mark)
            self._count([tail], mark)
        finally:
            os.close(r)
            os.close(out)

    def _count(self, lines: list[bytes], mark: bytes) -> None:
        found = [ln.decode(errors="replace") for ln in lines if mark in ln]
        if n := warnings_in("\n".join(found)):
            with self._lock:
                self.alarms += n


class _LogTap(logging.Filter):
    """On JAX's loggers while a watch runs: reads the compile log, and keeps it off the
    user's console unless the user had asked for it."""

    def __init__(self, watch: Watch, passthrough: set[str]) -> None:
        super().__init__()
        self.watch, self.passthrough = watch, passthrough

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge
            return True
        try:
            ours = self.watch._read_log(message)
        except Exception as e:  # noqa: BLE001 - the watch must not break the user's compile
            note = f"a record of JAX's compile log could not be read: {one_line(e)}"
            if note not in self.watch.caveats:
                self.watch.caveats.append(note)
            return True
        return ours is None or ours in self.passthrough


def _monitor(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if _ACTIVE is not None and event == "/jax/core/compile/backend_compile_duration":
        _ACTIVE._monitored += 1


_LISTENING = False


def _listen() -> None:
    """One `jax.monitoring` listener for the process (old releases cannot remove one)."""
    global _LISTENING
    if not _LISTENING:
        jax.monitoring.register_event_duration_secs_listener(_monitor)
        _LISTENING = True


class Watch:
    """The record of a loop watched by `runbook.watch`, and what it names.

    Use it as a context manager and call `step()` once at the end of each step. Printed
    (or shown in a notebook) it says what grew, what compiled, and the fixes.

    Attributes:
        thresholds: the `Thresholds` the rules compare with.
        records: one `StepRecord` per mark, the first (step 0) taken when the watch started.
        compiles: every `Compile` seen, in order.
        caveats: what could not be observed on this machine or release, and why.
        error: the one-line error that ended the watched block, or None.
    """

    def __init__(self, thresholds: Thresholds, *, holders: bool = True) -> None:
        self.thresholds = thresholds
        self.records: list[StepRecord] = []
        self.compiles: list[Compile] = []
        self.caveats: list[str] = []
        self.error: str | None = None
        self.seconds = 0.0
        self._holders = holders
        self._state = "new"
        self._monitored = 0
        self._t0 = self._last = 0.0
        self._base: dict[Any, tuple[int, int]] = {}
        self._base_ids: set[int] = set()
        self._groups: dict[Any, tuple[int, int]] = {}
        self._held: dict[Any, str] = {}
        self._pending: dict[str, dict[str, Any]] = {}
        self._explained: dict[str, tuple[str, str]] = {}
        self._last_types: dict[str, tuple[str, ...]] = {}
        self._flags: dict[str, Any] = {}
        self._taps: list[tuple[logging.Logger, _LogTap]] = []
        self._start_arrays: set[int] = set()
        self._candidates: dict[int, weakref.ref[Any]] = {}
        self._xla = _XlaLog()

    # -- the context -------------------------------------------------------------------------

    def __enter__(self) -> Self:
        global _ACTIVE
        if self._state != "new":
            raise RunbookError("this watch was already used: start a new runbook.watch()")
        if _ACTIVE is not None:
            raise RunbookError("another runbook.watch() is running: watches do not nest")
        _listen()
        for flag in _FLAGS:
            try:
                self._flags[flag] = bool(getattr(jax.config, flag))
                jax.config.update(flag, True)
            except (AttributeError, KeyError, ValueError):
                self.caveats.append(
                    f"JAX {jax.__version__} has no {flag} option: "
                    + (
                        "compilations are not seen"
                        if flag == "jax_log_compiles"
                        else "no explanation of why a function compiled again (argument types compared instead)"
                    )
                )
        passthrough = {flag for flag, was_on in self._flags.items() if was_on}
        names = [n for n in logging.Logger.manager.loggerDict if n == "jax" or n.startswith("jax.")]
        for name in names:
            logger = logging.getLogger(name)
            tap = _LogTap(self, passthrough)
            logger.addFilter(tap)
            self._taps.append((logger, tap))
        if _proc_status("VmRSS") is None:
            self.caveats.append("the host's resident set cannot be read here (no /proc)")
        if not any(self._in_use(d) is not None for d in jax.local_devices()):
            self.caveats.append(
                f"the {jax.default_backend()} devices report no allocator statistics: live "
                "bytes are those of the live jax.Arrays"
            )
        _ACTIVE = self
        self._state = "running"
        self._t0 = self._last = time.perf_counter()
        self._mark(0, first=True)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: object
    ) -> bool:
        self._stop()
        if isinstance(value, _Enough):
            return True
        if value is not None:
            self.error = one_line(value)
            return False
        if len(self.records) <= 1:
            if not self.compiles and not self._arrays_changed():
                raise RunbookError(
                    "nothing happened inside `with runbook.watch()`: no step, no "
                    "compilation, no array made"
                )
            raise RunbookError(
                "w.step() was never called: call it once at the end of each step of the loop "
                "inside `with runbook.watch() as w:`"
            )
        return False

    def _stop(self) -> None:
        global _ACTIVE
        if self._state != "running":
            return
        self.seconds = time.perf_counter() - self._t0
        for logger, tap in self._taps:
            logger.removeFilter(tap)
        self._taps.clear()
        for flag, old in self._flags.items():
            jax.config.update(flag, old)
        for pending in self._pending.values():  # a compile that never finished (it raised)
            self._finish(pending["function"], 0.0, pending)
        self._pending.clear()
        self._xla.stop(everyone=True)
        self._candidates.clear()
        if self._xla.failed:
            self.caveats.append(
                f"XLA's log (file descriptor 2) could not be read ({self._xla.failed}): its "
                "slow-folding alarms are not seen"
            )
        if self.compiles and all(c.constants is None for c in self.compiles):
            self.caveats.append(
                f"the programs XLA compiled could not be read on JAX {jax.__version__}: "
                "their constants are not seen"
            )
        if self._monitored > len(self.compiles):
            self.caveats.append(
                f"jax.monitoring counted {self._monitored} compilations, JAX's log "
                f"{len(self.compiles)} (is logging of JAX's warnings disabled?)"
            )
        _ACTIVE = None
        self._state = "done"

    def step(self) -> None:
        """Mark the end of one step: read the live arrays, the memory and the compiles."""
        if self._state != "running":
            raise RunbookError(
                "w.step() outside its watch: call it inside `with runbook.watch() as w:`"
            )
        self._mark(len(self.records))

    # -- recording ---------------------------------------------------------------------------

    @staticmethod
    def _in_use(d: Any) -> int | None:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            return None
        return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None

    def _mark(self, n: int, first: bool = False) -> None:
        now = time.perf_counter()
        arrays = [a for a in jax.live_arrays() if not a.is_deleted()]
        per_device: dict[Any, int] = collections.Counter()
        groups: dict[Any, list[int]] = {}
        for a in arrays:  # the cost of a mark: keep this loop lean
            g = groups.get(key := (a.shape, a.dtype))
            if g is None:
                g = groups[key] = [0, a.nbytes]  # how many; the bytes of one
            g[0] += 1
            devices = a.sharding.device_set
            if len(devices) == 1:
                for d in devices:
                    per_device[d] += g[1]
            else:
                shard = _shard_bytes(a)
                for d in devices:
                    per_device[d] += shard
        in_use = {str(d): u for d in jax.local_devices() if (u := self._in_use(d)) is not None}
        step_compiles = sum(c.step == n for c in self.compiles) if n else 0
        self.records.append(
            StepRecord(
                n,
                0.0 if first else now - self._last,
                {str(d): b for d, b in per_device.items()},
                len(arrays),
                in_use or None,
                _proc_status("VmRSS"),
                step_compiles,
            )
        )
        self._groups = {k: (count, count * one) for k, (count, one) in groups.items()}
        if first:
            self._start_arrays = {id(a) for a in arrays}
        if n == self.thresholds.warmup:
            self._base = dict(self._groups)
            self._base_ids = {id(a) for a in arrays}
        elif n > self.thresholds.warmup and self._holders:
            self._find_holders(arrays)
        del arrays
        self._last = time.perf_counter()

    def _arrays_changed(self) -> bool:
        return {id(a) for a in jax.live_arrays()} != self._start_arrays

    def _growing(self) -> list[tuple[Any, int, int]]:
        out = []
        for key, (count, size) in self._groups.items():
            c0, s0 = self._base.get(key, (0, 0))
            if count > c0:
                out.append((key, count - c0, size - s0))
        return sorted(out, key=lambda g: -g[2])

    def _find_holders(self, arrays: list[Any]) -> None:
        """What holds one array of each growing group (at most three groups, once): the
        oldest made after the warm-up that outlived a step, so not the step's fresh state.
        That it outlived a step is known from a weak reference taken at the previous mark,
        not from its id (ids of freed arrays are reused); nothing is kept alive."""
        growing = [key for key, _, _ in self._growing()[:3] if key not in self._held]
        candidates, self._candidates = self._candidates, {}
        for key in growing:
            old = None
            for a in reversed(arrays):  # jax.live_arrays() lists the newest first
                r = candidates.get(id(a))
                if r is not None and (a.shape, a.dtype) == key and r() is a:
                    old = a
                    break
            if old is not None:
                self._held[key] = holder(old, exclude={id(arrays)})
            del old
        del candidates
        wanted = {key for key in growing if key not in self._held}
        if wanted:
            self._candidates = {
                id(a): weakref.ref(a)
                for a in arrays
                if (a.shape, a.dtype) in wanted and id(a) not in self._base_ids
            }

    @property
    def growth(self) -> list[Growth]:
        """The arrays alive at the last step that were not at the end of the warm-up."""
        if not self._base:
            return []
        return [
            Growth(_shape(key), count, size, self._held.get(key, ""))
            for key, count, size in self._growing()
        ]

    # -- JAX's compile log ----------------------------------------------------------------------

    def _step_now(self) -> int:
        return len(self.records)

    def _read_log(self, message: str) -> str | None:
        """Read one of JAX's log messages; the option that made it, when it is one of the
        records the watch turned on (else None: not ours)."""
        if m := _MISS.match(message):
            body = m.group(2)
            fn = _MISS_FN.search(body)
            name = _short(next((g for g in fn.groups() if g), "")) if fn else ""
            why = _reasons(body)
            if "never seen function" in body:
                why = ["first call"]
            self._explained[name] = (m.group(1).strip(), " ".join(why))
            return "jax_explain_cache_misses"
        if m := _COMPILING.match(message):
            name = _short(m.group(1))
            self._pending[name] = {
                "function": m.group(1),
                "types": tuple(_TYPE.findall(m.group(2))),
                "hwm": _proc_status("VmHWM"),
                "rss": _proc_status("VmRSS"),
                "step": self._step_now(),
            }
            return "jax_log_compiles"
        if m := _LOWERED.match(message):
            pending = self._pending.get(_short(m.group(1)))
            if pending is not None and "alarms" not in pending and self._xla.start():
                pending["alarms"] = self._xla.alarms  # XLA compiles it next: read its log
            return "jax_log_compiles"
        if m := _FINISHED.match(message):
            name = _short(m.group(1))
            pending = self._pending.pop(name, None) or {
                "function": m.group(1),
                "types": (),
                "hwm": None,
                "rss": None,
                "step": self._step_now(),
            }
            pending["function"] = m.group(1)
            pending["constants"] = _program_constants()
            self._finish(name, float(m.group(2)), pending)
            return "jax_log_compiles"
        return "jax_log_compiles" if message.startswith(_CHATTER) else None

    def _finish(self, name: str, seconds: float, pending: dict[str, Any]) -> None:
        types_ = pending["types"]
        alarms = None
        if "alarms" in pending:
            self._xla.stop()
            alarms = self._xla.alarms - pending["alarms"]
        hwm, rss = _proc_status("VmHWM"), _proc_status("VmRSS")
        rise = None
        if pending["hwm"] is not None and hwm is not None and pending["rss"] is not None:
            # the peak was set during the compile when it moved; else the resident growth
            rise = (
                hwm - pending["rss"]
                if hwm > pending["hwm"]
                else max(0, (rss or 0) - pending["rss"])
            )
        site, why = self._explained.pop(name, ("", ""))
        before = self._last_types.get(name)
        if before is None:
            change = ""
        elif why and why != "first call" and "unavailable" not in why:
            change = why  # JAX's own words: which argument, before and now
            if m := _STATIC.search(why):  # a static argument, said shorter
                change = f"static argument at {m.group(1)}: {m.group(3)} -> {m.group(2)}"
        else:
            change = _compare(before, types_)
        self._last_types[name] = types_
        self.compiles.append(
            Compile(
                pending["function"],
                max(1, pending["step"]),
                seconds,
                types_,
                change,
                site,
                rise,
                pending.get("constants"),
                alarms,
            )
        )

    # -- what it names ---------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """How many steps were marked."""
        return max(0, len(self.records) - 1)

    @property
    def findings(self) -> tuple[Finding, ...]:
        """The cases this loop shows, with their fixes (the `Finding` type of `diagnose`)."""
        return _watch_rules.findings(self.records, self.compiles, self.growth, self.thresholds)

    def findings_for(self, **overrides: Any) -> tuple[Finding, ...]:
        """The findings under other thresholds (fields of `Thresholds`, e.g.
        ``min_growth=2**20``), from the same record: nothing runs again. The warm-up stays
        the one this watch ran with (the arrays alive at its end were recorded then)."""
        if "warmup" in overrides:
            raise RunbookError("findings_for: the warm-up is fixed when the watch runs")
        try:
            t = dataclasses.replace(self.thresholds, **overrides)
        except TypeError as e:
            raise RunbookError(f"findings_for: {e}") from None
        return _watch_rules.findings(self.records, self.compiles, self.growth, t)

    @property
    def cases(self) -> list[str]:
        """The cases the findings name."""
        return list(dict.fromkeys(f.case for f in self.findings if f.case))

    def compile_table(self) -> Table:
        """Compilations per function: how many, in which steps, seconds, the last change."""
        by_fn: dict[str, list[Compile]] = {}
        for c in self.compiles:
            by_fn.setdefault(c.function, []).append(c)
        rows = []
        for fn, cs in sorted(by_fn.items(), key=lambda kv: -len(kv[1])):
            steps = sorted({c.step for c in cs})
            shown = ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")
            changes = [c.change for c in cs if c.change]
            rows.append(
                [
                    fn,
                    len(cs),
                    shown,
                    f"{sum(c.seconds for c in cs):.3f}",
                    changes[-1] if changes else "-",
                ]
            )
        return Table(["function", "compiles", "steps", "seconds", "last change"], rows)

    def table(self) -> Table:
        """One row per step: seconds, live bytes and arrays, allocator bytes, resident set,
        compilations."""
        alloc = any(r.in_use for r in self.records)
        cols = ["step", "seconds", "live bytes", "live arrays"]
        cols += ["allocator in use"] if alloc else []
        cols += ["host resident", "compiles"]
        rows = []
        for r in self.records:
            row: list[Any] = [r.step, f"{r.seconds:.4f}", fmt_bytes(r.total), r.live_arrays]
            if alloc:
                row.append(fmt_bytes(sum((r.in_use or {}).values())))
            row += [fmt_bytes(r.rss) if r.rss is not None else "-", r.compiles]
            rows.append(row)
        return Table(cols, rows, "step 0: when the watch started; " + _label())

    def plot(self, ax: Any = None, label: str | None = None) -> Any:
        """Live device bytes per step (all devices), one line; returns the axes."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 3))
        ax.plot(
            [r.step for r in self.records],
            [r.total / 2**20 for r in self.records],
            marker=".",
            label=label,
        )
        ax.set_xlabel("step")
        ax.set_ylabel("live device MiB")
        ax.set_title(_label(), fontsize="small")
        return ax

    def summary(self) -> str:
        """Two lines: the steps, the live bytes from first to last, the compilations."""
        if not self.records:
            return "runbook.watch: not started"
        a, b = self.records[0], self.records[-1]
        fns = collections.Counter(c.function for c in self.compiles)
        top = ", ".join(f"{fn} x{n}" for fn, n in fns.most_common(3))
        host = (
            f"; host resident {fmt_bytes(a.rss)} -> {fmt_bytes(b.rss)}"
            if a.rss is not None and b.rss is not None
            else ""
        )
        return (
            f"runbook.watch: {self.steps} steps in {self.seconds:.2f} s; {_label()}\n"
            f"live device bytes {fmt_bytes(a.total)} -> {fmt_bytes(b.total)} "
            f"({a.live_arrays} -> {b.live_arrays} arrays){host}; "
            f"{len(self.compiles)} compilations" + (f" ({top})" if top else "")
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        found = self.findings
        if not found:
            lines.append(
                f"No finding: nothing grew, recompiled or compiled slowly past the thresholds "
                f"({_describe(self.thresholds)})."
            )
        for n, f in enumerate(found, 1):
            lines.append(
                f"{n}. {f.pattern} [{f.case}]" + (f": {fmt_bytes(f.bytes)}" if f.bytes else "")
            )
            lines.append(f"   seen: {f.detail}")
            lines.append(f"   fix:  {f.fix}")
        lines += [f"Caveat: {c}" for c in self.caveats]
        if self.error:
            lines.append(f"The watched code raised: {self.error}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        e = html.escape
        parts = [f'<div class="runbook-watch"><pre>{e(self.summary())}</pre>']
        found = self.findings
        if not found:
            parts.append(f"<p>No finding ({e(_describe(self.thresholds))}).</p>")
        else:
            rows = "".join(
                f"<tr><td>{e(f.pattern)}</td><td>"
                + (f'<a href="{e(f.link)}">{e(f.case or "")}</a>' if f.link else e(f.case or ""))
                + f"</td><td>{fmt_bytes(f.bytes) if f.bytes else '-'}</td><td>{e(f.detail)}</td>"
                f"<td>{e(f.fix)}</td></tr>"
                for f in found
            )
            parts.append(
                '<table class="runbook-table"><thead><tr><th>finding</th><th>case</th>'
                "<th>bytes</th><th>seen</th><th>fix</th></tr></thead>"
                f"<tbody>{rows}</tbody></table>"
            )
        parts += [f"<p>Caveat: {e(c)}</p>" for c in self.caveats]
        if self.error:
            parts.append(f"<p>The watched code raised: <code>{e(self.error)}</code></p>")
        return "".join(parts) + "</div>"

    def to_json(self) -> dict[str, Any]:
        """One JSON-able object: every step, compile, growth and finding."""
        return {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": jax.device_count(),
            "steps": self.steps,
            "seconds": round(self.seconds, 4),
            "thresholds": self.thresholds.to_json(),
            "records": [dataclasses.asdict(r) for r in self.records],
            "compiles": [dataclasses.asdict(c) for c in self.compiles],
            "growth": [dataclasses.asdict(g) for g in self.growth],
            "cases": self.cases,
            "findings": [f.to_json() for f in self.findings],
            "caveats": list(self.caveats),
            "error": self.error,
        }


class _Enough(BaseException):
    """Raised by the CLI's mark_step after --steps steps: ends the watched function."""


def watch(thresholds: Thresholds | None = None, *, holders: bool = True, **overrides: Any) -> Watch:
    """Watch a loop: live device memory, accumulating arrays, compilations, host memory.

    Use it around your loop and call ``w.step()`` at the end of each step; then print it
    or read ``w.findings``::

        with runbook.watch() as w:
            for batch in batches:
                state, metrics = step(state, batch)
                history.append(metrics)
                w.step()
        print(w)

    It names ``live-references`` (live bytes rising step after step), ``recompilation``
    (a function compiled again in several steps) and ``constant-folding`` (a compilation
    taking seconds or much host memory whose program holds large constants, or during
    which XLA logged its slow-folding alarm), each with its fix. A loop in a steady state
    gets no finding: the first `Thresholds.warmup` steps are not judged, and a first
    compilation that is merely slow is not constant folding.

    Args:
        thresholds: when a rule fires (`Thresholds`); the defaults when None.
        holders: look for what holds accumulating arrays (`gc.get_referrers`; it costs a
            scan of the heap once per growing shape).
        **overrides: fields of `Thresholds` to change, e.g. ``warmup=5``.

    Raises:
        RunbookError: at the end of the block, when ``w.step()`` was never called; when
            another watch is running; for thresholds out of range.
    """
    t = thresholds or Thresholds()
    if overrides:
        try:
            t = dataclasses.replace(t, **overrides)
        except TypeError as e:
            raise RunbookError(f"runbook.watch: {e}") from None
    return Watch(t, holders=holders)


# -- helpers ---------------------------------------------------------------------------------


def _label() -> str:
    devices = jax.devices()
    return (
        f"JAX {jax.__version__}, {jax.default_backend()} ({devices[0].device_kind}, "
        f"{len(devices)} device{'s' if len(devices) > 1 else ''})"
    )


def _describe(t: Thresholds) -> str:
    return (
        f"after {t.warmup} warm-up steps: growth of {fmt_bytes(t.min_growth)} rising in "
        f"{t.rising:.0%} of steps, a function compiled in {t.recompiles} steps; any "
        f"compilation of {t.slow_compile:g} s or {fmt_bytes(t.compile_host)} of host memory "
        f"that folds constants ({fmt_bytes(t.fold_constant)} of them, or XLA's alarm)"
    )


def _reasons(body: str) -> list[str]:
    """The reasons a cache-miss record gives: each ``* ...`` item with its continuation
    lines, repeats dropped, the last two (releases list one item per argument, or one per
    previous key); the last line when there is no item."""
    items: list[str] = []
    lines = [ln for ln in body.splitlines() if ln.strip()]
    for ln in lines:
        if ln.strip().startswith("*"):
            items.append(ln.strip())
        elif items and len(ln) - len(ln.lstrip()) > 4:
            items[-1] += " " + ln.strip()
    items = list(dict.fromkeys(items))[-2:]
    return items or [lines[-1].strip()] if lines else []


def _compare(before: tuple[str, ...], after: tuple[str, ...]) -> str:
    if before == after:
        return (
            "same argument shapes and dtypes: a static argument, a closed-over value or the "
            "function object changed"
        )
    if len(before) != len(after):
        return f"{len(before)} array arguments before, {len(after)} now"
    diffs = [
        f"argument {i}: {a} -> {b}"
        for i, (a, b) in enumerate(zip(before, after, strict=False))
        if a != b
    ]
    return "; ".join(diffs[:3]) + (" ..." if len(diffs) > 3 else "")
