"""`closure-constant`: a large array baked into the compiled program as a constant.

An array a jitted function closes over (a global, a captured NumPy array) is not an
argument: JAX embeds its value in the program, where it takes memory of its own beside
the arguments, and every new value means a new compilation.
"""

from __future__ import annotations

from .._program import Finding, Program, finding
from .._render import fmt_bytes

MIN_BYTES = 1 << 20  # one constant at least this large
MIN_SHARE = 0.01  # of the program's total
PATTERN = "large constants in the program"
CASE = "closure-constant"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"constants of at least {fmt_bytes(MIN_BYTES)} each in the buffer assignment, together "
        f"at least {MIN_SHARE:.0%} of what the program holds"
    )


def detect(program: Program) -> list[Finding]:
    chosen = [v for v in program.values if v.kind == "constant" and v.size >= MIN_BYTES]
    nbytes = sum({v.extent: v.size for v in chosen}.values())
    if not chosen or nbytes < MIN_SHARE * (program.total + nbytes):
        return []
    evidence = []
    for v in chosen:
        inst = program.module.get(v.instruction)
        if inst is None:
            continue
        buffer = program.buffer(inst, v)
        users = program.module.users.get(inst.name, [])
        if users and not buffer.source:  # a constant has no line: name where it is used
            op, source = program.describe(users[0])
            buffer = type(buffer)(
                buffer.size,
                buffer.shape,
                buffer.kind,
                buffer.instruction,
                f"used by {op or users[0].opcode}",
                source,
            )
        evidence.append(buffer)
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            evidence,
            "Pass the array to the jitted function as an argument instead of closing over it, "
            "so that it is an input rather than a constant compiled into the program",
            copy="runbook.cases.closure_constant.embed",
            detail=f"{len(chosen)} constant(s) of at least {fmt_bytes(MIN_BYTES)} are compiled "
            f"into the program: {fmt_bytes(nbytes)} beside its arguments (XLA's total, "
            "arguments + temporaries + outputs, leaves constants out).",
        )
    ]
