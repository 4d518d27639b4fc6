"""Corpus programs of gradient accumulation: training steps that hold the whole batch's
activations, as the reports wrote them, and an accumulation that holds a micro-batch's."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from ._entry import Built, program

S = jax.ShapeDtypeStruct
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def _encoder(params: dict[str, Any], tokens: jax.Array) -> Any:
    """Embedded tokens through residual MLP blocks, mean-pooled to a few classes."""
    h = params["embed"][tokens]
    for block in params["blocks"]:
        h = h + jax.nn.gelu(h @ block["up"]) @ block["down"]
    return jnp.mean(h, axis=1) @ params["head"]


def _encoder_params(vocab: int, width: int, mlp: int, blocks: int, classes: int) -> Any:
    block = {"up": S((width, mlp), f32), "down": S((mlp, width), f32)}
    return {"embed": S((vocab, width), f32), "blocks": [block] * blocks,
            "head": S((width, classes), f32)}  # fmt: skip


def _classifier_step(model: Any, optimizer: optax.GradientTransformation) -> Any:
    def loss(params: Any, x: jax.Array, labels: jax.Array) -> Any:
        logits = model(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(params: Any, opt_state: Any, x: jax.Array, labels: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


@program(
    "grad-accumulation",
    source="google-deepmind/optax#320 (MultiSteps on a TPU: memory grows as with the batch)",
    shape="optax.MultiSteps(adamw, 4) given the whole accumulated batch on every call",
)
def multisteps_given_the_accumulated_batch() -> Built:
    optimizer = optax.MultiSteps(optax.adamw(1e-4), every_k_schedule=4)
    params = _encoder_params(vocab=8192, width=1024, mlp=4096, blocks=4, classes=16)
    batch = 8 * 4  # per device 8, times the 4 accumulation steps, passed at once
    state = jax.eval_shape(optimizer.init, params)
    args = (params, state, S((batch, 512), i32), S((batch,), i32))
    return _classifier_step(_encoder, optimizer), args


def _convnet(params: list[Any], images: jax.Array) -> Any:
    h = images
    for w in params[:-1]:
        h = jax.nn.relu(lax.conv_general_dilated(h, w, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC")))  # fmt: skip
    return jnp.mean(h, axis=(1, 2)) @ params[-1]


@program(
    "grad-accumulation",
    source="google-deepmind/optax#472 (MultiSteps with every_k_schedule=1 runs out of memory)",
    shape="a convolutional network, clip + adam under MultiSteps(every_k_schedule=1)",
)
def multisteps_every_step_convnet() -> Built:
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-4))
    optimizer = optax.MultiSteps(inner, every_k_schedule=1)
    channels = (3, 64, 64, 128, 128)
    params = [S((3, 3, a, b), f32) for a, b in itertools.pairwise(channels)]
    params.append(S((channels[-1], 10), f32))
    state = jax.eval_shape(optimizer.init, params)
    args = (params, state, S((120, 128, 128, 3), f32), S((120,), i32))
    return _classifier_step(_convnet, optimizer), args


@program(
    "grad-accumulation",
    source="young-geng/EasyLM#36 (accumulating over 2 steps ran a TPU out of memory)",
    shape="a bfloat16 gated MLP stack; MultiSteps(2), each call a half batch of 8 x 2048",
)
def multisteps_two_halves_bf16() -> Built:
    optimizer = optax.MultiSteps(optax.adamw(1e-4), every_k_schedule=2)

    def model(params: Any, x: jax.Array) -> jax.Array:
        h = x
        for block in params:
            h = h + (jax.nn.silu(h @ block["gate"]) * (h @ block["up"])) @ block["down"]
        return h

    def loss(params: Any, x: jax.Array) -> Any:
        return jnp.mean(jnp.square(model(params, x).astype(f32)))

    def step(params: Any, opt_state: Any, x: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    width, mlp = 1024, 2816
    block = {"gate": S((width, mlp), bf16), "up": S((width, mlp), bf16),
             "down": S((mlp, width), bf16)}  # fmt: skip
    params = [block] * 4
    state = jax.eval_shape(optimizer.init, params)
    return jax.jit(step, donate_argnums=(0, 1)), (params, state, S((8, 2048, width), bf16))


@program(
    source="borisdayma/dalle-mini#122 (a loop of one's own instead of MultiSteps)",
    shape="one step, lax.scan over 8 micro-batches of an MLP classifier, f32 accumulator",
)
def scan_accumulation_step() -> Built:
    optimizer = optax.adamw(1e-4)
    params = _encoder_params(vocab=8192, width=1024, mlp=4096, blocks=4, classes=16)

    def loss(params: Any, tokens: jax.Array, labels: jax.Array) -> Any:
        logits = _encoder(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(params: Any, opt_state: Any, tokens: jax.Array, labels: jax.Array) -> Any:
        parts = (tokens.reshape(8, -1, tokens.shape[1]), labels.reshape(8, -1))

        def add(acc: Any, part: Any) -> Any:
            value, grads = jax.value_and_grad(loss)(params, *part)
            return jax.tree.map(jnp.add, acc, grads), value

        summed, values = lax.scan(add, jax.tree.map(jnp.zeros_like, params), parts)
        grads = jax.tree.map(lambda g: g / 8, summed)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, values.mean()

    state = jax.eval_shape(optimizer.init, params)
    args = (params, state, S((32, 512), i32), S((32,), i32))
    return jax.jit(step, donate_argnums=(0, 1)), args
