"""`gather-grad`: an index array copied by a concatenate to feed a gather or a scatter.

jnp indexing with a tuple of index arrays (``x[i, j, k]``, or the columns of one split
array) joins them into one ``(N, k)`` index with a concatenate; where the compiler keeps
that copy as a buffer of its own, it is as large as the index. Narrow integer indices are
widened to 32 bits on the way, so the copy can be larger than the input.
"""

from __future__ import annotations

from .._hlo import Instruction, itemsize
from .._program import Finding, NearMiss, Program, finding
from .._render import fmt_bytes

MIN_SHARE = 0.05  # of the program's total: smaller copies are not worth a finding
PATTERN = "index copy for a gather/scatter"
CASE = "gather-grad"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"a concatenate's result is the index operand of a gather or scatter and has a buffer "
        f"of its own of at least {MIN_SHARE:.0%} of the program's total; an input of a "
        "narrower integer type than the copy is reported as widened"
    )


def _concatenate(program: Program, inst: Instruction) -> Instruction | None:
    """The concatenate `inst` computes (itself, or a fusion's root through bitcasts)."""
    found = program.module.through(inst)
    return found if found.opcode == "concatenate" else None


def _widened(program: Program, producer: Instruction, concat: Instruction) -> str:
    """The narrow integer dtype the copy was widened from, or ""."""
    wide = concat.shape.dtype
    for k in range(len(producer.operands)):
        operand = program.operand(producer, k)
        dtype = operand.shape.dtype if operand is not None else ""
        if dtype[:1] in "su" and dtype[1:].isdigit() and itemsize(dtype) < itemsize(wide):
            return dtype
    return ""


def _index_copies(program: Program) -> dict[str, str]:
    """Index operands of gathers and scatters made by a concatenate: producer -> reader."""
    seen: dict[str, str] = {}
    for inst in program.module.instructions.values():
        if inst.opcode not in ("gather", "scatter"):
            continue
        producer = program.operand(inst, 1)  # the indices of a gather and of a scatter
        if (
            producer is not None
            and producer.computation == program.module.entry
            and _concatenate(program, producer) is not None
        ):
            seen.setdefault(producer.name, inst.opcode)
    return seen


def near_miss(program: Program) -> NearMiss | None:
    """The largest concatenated index copy below the share this detector names."""
    best: NearMiss | None = None
    for name, reader in _index_copies(program).items():
        producer = program.module.get(name)
        nbytes = program.peak(program.values_of(name))
        if producer is None or nbytes >= MIN_SHARE * program.total:
            continue
        why = (
            f"holds {fmt_bytes(nbytes)}, {nbytes / (program.total or 1):.0%} of the total "
            f"(named from {MIN_SHARE:.0%})"
            if nbytes
            else "has no buffer of its own (fused into its reader)"
        )
        miss = NearMiss(
            CASE,
            PATTERN,
            nbytes or producer.shape.nbytes,
            f"a concatenate makes the {producer.shape} index of a {reader}, but the copy {why}",
        )
        if best is None or miss.bytes > best.bytes:
            best = miss
    return best


def detect(program: Program) -> list[Finding]:
    seen = _index_copies(program)
    out = []
    for name, reader in seen.items():
        producer = program.module.get(name)
        assert producer is not None
        concat = _concatenate(program, producer)
        values = program.values_of(name)
        nbytes = program.peak(values)
        if concat is None or nbytes < MIN_SHARE * program.total:
            continue  # fused into its reader (no buffer of its own), or small
        narrow = _widened(program, producer, concat)
        widened = (
            f", widened from {narrow} to {concat.shape.dtype} "
            f"({itemsize(concat.shape.dtype) / itemsize(narrow):g}x the input's bytes)"
            if narrow
            else ""
        )
        evidence = [program.buffer(producer, v) for v in values]
        op, source = program.describe(producer)
        out.append(
            finding(
                PATTERN,
                CASE,
                nbytes,
                evidence,
                "Hand the index array to lax.gather whole instead of indexing with a tuple "
                "of its columns, or process the rows in chunks under lax.scan",
                copy="runbook.cases.gather_grad.loss_chunked",
                detail=f"a {fmt_bytes(nbytes)} {producer.shape} copy of the indices made by a "
                f"concatenate ({op or 'no op name'}, {source or 'no source line'}) feeds a "
                f"{reader}{widened}.",
            )
        )
    return out
