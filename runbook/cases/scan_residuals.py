"""`scan-residuals`: the gradient of a `lax.scan` stores every step.

Reverse mode keeps what each step's backward needs, for every step, so the gradient's
memory grows with the number of steps: jax-ml/jax#3186, jax-ml/jax#27748,
marin-community/levanter#427, apple/axlearn#1171. The functions below are the
reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .._case_types import Case, Variant
from ._setup.scan_residuals import _args, _floor

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
