"""Detectors for `runbook.diagnose`: one module per known mechanism.

Each detector is a function ``detect(program) -> list[Finding]`` that reads a compiled
`runbook._program.Program` (its buffers, HLO, shardings and aliasing, never the function's
name or source text) and returns what it recognises. A new case adds its module here and
its function to `DETECTORS`.

A detector may also say what it saw and did not name: ``near_miss(program) -> NearMiss |
None`` in its module, registered in `NEAR_MISSES`. `near_misses` asks each of them, so that
a diagnosis that names nothing can still say which case comes closest, and why not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .._program import Finding, NearMiss, Program
from . import (
    attention_scores,
    closure_constant,
    donation,
    frozen_params,
    gather_index,
    inplace_copy,
    prng_bits,
    replicated_inputs,
    replicated_state,
    scan_residuals,
    unrolled_loop,
    vmap_batch,
    vocab_logits,
)

Detector = Callable[[Program], list[Finding]]

DETECTORS: tuple[Detector, ...] = (
    gather_index.detect,
    unrolled_loop.detect,
    replicated_inputs.detect,
    scan_residuals.detect,
    vmap_batch.detect,
    donation.detect,
    closure_constant.detect,
    frozen_params.detect,
    vocab_logits.detect,
    prng_bits.detect,
    inplace_copy.detect,
    attention_scores.detect,
    replicated_state.detect,
)

NearMissFn = Callable[[Program], NearMiss | None]

NEAR_MISSES: dict[Detector, NearMissFn] = {
    scan_residuals.detect: scan_residuals.near_miss,
    frozen_params.detect: frozen_params.near_miss,
    vmap_batch.detect: vmap_batch.near_miss,
    gather_index.detect: gather_index.near_miss,
    unrolled_loop.detect: unrolled_loop.near_miss,
}


def near_misses(
    program: Program,
    findings: Iterable[Finding] = (),
    detectors: Iterable[Detector] | None = None,
) -> list[NearMiss]:
    """What `detectors` (default: all) saw of their mechanism without naming it, largest
    first, leaving out the cases `findings` already name."""
    named = {f.case for f in findings if not f.informational}
    found = []
    for detect in DETECTORS if detectors is None else detectors:
        explain = NEAR_MISSES.get(detect)
        miss = explain(program) if explain is not None else None
        if miss is not None and miss.case not in named:
            found.append(miss)
    return sorted(found, key=lambda m: -m.bytes)


__all__ = ["DETECTORS", "NEAR_MISSES", "Detector", "NearMissFn", "near_misses"]
