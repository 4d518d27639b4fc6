"""The host's memory as ``/proc`` reports it, for real runs (`runbook._runtime`, the runs of
`runbook.runs`, the pages' own): the resident set (settled), its high-water mark, what the
machine has available, and the turns real runs take. Imports nothing of the package."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Set while this process, or the parent that started it, holds the turn.
_TURN_VAR = "RUNBOOK_REAL_RUN_TURN"


def status(field: str) -> int:
    """Bytes of `field` in ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``: its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} missing from /proc/self/status")


def settle() -> int:
    """Return freed heap pages to the OS, then read the resident set."""
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: freed, cached pages may then count
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status("VmRSS")


def available_bytes() -> int:
    """Bytes the machine has available (``MemAvailable`` in ``/proc/meminfo``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable missing from /proc/meminfo")


@contextlib.contextmanager
def one_real_run_at_a_time() -> Iterator[None]:
    """Inside, no other process of this user on this machine is inside (a lock file).

    `runbook.runtime_peak` runs its program inside: a real run checks the memory available
    before it starts, and pages built side by side, or test workers, would otherwise each
    count on the same free memory, their peaks adding up in the build's. The children a
    holder starts share its turn.
    """
    if os.environ.get(_TURN_VAR):
        yield
        return
    path = Path(tempfile.gettempdir()) / f"runbook-real-runs-{os.getuid()}.lock"
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.environ[_TURN_VAR] = "1"
        try:
            yield
        finally:
            del os.environ[_TURN_VAR]
            fcntl.flock(lock, fcntl.LOCK_UN)
