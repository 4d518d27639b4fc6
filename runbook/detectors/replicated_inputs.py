"""`pmap-loop`: inputs replicated on every device.

``jax.pmap(..., in_axes=None)``, or a `NamedSharding` with an empty `PartitionSpec`, puts
the whole array on every device. Often intended (parameters in data parallelism); it
matters when the copies are large against a device's memory.
"""

from __future__ import annotations

import jax

from .._program import Finding, Program, finding
from .._render import fmt_bytes
from .replicated_state import replicated_state

MIN_SHARE = 0.10  # of the program's total: smaller replicated inputs are not mentioned
LARGE = 0.25  # of the device's usable memory: above this, a finding, not information
PATTERN = "inputs replicated on every device"
CASE = "pmap-loop"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"inputs whose sharding is the whole array on every device of a multi-device program, "
        f"together at least {MIN_SHARE:.0%} of its total; informational unless at least "
        f"{LARGE:.0%} of the device's usable memory (a target's, or the device's own limit)"
    )


def device_memory(program: Program) -> int | None:
    """The bytes a program may use on one device: the target's, or this device's limit."""
    if program.target is not None:
        return program.target.usable()
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        return None
    return stats.get("bytes_limit")


def detect(program: Program) -> list[Finding]:
    # A training step's replicated state is `replicated_state`'s finding (sharding-replicated).
    state = {p.number for p in replicated_state(program)}
    replicated = [p for p in program.parameters if p.replicated and p.number not in state]
    nbytes = sum(p.shape.nbytes for p in replicated)
    if program.devices < 2 or not replicated or nbytes < MIN_SHARE * program.total:
        return []
    memory = device_memory(program)
    large = memory is not None and nbytes >= LARGE * memory
    against = (
        f"{nbytes / memory:.1%} of a device's usable {fmt_bytes(memory)}"
        if memory
        else "no device memory limit known here (pass target= to compare)"
    )
    names = ", ".join(p.path for p in replicated[:4]) + (", ..." if len(replicated) > 4 else "")
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            [program.buffer(p.instruction) for p in replicated],
            "Split large inputs over the devices (in_axes=0 in pmap, or a NamedSharding that "
            "divides an axis) so that each device holds its share",
            copy="runbook.cases.pmap_loop.shard_mapped",
            detail=f"{len(replicated)} input(s) ({names}) are whole on each of "
            f"{program.devices} devices: {fmt_bytes(nbytes)} per device, {against}.",
            informational=not large,
        )
    ]
