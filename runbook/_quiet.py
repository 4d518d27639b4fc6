"""Keep the compiler plugins' start-up chatter off the terminal, and nothing else.

Loading jax-cuda12-plugin on a machine with no GPU makes its C++ code log "Could not find
cuda drivers" (three times, with absl's banner), and loading libtpu without a TPU logs that
it cannot find one. Both write to the process's stderr file descriptor, below Python, and
both are expected here: a target compile needs neither a GPU nor a TPU. We capture that
descriptor while the plugin loads and write back every line that is not one of these.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

EXPECTED = re.compile(
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
    r"|^WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|^WARNING: Logging before InitGoogle\(\) is written to STDERR"
    r"|^Failed to find host bounds for accelerator type"
)


@contextlib.contextmanager
def plugin_chatter(expected: re.Pattern[str] = EXPECTED) -> Iterator[None]:
    """Inside, stderr is captured; on exit every line that `expected` does not match is
    written back."""
    # Descriptor 2 itself, whatever sys.stderr is: C++ writes there, and in a notebook kernel
    # sys.stderr.fileno() names a saved copy of the terminal's descriptor instead.
    fd = 2
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            kept = [ln for ln in text.splitlines() if ln.strip() and not expected.search(ln)]
            if kept:
                os.write(fd, ("\n".join(kept) + "\n").encode())


_started = False


def start_backend() -> None:
    """Start JAX's backend (once) with the plugins' chatter filtered; a no-op after that."""
    global _started
    if not _started:
        import jax

        with plugin_chatter():
            jax.devices()
        _started = True
