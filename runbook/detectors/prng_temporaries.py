"""`prng-temporaries`: a random array's bits held at the array's full size.

A random array is made from unsigned-integer bits (a generator's counters and output),
which are then turned into floating-point values. Where the compiler keeps the bits of
the whole array, and the generator's state beside them, alive at once, the program needs
several times the array in temporaries before the array exists. Drawing the array in
blocks holds one block's bits at a time.
"""

from __future__ import annotations

from .._program import Finding, Program, finding
from .._render import fmt_bytes

MIN_SHARE = 0.25  # of the program's total, held at once by unsigned-integer temporaries
MAX_EVIDENCE = 6
PATTERN = "random bits held for the whole array"
CASE = "prng-temporaries"
_UNSIGNED = ("u8", "u16", "u32", "u64")
_FLOAT = ("f16", "bf16", "f32", "f64")


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"unsigned-integer temporaries at least {MIN_SHARE:.0%} of the program's total live "
        "at once, in a program that reinterprets unsigned-integer bits as floating-point "
        "values (a bitcast-convert)"
    )


def _makes_floats_from_bits(program: Program) -> bool:
    for inst in program.module.instructions.values():
        if inst.opcode != "bitcast-convert" or not inst.operands:
            continue
        source = program.module.get(inst.operands[0])
        if source is not None and source.shape.dtype in _UNSIGNED and inst.shape.dtype in _FLOAT:
            return True
    return False


def detect(program: Program) -> list[Finding]:
    chosen = [v for v in program.values if v.kind == "temp" and v.shape.split("[")[0] in _UNSIGNED]
    if not chosen or not _makes_floats_from_bits(program):
        return []
    nbytes = program.peak(chosen)
    if nbytes < MIN_SHARE * program.total:
        return []
    pairs = [(v, program.module.get(v.instruction)) for v in chosen]
    evidence = [program.buffer(inst, v) for v, inst in pairs if inst is not None]
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            sorted(evidence, key=lambda b: -b.size)[:MAX_EVIDENCE],
            "Draw the array in blocks of rows (lax.map over the blocks, each with its own key "
            "from jax.random.split) so that one block's random bits exist at a time",
            copy="runbook.cases.prng_temporaries.normal_blocked",
            detail=f"{len(chosen)} unsigned-integer temporaries, {fmt_bytes(nbytes)} live at "
            "once, in a program that turns bits into floating-point values.",
        )
    ]
