"""`host-offloading`: a checkpoint policy asks to offload, and nothing is in host memory.

An offloading policy (``save_and_offload_only_these_names``, ``offload_dot_with_no_batch_dims``)
moves the values it selects to host memory between the forward and the backward pass, on a
compiler with a host memory space (GPU and TPU). When what it selects is not what the
backward pass saves (jax-ml/jax#23869: a name the backward pass never reads; dots that all
have batch dimensions), it moves nothing, and says nothing: the compiled program holds no
host memory, and what the loops store for the backward pass stays on the device. Read from
the traced program (the policies its checkpoints use) and the compiled one (its host bytes,
the arrays its loops stack per step); the trace is taken only where the compiled program
could show it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax

from .._program import Finding, Program, finding
from .._render import fmt_bytes
from .scan_residuals import held, stacks

MIN_SHARE = 0.10  # of the program's total: what the loops stack per step, held at once
MAX_EVIDENCE = 6
PATTERN = "offloading asked for, nothing moved to host memory"
CASE = "host-offloading"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "a checkpoint whose policy offloads (its name says offload), in a program compiled "
        "for a GPU or TPU that holds no host memory, while arrays its loops stack per step "
        f"hold at least {MIN_SHARE:.0%} of the program's total"
    )


def _policies(jaxpr: Any) -> Iterator[Any]:
    """The policy of every checkpoint in `jaxpr`, nested computations included."""
    for eqn in jaxpr.eqns:
        policy = eqn.params.get("policy")
        if policy is not None:
            yield policy
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _policies(inner)


def offloads(program: Program) -> bool:
    """Whether a checkpoint of the traced program uses an offloading policy."""
    try:
        traced = jax.make_jaxpr(program.fn)(*program.args)
    except Exception:  # noqa: BLE001 - a function that only compiles (a pmap): no answer
        return False
    return any("offload" in getattr(p, "__qualname__", "") for p in _policies(traced.jaxpr))


def detect(program: Program) -> list[Finding]:
    platform = program.target.platform if program.target else jax.default_backend()
    if platform == "cpu" or program.report.host_total or not program.has_backward:
        return []  # XLA:CPU has one memory; a program with host bytes moved some
    chosen = program.shared(stacks)  # what the loops store for the backward pass
    stored = held(program, chosen)
    if stored < MIN_SHARE * program.total or not program.shared(offloads):
        return []
    evidence = [program.buffer(s.write) for s in chosen]
    return [
        finding(
            PATTERN,
            CASE,
            stored,
            sorted(evidence, key=lambda b: -b.size)[:MAX_EVIDENCE],
            "Offload what the backward pass reads: name each layer's input with "
            "checkpoint_name and offload that name (save_and_offload_only_these_names)",
            copy="runbook.cases.host_offloading.offload_names",
            detail=f"a checkpoint policy offloads, yet the program holds no host memory; "
            f"its loops stack {len(chosen)} array(s) per step for the backward pass, "
            f"{fmt_bytes(stored)} at once, on the device.",
        )
    ]
