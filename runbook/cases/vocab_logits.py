"""`vocab-logits`: large-vocabulary cross-entropy materialises the logits.

The loss of a language model multiplies every token's hidden state by the unembedding
matrix, and its gradient keeps ``tokens x vocabulary`` arrays alive: jax-ml/jax#35906
(and PR #35915), apple/axlearn#1236, AI-Hypercomputer/maxtext#2242 and #3922. The
functions below are the reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from .._case_types import Case, Variant

CHUNKS = 32  # the fixes split the tokens, or the vocabulary, into this many chunks


def loss_one_hot(h: jax.Array, w: jax.Array, labels: jax.Array, upcast: bool = True) -> jax.Array:
    """The reproduction: softmax cross-entropy against one-hot labels, logits in float32.

    `h` is ``(tokens, hidden)``, `w` the ``(hidden, vocabulary)`` unembedding, `labels`
    integer token ids. The loss is the sum over tokens (divide by their number for the mean).
    With ``upcast=False`` the logits and the one-hot labels stay in the dtype of `h @ w`.
    """
    logits = h @ w
    if upcast:
        logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    one_hot = jax.nn.one_hot(labels, w.shape[1], dtype=log_probs.dtype)
    return -jnp.sum(one_hot * log_probs)


def loss_integer(h: jax.Array, w: jax.Array, labels: jax.Array, upcast: bool = True) -> jax.Array:
    """The same loss with integer labels: pick each token's log-probability.

    With ``upcast=False`` the logits stay in the dtype of `h @ w`.
    """
    logits = h @ w
    if upcast:
        logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))


def loss_token_chunks(
    h: jax.Array, w: jax.Array, labels: jax.Array, chunks: int = CHUNKS
) -> jax.Array:
    """Fix: the loss over `chunks` slices of the tokens under `lax.scan`, each checkpointed.

    The forward pass keeps no logits; the backward pass recomputes one chunk's logits at a
    time. Each chunk adds its part of the unembedding's gradient: one array the size of `w`.
    """
    n = h.shape[0]
    if n % chunks:
        raise ValueError(f"`chunks` ({chunks}) must divide the number of tokens ({n})")

    @jax.checkpoint
    def chunk_loss(h_chunk: jax.Array, labels_chunk: jax.Array) -> jax.Array:
        logits = (h_chunk @ w).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, labels_chunk[:, None], axis=-1)[:, 0]
        return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked)

    def body(total: jax.Array, chunk: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return total + chunk_loss(*chunk), None

    pieces = (h.reshape(chunks, n // chunks, -1), labels.reshape(chunks, n // chunks))
    total, _ = lax.scan(body, jnp.zeros((), jnp.float32), pieces)
    return total


def _vocab_slice(w: jax.Array, i: jax.Array, size: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(w, i * size, size, axis=1)


def _label_logits(
    logits: jax.Array, labels: jax.Array, i: jax.Array, size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each token's own logit if its label falls in vocabulary slice `i`, else 0."""
    local = labels - i * size
    inside = (local >= 0) & (local < size)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, size - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(inside, picked, 0.0), local, inside


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def loss_vocab_tiles(
    h: jax.Array, w: jax.Array, labels: jax.Array, chunks: int = CHUNKS
) -> jax.Array:
    """Fix (recommended): the loss a slice of the vocabulary at a time, with its own gradient.

    The forward pass keeps a running log-sum-exp per token; the backward pass recomputes
    each slice's logits and writes that slice of the unembedding's gradient directly, so
    neither pass holds more than one ``tokens x vocabulary / chunks`` array.
    """
    return _vocab_tiles_forward(h, w, labels, chunks)[0]


def _vocab_tiles_forward(
    h: jax.Array, w: jax.Array, labels: jax.Array, chunks: int
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
    n, size = h.shape[0], w.shape[1] // chunks
    if w.shape[1] % chunks:
        raise ValueError(f"`chunks` ({chunks}) must divide the vocabulary ({w.shape[1]})")

    def body(
        carry: tuple[jax.Array, jax.Array, jax.Array], i: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
        top, total, picked = carry
        logits = (h @ _vocab_slice(w, i, size)).astype(jnp.float32)
        new_top = jnp.maximum(top, logits.max(axis=-1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[:, None]).sum(-1)
        return (new_top, total, picked + _label_logits(logits, labels, i, size)[0]), None

    start = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)))
    (top, total, picked), _ = lax.scan(body, start, jnp.arange(chunks))
    log_sum_exp = top + jnp.log(total)
    return jnp.sum(log_sum_exp - picked), (h, w, labels, log_sum_exp)


