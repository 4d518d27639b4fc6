"""`vocab-logits`: large-vocabulary cross-entropy materialises the logits.

The loss of a language model multiplies every token's hidden state by the unembedding
matrix, and its gradient keeps ``tokens x vocabulary`` arrays alive: jax-ml/jax#35906
(and PR #35915), apple/axlearn#1236, AI-Hypercomputer/maxtext#2242 and #3922. The
functions below are the reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._case_types import Case
from ._setup import vocab_logits as _setup

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


def _slice_size(v: int, chunks: object) -> int:
    """Columns per slice: `chunks` slices cover `v`, the last overlapping the one before."""
    if not (isinstance(chunks, int) and 0 < chunks <= v):
        raise ValueError(f"`chunks` ({chunks}) must be an int from 1 to the vocabulary ({v})")
    return -(-v // chunks)


def _start(i: jax.Array, size: int, v: int) -> jax.Array:
    """Where vocabulary slice `i` starts: a ragged last slice ends at the vocabulary's end."""
    return i * size if v % size == 0 else jnp.minimum(i * size, v - size)


def _vocab_slice(x: jax.Array, i: jax.Array, size: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, _start(i, size, x.shape[axis]), size, axis=axis)


def _put(x: jax.Array, part: jax.Array, i: jax.Array, size: int, axis: int = 1) -> jax.Array:
    """`x` with slice `i` set to `part`, or, where the last slice overlaps, added to it."""
    if x.shape[axis] % size:
        part = part + _vocab_slice(x, i, size, axis)
    return lax.dynamic_update_slice_in_dim(x, part, _start(i, size, x.shape[axis]), axis=axis)


def _fresh(i: jax.Array, size: int, v: int) -> jax.Array:
    """The columns of slice `i` that no earlier slice holds (all but in a ragged last one)."""
    return _start(i, size, v) + jnp.arange(size) >= i * size


def _tile(
    h: jax.Array, w: jax.Array, bias: jax.Array | None, i: jax.Array, size: int
) -> tuple[jax.Array, jax.Array]:
    """Slice `i` of `w` and its float32 logits; those of an earlier slice's columns -inf."""
    w_slice = _vocab_slice(w, i, size)
    logits = (h @ w_slice).astype(jnp.float32)
    if bias is not None:
        logits = logits + _vocab_slice(bias, i, size, 0).astype(jnp.float32)
    if w.shape[1] % size:
        logits = jnp.where(_fresh(i, size, w.shape[1]), logits, -jnp.inf)
    return w_slice, logits


