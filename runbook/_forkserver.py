"""A process that has imported JAX once and forks a fresh child for each `_subprocess.call`.

Starting Python and importing JAX takes most of a second of CPU, and a build or a test run
starts a child for every real run, fix check and multi-device measurement: on a 2-core
machine that adds up to a minute or more. A child forked from this server starts with JAX
imported and nothing initialised: no backend, no device, no compiled program. It takes the
caller's environment (``XLA_FLAGS``, read when the backend starts, included) before it
runs, in the working folder the server and its caller share, and exits without the
interpreter's clean-up, as a killed child would.

The server belongs to the process that started it (it ends when that process closes its
pipe) and leaves after `IDLE_SECONDS` without a request, so that it holds no memory between
one page's children and the next's. A caller whose environment differs from the server's
in anything read at import (anything but `PER_CALL`) starts a server of its own.

Linux only: elsewhere, and with ``RUNBOOK_FORKSERVER=0``, each child is a fresh Python.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._errors import RunbookError

# Read when a child's backend starts or while it runs, not at import: they may differ per call
# (pytest names each test in its own).
PER_CALL = frozenset({"XLA_FLAGS", "RUNBOOK_REAL_RUN_TURN", "PYTEST_CURRENT_TEST"})
IDLE_SECONDS = 15.0
SWITCH = "RUNBOOK_FORKSERVER"
# What the server imports before it forks: what the package's children import anyway.
PRELOAD = ("jax", "jax.numpy", "runbook._case", "runbook._measure", "runbook._runtime")


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get(SWITCH, "1") != "0"


class _Lines:
    """Lines from a file descriptor, each waited for at most a given time (a buffered file's
    readline can hold a line that `select` no longer sees)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def readline(self, timeout: float | None = None) -> str | None:
        """The next line ("" at end of file), or None when none came within `timeout` s."""
        while b"\n" not in self.buffer:
            if not select.select([self.fd], [], [], timeout)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return ""
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode() + "\n"


class Server:
    """This process's handle on one server: `run` a child in it, get its exit status."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.key = _key(env)
        # In a session of its own: a Jupyter kernel, shut down, signals each process in its
        # own group and waits until none is left, zombies included; a server there (or, once
        # idle, its zombie) held every page's kernel until Jupyter killed it. Its caller's
        # interrupts no longer reach it either: `run` passes them on to the child.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runbook._forkserver"],
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # the server says nothing; its children write to files
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.replies = _Lines(self.proc.stdout.fileno())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, request: str, env: Mapping[str, str], out: str, err: str, timeout: float) -> int:
        """Fork a child that runs `request` (`answer`) under `env`, its
        stdout and stderr in the files `out` and `err`; return its exit status as
        `subprocess` gives one (``-N`` for signal N).

        Raises:
            ConnectionError: the server is gone, before the child started.
            subprocess.TimeoutExpired: the child ran past `timeout` s; it was killed.
        """
        assert self.proc.stdin is not None
        order = {"request": request, "env": dict(env), "out": out, "err": err}
        pid = None
        try:
            try:
                self.proc.stdin.write((json.dumps(order) + "\n").encode())
                self.proc.stdin.flush()
                started = self.replies.readline()
            except OSError as e:
                raise ConnectionError("the fork server is gone") from e
            if not started:
                raise ConnectionError("the fork server is gone")
            pid = json.loads(started)["pid"]
            line = self.replies.readline(timeout)
            if line is None:
                _kill(pid)
                self.replies.readline()  # the server reaps it
                raise subprocess.TimeoutExpired(["runbook._subprocess", request], timeout)
            if not line:
                raise ConnectionError("the fork server died while its child ran")
        except (ConnectionError, subprocess.TimeoutExpired):
            raise  # the server and this process are still in step
        except BaseException:  # interrupted (Ctrl-C, a kernel's interrupt): so is the child
            if pid is not None:
                _kill(pid)
            self.close()  # what it says next is unread: the next call gets a new server
            raise
        status: int = json.loads(line)["status"]
        return status

    def close(self) -> None:
        """Close its pipe, which ends it once its child is done."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have ended by itself
        os.kill(pid, signal.SIGKILL)


def _key(env: Mapping[str, str]) -> tuple[Any, ...]:
    # The working folder too: a server's children run in its own, first on their import path.
    return (str(Path.cwd()), tuple(sorted((k, v) for k, v in env.items() if k not in PER_CALL)))


_server: Server | None = None
_owner = 0  # the pid whose server `_server` is: a forked process must not share its parent's


def server(env: Mapping[str, str]) -> Server:
    """This process's server for `env`: the running one if it fits, else a new one."""
    global _server, _owner
    if _server is not None and _owner == os.getpid():
        if _server.key == _key(env) and _server.alive():
            return _server
        _server.close()
    if _owner == 0:
        atexit.register(close)
    _server, _owner = Server(env), os.getpid()
    return _server


def close() -> None:
    """Close this process's server, if it has one: the next `server` starts another."""
    global _server
    if _server is not None and _owner == os.getpid():
        _server.close()
        _server = None


def answer(request: str) -> None:
    """In a child: call the request's ``module:function`` with its keyword arguments and
    print the JSON reply, ``{"result": ...}`` or, for a `RunbookError`, ``{"error": ...,
    "kind": ...}`` (`runbook._subprocess.call` reads it)."""
    spec = json.loads(request)
    module, _, name = spec["target"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        result = fn(**spec["kwargs"])
    except RunbookError as e:
        print(json.dumps({"error": str(e), "kind": type(e).__name__}))
        return
    print(json.dumps({"result": result}))


def _child(order: Mapping[str, Any]) -> None:
    """In the forked child: become the caller's child, run the request, exit."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, order["out"]), (2, order["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.environ.clear()
        os.environ.update(order["env"])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        answer(order["request"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - as a fresh interpreter would: the traceback, exit 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(orders: _Lines, replies: int) -> None:
    def reply(message: dict[str, int]) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    while True:
        line = orders.readline(IDLE_SECONDS)
        if not line:
            return  # idle (None): leave, holding nothing; or the caller is gone ("")
        order = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(orders.fd)
            os.close(replies)
            _child(order)
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"status": os.waitstatus_to_exitcode(status)})


def _main() -> None:
    # numpy's BLAS keeps a thread, and Python warns of any fork beside a thread; OpenBLAS
    # resets its pool in a forked child (pthread_atfork), and nothing else runs yet.
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
    replies = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print must not garble a reply
    for name in PRELOAD:
        importlib.import_module(name)
    _serve(_Lines(0), replies)


if __name__ == "__main__":
    _main()
