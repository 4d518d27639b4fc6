"""`scan-residuals`' measurement setup: the inputs of each variant, and the floor (the
carries each strategy must store). The recurrence and its fixes are in
`runbook.cases.scan_residuals`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._case_types import Variant


def _args(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[jax.ShapeDtypeStruct, ...] | tuple[jax.Array, jax.Array, jax.Array]:
    batch, hidden, steps = scale["batch"], scale["hidden"], params["steps"]
    shapes = ((hidden, hidden), (batch, hidden), (steps, hidden))
    if not concrete:
        return tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shapes[0], dtype=np.float32) / np.sqrt(hidden)
    h0 = rng.standard_normal(shapes[1], dtype=np.float32)
    xs = 0.1 * rng.standard_normal(shapes[2], dtype=np.float32)
    return jnp.asarray(w), jnp.asarray(h0), jnp.asarray(xs)


def carry_bytes(scale: Mapping[str, Any]) -> int:
    """Bytes of one carry: a ``(batch, hidden)`` float32 state."""
    carry: int = scale["batch"] * scale["hidden"] * 4
    return carry


def saved_carries(variant: str, steps: int) -> int:
    """Carries a strategy must store for the backward pass, at the least.

    The backward pass of step ``t`` needs ``h_t`` (for ``dw``) and ``h_(t+1)`` (``tanh``'s
    derivative is read off its output), so storing every step needs ``h_1 ... h_T``: the
    ``steps`` states beside the argument ``h_0``. Nested remat needs one carry per segment
    plus one per step of the segment being differentiated. The forward pass stores nothing.
    """
    if variant == "forward":
        return 0
    if variant == "remat-nested":
        segments = math.isqrt(steps)
        return segments + steps // segments
    return steps


def stored_carry_bytes(scale: Mapping[str, Any], platform: str) -> int:
    """Bytes a compiler must store of one saved carry: a whole float32 carry, or on XLA's
    TPU compiler a bfloat16 one.

    On the TPU a saved carry is read back only by matrix products, which take their float32
    operands at bfloat16 by default: XLA's TPU compiler stores the stack already converted,
    at half the bytes.
    """
    return carry_bytes(scale) // 2 if platform == "tpu" else carry_bytes(scale)


def floor_bytes(variant: str, scale: Mapping[str, Any], steps: int, platform: str) -> int:
    """Arguments + outputs + the carries the strategy must store (see `saved_carries`),
    each at the bytes `platform`'s compiler must store it in (`stored_carry_bytes`), in
    device memory: offloaded carries are stored in the host's, except on CPU, which has
    one memory."""
    hidden: int = scale["hidden"]
    batch: int = scale["batch"]
    arguments = (hidden * hidden + batch * hidden + steps * hidden) * 4
    outputs = 4 if variant == "forward" else 4 + hidden * hidden * 4
    if variant == "offload-carry" and platform != "cpu":
        return arguments + outputs
    stored = saved_carries(variant, steps) * stored_carry_bytes(scale, platform)
    return arguments + outputs + stored


def _floor(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any], platform: str
) -> int:
    return floor_bytes(variant.name, scale, params["steps"], platform)
