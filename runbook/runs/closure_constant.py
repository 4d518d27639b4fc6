"""`closure-constant`'s real runs: what a user's session holds around each variant (host
resident set while compiling and running it, with the executable cached, after
`jax.clear_caches()`), each in a fresh process: what ``python -m runbook run
closure-constant`` measures beyond the compile (`Case.figures` names `host_figures`). The
reproduction and the fix are `runbook.cases.closure_constant`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .. import _subprocess
from .._case_types import Variant
from .._host import settle, status
from .._quiet import start_backend
from ..cases import closure_constant

# The figures a real run measures (`host_figures`), host resident set in bytes above the
# process before the inputs were made (so the table the user holds counts once).
FIGURES = {
    "lowered_text_bytes": "the lowered program's StableHLO text",
    "rss_inputs": "resident: the inputs (and the captured table) made",
    "rss_peak": "resident peak: compile and first run",
    "rss_cached": "resident after the run, the jitted function alive (its executable cached)",
    "rss_cleared": "resident after jax.clear_caches(), the jitted function still alive",
    "rss_deleted": "resident after calling it again (compiled again) and deleting it, "
    "without clear_caches()",
}


def _hwm() -> int:
    return status("VmHWM")


def _host_figures_json(
    variant: str, scale: dict[str, Any], params: dict[str, Any]
) -> dict[str, int]:
    """In a fresh process: what a user's session holds around one variant (`FIGURES`)."""
    start_backend()
    v = closure_constant.CASE.variant(variant)
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(8)))  # start the runtime's pools
    base = settle()
    fn = v.program(params)  # a captured table is made here, as a user makes it
    args = jax.block_until_ready(closure_constant.CASE.inputs(v, scale, params, True))
    figures = {"rss_inputs": settle() - base}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident set
    out = jax.block_until_ready(fn(*args))
    figures["rss_peak"] = _hwm() - base
    del out
    figures["rss_cached"] = settle() - base
    jax.clear_caches()
    figures["rss_cleared"] = settle() - base
    jax.block_until_ready(fn(*args))  # compiled again: the cache holds it again
    del fn
    figures["rss_deleted"] = settle() - base
    jitted: Any = v.program(params)
    lowered = jitted.lower(*closure_constant.CASE.inputs(v, scale, params, False))
    figures["lowered_text_bytes"] = len(lowered.as_text().encode())
    return figures


def host_figures(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any]
) -> dict[str, int]:
    """`FIGURES` for one variant, measured in a fresh process (`Case.figures`)."""
    figures: dict[str, int] = _subprocess.call(
        "runbook.runs.closure_constant:_host_figures_json",
        variant=variant.name,
        scale=dict(scale),
        params=dict(params),
    )
    return figures
