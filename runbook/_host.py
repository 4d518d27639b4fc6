"""The host's memory as ``/proc`` reports it, for real runs (`runbook._runtime`, the runs of
`runbook.runs`, the pages' own): the resident set (settled), its high-water mark, what the
machine has available. Imports nothing of the package."""

from __future__ import annotations

import contextlib
import ctypes
import gc


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