def _vocab_tiles_backward(
    chunks: int,
    residuals: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    cotangent: jax.Array,
) -> tuple[jax.Array, jax.Array, None]:
    h, w, labels, log_sum_exp = residuals
    size = w.shape[1] // chunks

    def body(
        carry: tuple[jax.Array, jax.Array], i: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], None]:
        dh, dw = carry
        w_slice = _vocab_slice(w, i, size)
        logits = (h @ w_slice).astype(jnp.float32)
        _, local, inside = _label_logits(logits, labels, i, size)
        probs = jnp.exp(logits - log_sum_exp[:, None])
        is_label = (jnp.arange(size)[None, :] == local[:, None]) & inside[:, None]
        g = (cotangent * (probs - is_label)).astype(h.dtype)
        dh = dh + g @ w_slice.T
        dw = lax.dynamic_update_slice_in_dim(dw, h.T @ g, i * size, axis=1)
        return (dh, dw), None

    (dh, dw), _ = lax.scan(body, (jnp.zeros_like(h), jnp.zeros_like(w)), jnp.arange(chunks))
    return dh, dw, None


loss_vocab_tiles.defvjp(_vocab_tiles_forward, _vocab_tiles_backward)


def _grad(loss: Callable[..., jax.Array]) -> Callable[..., tuple[Any, Any]]:
    return jax.value_and_grad(loss, argnums=(0, 1))


def _args(
    scale: Mapping[str, Any],
    params: Mapping[str, Any],
    concrete: bool,
    dtype: DTypeLike = jnp.float32,
) -> (
    tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]
    | tuple[jax.Array, jax.Array, jax.Array]
):
    n, d, v = params["tokens"], scale["hidden"], scale["vocab"]
    if not concrete:
        return (
            jax.ShapeDtypeStruct((n, d), dtype),
            jax.ShapeDtypeStruct((d, v), dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32),
        )
    rng = np.random.default_rng(0)
    h = rng.standard_normal((n, d), dtype=np.float32)
    w = rng.standard_normal((d, v), dtype=np.float32) / np.sqrt(d)
    labels = rng.integers(0, v, size=n).astype(np.int32)
    return jnp.asarray(h, dtype), jnp.asarray(w, dtype), jnp.asarray(labels)


def chunk_elements(variant: str, scale: Mapping[str, Any], tokens: int) -> int:
    """Elements of the largest tokens x vocabulary array the strategy must hold at once."""
    elements: int = tokens * scale["vocab"]
    if variant in ("tokens-chunked", "vocab-tiled"):
        return elements // CHUNKS
    return elements


def _floor(variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    """Inputs, loss and gradients (``N·D + V·D``, twice, and the labels) plus float32 logits:
    all of them for the whole-logits strategies, one chunk for the fixes."""
    n, d, v = params["tokens"], scale["hidden"], scale["vocab"]
    inputs: int = (n * d + d * v) * 4 + n * 4
    if variant.role == "baseline":
        return inputs + 4
    floor: int = inputs + 4 + (n * d + d * v) * 4 + chunk_elements(variant.name, scale, n) * 4
    return floor


CASE = Case(
    name="vocab-logits",
    title="Large-vocabulary cross-entropy materialises the logits",
    symptom="the loss and gradient of a language model hold tokens x vocabulary logits",
    devices=1,
    scales={
        "seed": {"hidden": 4096, "vocab": 128_256, "tokens": (8192, 16384, 32768)},
        "small": {"hidden": 256, "vocab": 16_032, "tokens": (1024, 2048, 4096)},
        "tiny": {"hidden": 16, "vocab": 320, "tokens": (64, 128)},
    },
    variants=(
        Variant("forward", "baseline", "the loss alone (one-hot labels)", lambda p: loss_one_hot),
        Variant(
            "grad-one-hot",
            "reproduction",
            "value_and_grad, one-hot labels, float32 logits",
            lambda p: _grad(loss_one_hot),
        ),
        Variant(
            "grad-integer",
            "fix",
            "value_and_grad, integer labels, float32 logits",
            lambda p: _grad(loss_integer),
        ),
        Variant(
            "tokens-chunked",
            "fix",
            "lax.scan over token chunks, each under jax.checkpoint",
            lambda p: _grad(loss_token_chunks),
        ),
        Variant(
            "vocab-tiled",
            "fix",
            "recommended: custom_vjp over vocabulary slices, gradient written slice by slice",
            lambda p: _grad(loss_vocab_tiles),
        ),
    ),
    args=_args,
    grid=lambda scale: [{"tokens": n} for n in scale["tokens"]],
    floor=_floor,
    tolerance=1e-4,
    cause="the loss's gradient keeps several float32 tokens x vocabulary arrays, made by "
    "log_softmax and by the product with the one-hot labels and its gradient",
    recommended="vocab-tiled",
)

RECOMMENDED = "vocab-tiled"
