"""Corpus programs that ask for host offloading: diagnosed compiled for an H100, without the
device (XLA:CPU has one memory, so offloading cannot show there); skipped where this machine
has no GPU compiler."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ._entry import Built, program

S = jax.ShapeDtypeStruct
bf16 = jnp.bfloat16
GPU = "h100"
LAYERS, BATCH, TOKENS, WIDTH = 8, 4, 1024, 2048


def _offload(*names: str) -> Any:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src="device",
        offload_dst="pinned_host",
    )


def _norm(h: jax.Array) -> jax.Array:
    h32 = h.astype(jnp.float32)
    return (h32 * lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6)).astype(h.dtype)


def _stack_loss(policy: Any, tag_input: str, tag_output: str) -> Any:
    def layer(h: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        h = checkpoint_name(h, tag_input)
        out = h + jax.nn.silu(_norm(h) @ w["gate"]) @ w["out"]
        return checkpoint_name(out, tag_output), None

    def loss(weights: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        h, _ = lax.scan(jax.checkpoint(layer, policy=policy), x, weights)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss))


def _args() -> tuple[Any, ...]:
    weights = {"gate": S((LAYERS, WIDTH, WIDTH), bf16), "out": S((LAYERS, WIDTH, WIDTH), bf16)}
    return weights, S((BATCH, TOKENS, WIDTH), bf16)


@program(
    "host-offloading",
    source="jax-ml/jax#23869",
    shape="a normed SiLU stack that offloads each layer's residual output",
    target=GPU,
)
def offload_residual_output() -> Built:
    return _stack_loss(_offload("residual_out"), "layer_in", "residual_out"), _args()


@program(
    "host-offloading",
    source="openxla/xla#17541",
    shape="the policy names 'layer_input', the layer tags 'layer_in'",
    target=GPU,
)
def offload_misspelled_name() -> Built:
    return _stack_loss(_offload("layer_input"), "layer_in", "layer_out"), _args()


def _batched_loss(weights: jax.Array, x: jax.Array) -> jax.Array:
    policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")

    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        # one weight per sequence: every product has a batch dimension
        return h + jnp.tanh(jnp.einsum("btd,bde->bte", h, w)), None

    h, _ = lax.scan(jax.checkpoint(layer, policy=policy), x, weights)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))


@program(
    "host-offloading",
    source="AI-Hypercomputer/maxtext#987",
    shape="offload_dot_with_no_batch_dims where every product is batched (per-sequence weights)",
    target=GPU,
)
def offload_batched_dots() -> Built:
    weights = S((LAYERS, BATCH, WIDTH, WIDTH), bf16)
    return jax.jit(jax.value_and_grad(_batched_loss)), (weights, S((BATCH, TOKENS, WIDTH), bf16))


@program(
    source="jax-ml/jax#17323",
    shape="the same stack offloading each layer's input, which the backward pass reads",
    target=GPU,
)
def offload_layer_inputs() -> Built:
    return _stack_loss(_offload("layer_in"), "layer_in", "layer_out"), _args()
