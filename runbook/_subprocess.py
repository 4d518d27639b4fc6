"""Run a function of this package in a fresh process: forked from a server that has imported
JAX and started nothing (`runbook._forkserver`), or a new Python.

Two reasons to do so: forcing several host devices, which must happen before JAX starts,
and measuring a real peak, which must not be polluted by anything this process did.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import _forkserver
from ._errors import RunbookError, WontFitError

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# How deep children may start children. The package nests at most two deep (a release's
# claims in a child, a multi-device case's in its own); past that a child that starts
# itself again would fill the machine with processes before any timeout fired.
_DEPTH_VAR = "RUNBOOK_CHILD_DEPTH"
MAX_DEPTH = 3


class ChildCrashed(RunbookError):
    """The child was killed by a signal: a crash inside XLA (or an out-of-memory kill), which
    the callers record as a result rather than let take their own process down.

    Attributes:
        signal_name: e.g. ``"SIGFPE"``.
    """

    def __init__(self, target: str, signal_name: str, tail: str) -> None:
        super().__init__(f"child process for {target} crashed ({signal_name}):\n{tail}")
        self.signal_name = signal_name


def one_line(text: str, limit: int = 300) -> str:
    """The first non-empty line of `text`, cut to `limit` characters."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    # XLA appends the whole offending HLO instruction; the sentence before it is the reason.
    line = line.split(" This error occurred for ")[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def failure(e: RunbookError) -> str:
    """One line for a child that did not answer: the crash, or the child's last words."""
    if isinstance(e, ChildCrashed):
        # The children compile and measure: a signal there comes from XLA (or the OOM killer).
        return f"XLA crashed ({e.signal_name}), jaxlib {importlib.metadata.version('jaxlib')}"
    lines = str(e).strip().splitlines()
    return one_line(lines[-1] if lines else "no output")


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def depth() -> int:
    """How many `call`s deep this process is (0: not a child)."""
    return int(os.environ.get(_DEPTH_VAR, "0"))


def child_env(devices: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: `devices` host devices on CPU (GPUs are unaffected)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    if devices > 1:
        flags.append(f"{_DEVICE_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    # Big allocations always come from mmap and go back to the OS when freed, so that the
    # resident-set peak measures the program rather than the allocator's caching. Set, not
    # defaulted: a run-time peak is measured under one rule, inside a docs build (which
    # runs with a smaller threshold of its own) or not.
    env["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    env[_DEPTH_VAR] = str(depth() + 1)
    env.update(extra or {})
    return env


def call(target: str, /, *, devices: int = 1, timeout: float = 1800, **kwargs: Any) -> Any:
    """Call ``module:function`` with JSON-able `kwargs` in a fresh process; return its JSON.

    Raises:
        ChildCrashed: the child died by a signal (SIGFPE, SIGSEGV, SIGABRT, SIGKILL, ...).
        RunbookError: it exited with an error, or raised one (its message); or this
            process is already `MAX_DEPTH` children deep.
        subprocess.TimeoutExpired: it ran past `timeout` seconds and was killed.
    """
    if depth() >= MAX_DEPTH:
        raise RunbookError(
            f"refusing to start a child for {target} at depth {depth()}: a child that starts "
            "children without end (this is a bug in the runbook; please report it)"
        )
    request = json.dumps({"target": target, "kwargs": kwargs})
    returncode, stdout, stderr = _run(request, child_env(devices), timeout)
    lines = stdout.strip().splitlines()
    tail = "\n".join(stderr.strip().splitlines()[-15:])
    if returncode < 0:
        raise ChildCrashed(target, _signal_name(returncode), tail)
    if returncode != 0 or not lines:
        raise RunbookError(f"child process for {target} failed (exit {returncode}):\n{tail}")
    reply = json.loads(lines[-1])
    if "error" in reply:
        raise (WontFitError if reply.get("kind") == "WontFitError" else RunbookError)(
            reply["error"]
        )
    return reply["result"]


def _run(request: str, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run `_forkserver.answer(request)` in a child under `env`: (exit status, stdout,
    stderr). Forked from this process's `runbook._forkserver` where it has one, else a fresh
    Python."""
    if _forkserver.enabled():
        with tempfile.TemporaryDirectory(prefix="runbook-child-") as folder:
            out, err = str(Path(folder) / "out"), str(Path(folder) / "err")
            # Twice: a server that has just left, idle, takes the first order with it.
            for _ in range(2):
                try:
                    code = _forkserver.server(env).run(request, env, out, err, timeout)
                except ConnectionError:
                    _forkserver.close()  # a new server; after that, a fresh Python
                    continue
                with open(out) as o, open(err) as e:
                    return code, o.read(), e.read()
    proc = subprocess.run(
        [sys.executable, "-m", "runbook._subprocess", request],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


if __name__ == "__main__":
    _forkserver.answer(sys.argv[1])
