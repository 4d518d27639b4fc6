"""`pmap-loop`: a Python loop unrolled into one set of temporaries per iteration.

A Python ``for`` loop in a traced function is unrolled: the compiled program holds one
copy of the body per iteration. Where the iterations do not depend on one another, XLA
may compute them side by side, so the same-shape temporaries of one source line exist
once per iteration at the same time. A rolled loop (``lax.fori_loop``, ``lax.scan``,
``lax.map``) keeps one iteration's.
"""

from __future__ import annotations

from collections import defaultdict

from .._hlo import Value
from .._program import Finding, Program, finding
from .._render import fmt_bytes

MIN_REPEATS = 4  # independent copies of one line's temporary, live at once
MIN_SHARE = 0.10  # of the program's total
MAX_EVIDENCE = 8
PATTERN = "unrolled Python loop"
CASE = "pmap-loop"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"same-shape temporaries from one source line, at least {MIN_REPEATS} of them computed "
        f"from none of the others and at least {MIN_REPEATS} live at once, all such lines "
        f"together at least {MIN_SHARE:.0%} of the program's total (values inside loops are "
        "left out)"
    )


def detect(program: Program) -> list[Finding]:
    groups: dict[tuple[str, str], list[Value]] = defaultdict(list)
    for v in program.values:
        inst = program.module.get(v.instruction)
        if v.kind != "temp" or inst is None or program.in_loop(inst):
            continue
        _, source = program.describe(inst)
        if source:
            groups[(v.shape, source)].append(v)
    # Every line whose temporaries repeat, independently and at once: one finding for them
    # all (the loop's other lines repeat with it).
    found = []
    for (shape, source), values in groups.items():
        names = {v.instruction for v in values}
        if len(names) < MIN_REPEATS:
            continue
        # The iterations: members computed from no other member. In a chain (the layers
        # of a network) only the first is; in an unrolled loop of independent iterations
        # every iteration's first value is.
        starts = {n for n in names if not (program.module.ancestors(n) & names)}
        size = max(v.size for v in values)
        together = program.peak(values) // size if size else 0
        if len(starts) >= MIN_REPEATS and together >= MIN_REPEATS:
            found.append((shape, source, values, starts, together))
    if not found:
        return []
    nbytes = program.peak(v for *_, values, _, _ in found for v in values)
    if nbytes < MIN_SHARE * program.total:
        return []
    found.sort(key=lambda g: -program.peak(g[2]))
    evidence = []
    for _, _, values, starts, _ in found:
        firsts = [v for v in values if v.instruction in starts][:MAX_EVIDENCE]
        evidence += [
            program.buffer(inst, v)
            for v in firsts
            if (inst := program.module.get(v.instruction)) is not None
        ]
    lines = "; ".join(
        f"{shape} values from {source}: {len(starts)} computed independently, {together} "
        "live at once"
        for shape, source, _, starts, together in found[:3]
    )
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            evidence,
            "Roll the loop with lax.fori_loop, lax.scan or lax.map(batch_size=...) so that "
            "one iteration's temporaries exist at a time",
            copy="runbook.cases.pmap_loop.fori_sum",
            detail=f"{lines}: {fmt_bytes(nbytes)} at once, one copy per unrolled iteration.",
        )
    ]
