"""`constant-folding`'s real runs: each variant compiled and run in a fresh process (compile
seconds, the host's resident peak while compiling, XLA's slow-folding warnings), what
``python -m runbook run constant-folding`` measures beyond the compile (`Case.figures` names
`run_figures`). The reproduction and the fixes are `runbook.cases.constant_folding`'s.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .. import _subprocess
from .._case_types import Variant
from .._host import settle, status
from .._quiet import start_backend, warnings_in
from ..cases.constant_folding import CASE

# The figures a real run measures (`run_figures`); resident sets in bytes above the process
# before the inputs were made.
FIGURES = {
    "compile_seconds": "lowering and compiling the jitted function",
    "rss_compile_peak": "resident peak while compiling",
    "rss_compiled": "resident after compiling (the executable alive)",
    "rss_run_peak": "resident peak over the calls",
    "run_seconds": "one call, the median of a few",
    "fold_warning_count": "XLA's 'Constant folding an instruction is taking' warnings",
}
# A compile that has not finished after this long is stopped: the figures then say so
# (`unfinished_count`), and its compile time is at least this.
COMPILE_LIMIT_SECONDS = 45.0
CALLS = 3


def reset_peak() -> None:
    """Reset the resident high-water mark (``VmHWM``) to the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident set


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Descriptor 2 (where XLA's C++ logging goes) written to `path` inside."""
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _run_figures_json(
    variant: str, scale: dict[str, Any], params: dict[str, Any], log: str
) -> dict[str, float]:
    """In a fresh process: compile and run one variant (`FIGURES`); XLA's stderr to `log`."""
    start_backend()
    v = CASE.variant(variant)
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(8)))  # start the runtime's pools
    base = settle()
    args = jax.block_until_ready(CASE.inputs(v, scale, params, True))
    settle()
    reset_peak()
    with _stderr_to(log):
        start = time.perf_counter()
        jitted: Any = v.program(params)
        compiled = jitted.lower(*args).compile()
        seconds = time.perf_counter() - start
    figures: dict[str, float] = {
        "compile_seconds": seconds,
        "rss_compile_peak": status("VmHWM") - base,
        "rss_compiled": settle() - base,
    }
    reset_peak()
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(CALLS):
        del out  # one output alive at a time, as in a loop that keeps only the latest
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    del out
    figures["rss_run_peak"] = status("VmHWM") - base
    figures["run_seconds"] = statistics.median(times)
    return figures


def run_figures(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any]
) -> dict[str, float]:
    """`FIGURES` for one variant, compiled and run in a fresh process (`Case.figures`).

    A compile still running after `COMPILE_LIMIT_SECONDS` is stopped: its figures are then
    the time it ran (a lower bound, as ``compile_seconds``), the warnings it logged and
    ``unfinished_count`` 1.
    """
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "stderr.txt"
        log = str(path)
        start = time.perf_counter()
        try:
            figures: dict[str, float] = _subprocess.call(
                "runbook.runs.constant_folding:_run_figures_json",
                timeout=COMPILE_LIMIT_SECONDS,
                variant=variant.name,
                scale=dict(scale),
                params=dict(params),
                log=log,
            )
            figures["unfinished_count"] = 0
        except subprocess.TimeoutExpired:
            figures = {"compile_seconds": time.perf_counter() - start, "unfinished_count": 1}
        text = path.read_text(errors="replace") if path.exists() else ""
    figures["fold_warning_count"] = warnings_in(text)
    return figures
