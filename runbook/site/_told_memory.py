"""The memory a GPU target is described with changes what XLA compiles for it: the same
program, compiled for one GPU told different memory sizes (the measuring page)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._measure import MemoryReport, measure
from .._render import Table, fmt_bytes
from .._targets import GiB, get_target, unavailable

LAYERS, BATCH, WIDTH = 16, 131072, 4096  # every layer's activations kept: 32 GiB in float32


def mlp_loss(ws: Sequence[jax.Array], x: jax.Array) -> jax.Array:
    """A plain tanh MLP: its gradient keeps each layer's activations for the backward pass."""
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x)


def mlp_grad_args() -> tuple[Any, tuple[Any, ...]]:
    """`jax.grad` of `mlp_loss` and its abstract inputs."""
    ws = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * LAYERS
    x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
    return jax.jit(jax.grad(mlp_loss)), (ws, x)


def told_memory_reports(
    base: str = "h100", memories: Sequence[int] = (80, 16)
) -> list[tuple[int, MemoryReport]]:
    """The MLP gradient compiled for `base` described with each of `memories` (GiB)."""
    fn, args = mlp_grad_args()
    return [
        (gib, measure(fn, *args, target=get_target(base).with_memory(gib * GiB)))
        for gib in memories
    ]


def told_memory(base: str = "h100", memories: Sequence[int] = (80, 16)) -> Table | None:
    """`told_memory_reports` as a table: temporaries and total per description. None where
    the GPU compiler is not installed."""
    if unavailable(base):
        return None
    rows = [
        [f"{gib} GiB", fmt_bytes(r.temp), fmt_bytes(r.total)]
        for gib, r in told_memory_reports(base, memories)
    ]
    label = get_target(base).label
    return Table(
        ["memory in the target description", "temporaries", "total"],
        rows,
        f"jax.grad of a {LAYERS}-layer tanh MLP, batch {BATCH:,} x {WIDTH:,} float32, compiled "
        f"for the {label} described with each memory size (no device; compile-time "
        f"predictions), jax {jax.__version__}.",
    )
