"""`scan-residuals`: the gradient of a `lax.scan` stores every step.

Reverse mode keeps what each step's backward needs, for every step, so the gradient's
memory grows with the number of steps: jax-ml/jax#3186, jax-ml/jax#27748,
marin-community/levanter#427, apple/axlearn#1171. The functions below are the
reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .._case_types import Case, Variant

STEPS = (64, 256, 1024, 4096)  # powers of 4: each has an integer square root


def step(h: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    """One step of the recurrence: ``h' = tanh(h @ w + x)``."""
    return jnp.tanh(h @ w + x)


def final_state(w: jax.Array, h0: jax.Array, xs: jax.Array) -> jax.Array:
    """`lax.scan` of `step` from `h0` over the steps of `xs` (one row of `xs` per step)."""

    def body(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return step(h, x, w), None

    h, _ = lax.scan(body, h0, xs)
    return h


def loss(w: jax.Array, h0: jax.Array, xs: jax.Array) -> jax.Array:
    """The reproduction: a loss on the scan's final state.

    `jax.value_and_grad(loss)` stores ``(steps, batch, hidden)`` arrays for the backward
    pass: what each step's backward needs, for every step.
    """
    return jnp.sum(final_state(w, h0, xs))


def loss_fori(w: jax.Array, h0: jax.Array, xs: jax.Array) -> jax.Array:
    """The same loop as `lax.fori_loop` with a static trip count (JAX lowers it to a scan)."""
    h = lax.fori_loop(0, xs.shape[0], lambda t, h: step(h, xs[t], w), h0)
    return jnp.sum(h)


def loss_remat_body(w: jax.Array, h0: jax.Array, xs: jax.Array) -> jax.Array:
    """Fix: `jax.checkpoint` on the scan's body.

    Each step then saves only its inputs (the carry); the backward pass recomputes the
    step's matrix product and `tanh` from it.
    """

    def body(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return step(h, x, w), None

    h, _ = lax.scan(jax.checkpoint(body), h0, xs)
    return jnp.sum(h)


def loss_remat_policy(
    w: jax.Array,
    h0: jax.Array,
    xs: jax.Array,
    policy: Callable[..., bool] = jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
) -> jax.Array:
    """Fix: `jax.checkpoint` on the body with a policy (default: keep the matrix products).

    The policy decides which intermediates are saved rather than recomputed; keeping the
    products saves the most expensive recomputation and stores one more array per step.
    """

    def body(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return step(h, x, w), None

    h, _ = lax.scan(jax.checkpoint(body, policy=policy), h0, xs)
    return jnp.sum(h)


def loss_offload_carry(w: jax.Array, h0: jax.Array, xs: jax.Array) -> jax.Array:
    """Fix on a GPU or a TPU: `jax.checkpoint` on the body, each step's input carry offloaded
    to the host's pinned memory.

    Name what the backward pass reads: under `jax.checkpoint` that is each step's input
    carry, not its output (offloading the output's name moves nothing, jax-ml/jax#23869).
    The stack then lives in host memory and the backward pass copies one carry back per
    step. On CPU, XLA has one memory: this compiles to `loss_remat_body`'s program.
    """

    def body(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return step(checkpoint_name(h, "carry"), x, w), None

    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["carry"],
        offload_src="device",
        offload_dst="pinned_host",
    )
    h, _ = lax.scan(jax.checkpoint(body, policy=policy), h0, xs)
    return jnp.sum(h)


def loss_remat_whole(w: jax.Array, h0: jax.Array, xs: jax.Array) -> jax.Array:
    """`jax.checkpoint` around the whole scan (jax-ml/jax#27748's change)."""
    return jnp.sum(jax.checkpoint(final_state)(w, h0, xs))


def loss_nested(
    w: jax.Array, h0: jax.Array, xs: jax.Array, segments: int | None = None
) -> jax.Array:
    """Fix: a scan over `segments` checkpointed scans, each over ``steps / segments`` steps.

    The forward pass saves one carry per segment; the backward pass recomputes one segment
    at a time, saving one carry per step of that segment only. With ``segments = sqrt(steps)``
    (the default) about ``2 * sqrt(steps)`` carries are stored instead of ``steps``.
    """
    steps = xs.shape[0]
    segments = segments or math.isqrt(steps)
    if steps % segments:
        raise ValueError(f"`segments` ({segments}) must divide the number of steps ({steps})")

    def body(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return step(h, x, w), None

    def segment(h: jax.Array, xs_segment: jax.Array) -> tuple[jax.Array, None]:
        return lax.scan(jax.checkpoint(body), h, xs_segment)[0], None

    chunks = xs.reshape(segments, steps // segments, *xs.shape[1:])
    h, _ = lax.scan(jax.checkpoint(segment), h0, chunks)
    return jnp.sum(h)


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


CASE = Case(
    name="scan-residuals",
    title="The gradient of a scan stores every step",
    symptom="jax.grad through lax.scan needs memory that grows with the number of steps",
    devices=1,
    scales={
        "seed": {"batch": 512, "hidden": 4096, "steps": STEPS},
        "small": {"batch": 512, "hidden": 256, "steps": (16, 64, 256, 1024)},
        "tiny": {"batch": 4, "hidden": 16, "steps": (16, 64)},
    },
    variants=(
        Variant("forward", "baseline", "the loss alone, no gradient", lambda p: loss),
        Variant(
            "grad",
            "reproduction",
            "value_and_grad through lax.scan",
            lambda p: jax.value_and_grad(loss),
        ),
        Variant(
            "grad-fori",
            "reproduction",
            "value_and_grad through lax.fori_loop (static trip count)",
            lambda p: jax.value_and_grad(loss_fori),
        ),
        Variant(
            "remat-whole",
            "fix",
            "jax.checkpoint around the whole scan",
            lambda p: jax.value_and_grad(loss_remat_whole),
        ),
        Variant(
            "remat-policy",
            "fix",
            "jax.checkpoint on the body, policy dots_with_no_batch_dims_saveable",
            lambda p: jax.value_and_grad(loss_remat_policy),
        ),
        Variant(
            "remat-body",
            "fix",
            "jax.checkpoint on the scan's body",
            lambda p: jax.value_and_grad(loss_remat_body),
        ),
        Variant(
            "offload-carry",
            "fix",
            "jax.checkpoint on the body, each step's input carry offloaded to pinned host "
            "memory (save_and_offload_only_these_names)",
            lambda p: jax.value_and_grad(loss_offload_carry),
            since="jax.checkpoint_policies.save_and_offload_only_these_names",
        ),
        Variant(
            "remat-nested",
            "fix",
            "recommended: sqrt(T) checkpointed segments of sqrt(T) checkpointed steps",
            lambda p: jax.value_and_grad(loss_nested),
        ),
    ),
    args=_args,
    grid=lambda scale: [{"steps": t} for t in scale["steps"]],
    floor=_floor,
    tolerance=1e-4,
    cause="reverse mode stacks what every step's backward needs, several (batch, hidden) "
    "arrays per step, before the backward loop starts",
    recommended="remat-nested",
)

RECOMMENDED = "remat-nested"
