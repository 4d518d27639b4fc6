"""Keep the compiler plugins' start-up chatter off the terminal, and nothing else.

Loading jax-cuda12-plugin on a machine with no GPU makes its C++ code log "Could not find
cuda drivers" (three times, with absl's banner), and loading libtpu without a TPU logs that
it cannot find one; libtpu also remaps its code onto huge pages as it loads and logs when
the kernel's settings or the file system do not allow it (a machine with transparent huge
pages set to "always" prints "File offset incorrectly aligned for file-backed THP"). All of
it goes to the process's stderr file descriptor, below Python, and all of it is expected
here: a target compile needs neither a GPU nor a TPU, nor huge pages. We capture that
descriptor while the plugin loads and write back every line that is not one of these.

XLA's slow-folding alarm on that descriptor is read too, by `runbook.watch` and the
constant-folding case's real runs: `warnings_in` counts it.

A process that dies inside a capture (an XLA crash, an out-of-memory kill) never writes its
captured lines back. Where ``RUNBOOK_STDERR_DIR`` names a folder (the site's build sets it)
each capture goes to a file there, deleted when the capture ends: a crash leaves the last
words behind for the build to show.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# XLA:CPU's alarm while it folds one constant for over a second (and over ten).
WARNING = "Constant folding an instruction is taking"


def warnings_in(text: str) -> int:
    """How many times XLA's slow-folding alarm fired in `text` (its stderr): one line each,
    the one that carries the log prefix (the alarm repeats the message unprefixed when the
    operation ends)."""
    return sum(1 for line in text.splitlines() if WARNING in line and "] " in line)


EXPECTED = re.compile(
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
    r"|^WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|^WARNING: Logging before InitGoogle\(\) is written to STDERR"
    r"|^Failed to find host bounds for accelerator type"
    r"|hugepage_text\.cc:\d+\] "
)


# XLA's GPU compiler logs when a program is larger than the device (rematerialization cannot
# shrink it; the scheduler's arguments exceed the memory limit): expected where a page
# compiles a reproduction too large for a target on purpose (the page reports the figure).
OVERSIZE = re.compile(
    r"hlo_rematerialization\.cc:\d+\] Can't reduce memory use below"
    r"|gpu_hlo_schedule\.cc:\d+\] The byte size of input/output arguments"
)


KEEP_VAR = "RUNBOOK_STDERR_DIR"


def _capture_file() -> Any:
    """A file for one capture: anonymous, or named in `KEEP_VAR`'s folder where it is set."""
    folder = os.environ.get(KEEP_VAR)
    if not folder:
        return tempfile.TemporaryFile(mode="w+b")
    Path(folder).mkdir(parents=True, exist_ok=True)
    prefix = f"stderr-{os.getpid()}-"
    return tempfile.NamedTemporaryFile(mode="w+b", dir=folder, prefix=prefix, suffix=".log")


class _Capture:
    """One capture of descriptor 2 shared by every context inside it, in any thread.

    Contexts nest and overlap (target compiles run in threads): the first to enter
    redirects the descriptor, the last to leave restores it and writes back the lines that
    none of the patterns registered meanwhile expect. One capture at a time, so that no
    context restores a descriptor another has redirected since.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved = -1
        self.file: Any = None
        self.patterns: list[re.Pattern[str]] = []

    def enter(self, also: re.Pattern[str] | None) -> None:
        with self.lock:
            if also is not None:
                self.patterns.append(also)
            self.depth += 1
            if self.depth > 1:
                return
            # Descriptor 2 itself, whatever sys.stderr is: C++ writes there, and in a
            # notebook kernel sys.stderr.fileno() names a saved copy of the terminal's.
            sys.stderr.flush()
            self.saved = os.dup(2)
            self.file = _capture_file()  # closed (and so deleted) by leave
            os.dup2(self.file.fileno(), 2)

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth > 0:
                return
            sys.stderr.flush()
            os.dup2(self.saved, 2)
            os.close(self.saved)
            self.file.seek(0)
            text = self.file.read().decode(errors="replace")
            self.file.close()
            patterns, self.patterns = [EXPECTED, *self.patterns], []
            kept = [
                ln
                for ln in text.splitlines()
                if ln.strip() and not any(p.search(ln) for p in patterns)
            ]
            if kept:
                os.write(2, ("\n".join(kept) + "\n").encode())


_CAPTURE = _Capture()


@contextlib.contextmanager
def plugin_chatter(also: re.Pattern[str] | None = None) -> Iterator[None]:
    """Inside, stderr is captured; on exit every unexpected line is written back.

    `also`: lines that match it are expected too.
    """
    _CAPTURE.enter(also)
    try:
        yield
    finally:
        _CAPTURE.leave()


def compiler_chatter() -> contextlib.AbstractContextManager[None]:
    """`plugin_chatter` that also drops XLA's warnings on programs too large: compiling for a
    target a program larger than its memory is what the site does on purpose (the pages
    report the figure), and XLA's GPU compiler warns that they do not fit."""
    return plugin_chatter(also=OVERSIZE)


_started = False


def start_backend() -> None:
    """Start JAX's backend (once) with the plugins' chatter filtered; a no-op after that."""
    global _started
    if not _started:
        import jax

        with plugin_chatter():
            jax.devices()
        _started = True
