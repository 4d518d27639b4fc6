"""`tpu-padding`: values stored in many times their shape's bytes, padded to the tiles.

XLA's TPU compiler stores arrays in tiles over their two most minor dimensions and pads each
dimension up to its tile. A value whose buffer-assignment size is several times the bytes its
shape needs holds mostly padding. Read from the buffer assignment itself (sizes against
shapes), so it names only what the compiler padded; on CPU and GPU no value is padded.
"""

from __future__ import annotations

import dataclasses

from .._hlo import Shape, Value
from .._program import Finding, Program, finding
from .._render import fmt_bytes

MIN_SHARE = 0.10  # of the program's total: the padding held at once
MIN_EXPANSION = 1.5  # a value's stored bytes over its shape's, to count as padded
MAX_EVIDENCE = 6
PATTERN = "arrays stored padded to the TPU's tiles"
CASE = "tpu-padding"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"values stored in at least {MIN_EXPANSION:g}x the bytes of their shape, whose padding "
        f"(stored bytes less the shape's) is at least {MIN_SHARE:.0%} of the program's total "
        "at one point of the schedule"
    )


def _padded(value: Value) -> bool:
    logical = Shape(value.shape).nbytes
    return value.space == 0 and logical > 0 and value.size >= MIN_EXPANSION * logical


def detect(program: Program) -> list[Finding]:
    chosen = [v for v in program.values if _padded(v)]
    if not chosen:
        return []
    # The padding alone, held at once: what a layout without it would save.
    held = program.peak(dataclasses.replace(v, size=v.size - Shape(v.shape).nbytes) for v in chosen)
    if held < MIN_SHARE * program.total:
        return []
    pairs = [(v, program.module.get(v.instruction)) for v in chosen]
    evidence = [program.buffer(inst, v) for v, inst in pairs if inst is not None]
    worst = max(chosen, key=lambda v: v.size - Shape(v.shape).nbytes)
    logical = Shape(worst.shape).nbytes
    return [
        finding(
            PATTERN,
            CASE,
            held,
            sorted(evidence, key=lambda b: -b.size)[:MAX_EVIDENCE],
            "Give the padded operation a formulation whose arrays keep a large dimension "
            "minor: for a convolution with few channels, make the axis its window spans once "
            "the feature axis of a depthwise convolution",
            copy="runbook.cases.tpu_padding.conv_depthwise_over_width",
            detail=f"{len(chosen)} padded values, {fmt_bytes(held)} of padding live at once; the "
            "most padded, "
            f"{worst.shape}, is stored in {fmt_bytes(worst.size)} for "
            f"{fmt_bytes(logical)} of data ({worst.size / logical:.0f}x).",
        )
    ]
