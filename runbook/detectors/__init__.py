"""Detectors for `runbook.diagnose`: one module per known mechanism.

Each detector is a function ``detect(program) -> list[Finding]`` that reads a compiled
`runbook._program.Program` (its buffers, HLO, shardings and aliasing, never the function's
name or source text) and returns what it recognises. A new case adds its module here and
its function to `DETECTORS`.
"""

from __future__ import annotations

from collections.abc import Callable

from .._program import Finding, Program
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

__all__ = ["DETECTORS", "Detector"]