def _label_logits(
    logits: jax.Array, labels: jax.Array, i: jax.Array, size: int, v: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each token's own logit if its label falls in vocabulary slice `i`, else 0."""
    local = labels - _start(i, size, v)
    inside = (local >= 0) & (local < size)
    if v % size:
        inside = inside & (labels >= i * size)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, size - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(inside, picked, 0.0), local, inside


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def loss_vocab_tiles(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    weights: jax.Array | None = None,
    bias: jax.Array | None = None,
    label_smoothing: float = 0.0,
    chunks: int = CHUNKS,
) -> jax.Array:
    """Fix (recommended): the loss a slice of the vocabulary at a time, with its own gradient.

    The forward pass keeps a running log-sum-exp per token; the backward pass recomputes
    each slice's logits and writes that slice of the unembedding's gradient directly, so
    neither pass holds more than one ``tokens x vocabulary / chunks`` array. Any vocabulary
    size: a ragged last slice overlaps the one before and skips their shared columns.
    Optional: `weights` ``(tokens,)`` make the loss a weighted sum (give padding and
    ignore-index labels a weight of 0), `bias` ``(vocabulary,)`` is added to the logits, and
    `label_smoothing` ε (a Python float) mixes ε of a uniform target into the one-hot one.
    """
    return _vocab_tiles_forward(h, w, labels, weights, bias, label_smoothing, chunks)[0]


Residuals = tuple[jax.Array, jax.Array, jax.Array, jax.Array, Any, Any, Any]


def _vocab_tiles_forward(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    weights: jax.Array | None,
    bias: jax.Array | None,
    label_smoothing: float,
    chunks: int,
) -> tuple[jax.Array, Residuals]:
    n, v = h.shape[0], w.shape[1]
    size = _slice_size(v, chunks)

    def body(carry: tuple[Any, ...], i: jax.Array) -> tuple[tuple[Any, ...], None]:
        top, total, picked, logit_sum = carry
        _, logits = _tile(h, w, bias, i, size)
        new_top = jnp.maximum(top, logits.max(axis=-1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[:, None]).sum(-1)
        picked = picked + _label_logits(logits, labels, i, size, v)[0]
        if label_smoothing:
            logit_sum += jnp.where(_fresh(i, size, v), logits, 0.0).sum(-1)
        return (new_top, total, picked, logit_sum), None

    smooth: Any = jnp.zeros((n,)) if label_smoothing else None
    start = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)), smooth)
    (top, total, picked, logit_sum), _ = lax.scan(body, start, jnp.arange(-(-v // size)))
    log_sum_exp = top + jnp.log(total)
    if label_smoothing:
        picked = (1 - label_smoothing) * picked + label_smoothing / v * logit_sum
    token_loss = log_sum_exp - picked
    if weights is None:
        return jnp.sum(token_loss), (h, w, labels, log_sum_exp, None, bias, None)
    return jnp.sum(weights * token_loss), (h, w, labels, log_sum_exp, weights, bias, token_loss)


def _vocab_tiles_backward(
    label_smoothing: float, chunks: int, residuals: Residuals, cotangent: jax.Array
) -> tuple[Any, ...]:
    h, w, labels, log_sum_exp, weights, bias, token_loss = residuals
    v = w.shape[1]
    size = _slice_size(v, chunks)
    scale = cotangent if weights is None else (cotangent * weights)[:, None]

    def body(carry: tuple[Any, ...], i: jax.Array) -> tuple[tuple[Any, ...], None]:
        dh, dw, dbias = carry
        w_slice, logits = _tile(h, w, bias, i, size)
        _, local, inside = _label_logits(logits, labels, i, size, v)
        probs = jnp.exp(logits - log_sum_exp[:, None])
        is_label = (jnp.arange(size)[None, :] == local[:, None]) & inside[:, None]
        target = is_label  # smoothed: 1 - ε on the label, plus ε / v on every column
        if label_smoothing:
            smooth = (1 - label_smoothing) * is_label + label_smoothing / v
            target = jnp.where(_fresh(i, size, v), smooth, 0.0)
        g32 = scale * (probs - target)
        g = g32.astype(h.dtype)
        dh = dh + g @ w_slice.T
        dw = _put(dw, h.T @ g, i, size)
        if bias is not None:
            dbias = _put(dbias, g32.sum(0).astype(bias.dtype), i, size, 0)
        return (dh, dw, dbias), None

    zeros = (jnp.zeros_like(h), jnp.zeros_like(w), None if bias is None else jnp.zeros_like(bias))
    (dh, dw, dbias), _ = lax.scan(body, zeros, jnp.arange(-(-v // size)))
    dweights = None if weights is None else (cotangent * token_loss).astype(weights.dtype)
    return dh, dw, None, dweights, dbias


loss_vocab_tiles.defvjp(_vocab_tiles_forward, _vocab_tiles_backward)


CASE = Case(
    name="vocab-logits",
    title="Large-vocabulary cross-entropy materialises the logits",
    symptom="the loss and gradient of a language model hold tokens x vocabulary logits",
    devices=1,
    scales=_setup.SCALES,  # hidden width, vocabulary and the tokens measured at each scale
    variants=_setup.variants(  # the baseline, then value_and_grad of each loss
        one_hot=loss_one_hot,
        integer=loss_integer,
        token_chunks=loss_token_chunks,
        vocab_tiles=loss_vocab_tiles,
    ),
    args=_setup.args,
    grid=lambda scale: [{"tokens": n} for n in scale["tokens"]],
    floor=_setup.floor(CHUNKS),
    tolerance=1e-4,
    cause="the loss's gradient keeps several float32 tokens x vocabulary arrays, made by "
    "log_softmax and by the product with the one-hot labels and its gradient",
    recommended="vocab-tiled",
)

RECOMMENDED = "vocab-tiled"
