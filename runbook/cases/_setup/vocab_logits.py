"""The measurement setup of `vocab-logits` (`runbook.cases.vocab_logits`): its scales, its
variants (the loss, then the gradient of each loss), their inputs at each scale and their
floor. A reader copies none of it: the losses are in the case module, which passes them in
with its number of chunks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from ..._case_types import Params, Variant

SCALES = {
    "seed": {"hidden": 4096, "vocab": 128_256, "tokens": (8192, 16384, 32768)},
    "small": {"hidden": 256, "vocab": 16_032, "tokens": (1024, 2048, 4096)},
    "tiny": {"hidden": 16, "vocab": 320, "tokens": (64, 128)},
}


def args(
    scale: Mapping[str, Any],
    params: Params,
    concrete: bool,
    dtype: DTypeLike = jnp.float32,
) -> (
    tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]
    | tuple[jax.Array, jax.Array, jax.Array]
):
    """h ``(tokens, hidden)``, w ``(hidden, vocab)`` and int32 labels: abstract unless
    `concrete`, then random (w scaled by ``1/sqrt(hidden)``, labels uniform)."""
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


def chunk_elements(variant: str, scale: Mapping[str, Any], tokens: int, chunks: int) -> int:
    """Elements of the largest tokens x vocabulary array the strategy must hold at once."""
    elements: int = tokens * scale["vocab"]
    if variant in ("tokens-chunked", "vocab-tiled"):
        return elements // chunks
    return elements


def floor(chunks: int) -> Callable[[Variant, Mapping[str, Any], Params], int]:
    """The case's floor, its fixes splitting the work into `chunks` (the case's `CHUNKS`)."""

    def floor_bytes(variant: Variant, scale: Mapping[str, Any], params: Params) -> int:
        """Inputs, loss and gradients (``N·D + V·D``, twice, and the labels) plus float32
        logits: all of them for the whole-logits strategies, one chunk for the fixes."""
        n, d, v = params["tokens"], scale["hidden"], scale["vocab"]
        inputs: int = (n * d + d * v) * 4 + n * 4
        if variant.role == "baseline":
            return inputs + 4
        logits = chunk_elements(variant.name, scale, n, chunks) * 4
        floor: int = inputs + 4 + (n * d + d * v) * 4 + logits
        return floor

    return floor_bytes


def grad(loss: Callable[..., jax.Array]) -> Callable[..., tuple[Any, Any]]:
    """The loss's value and its gradients with respect to `h` and `w`."""
    return jax.value_and_grad(loss, argnums=(0, 1))


Loss = Callable[..., jax.Array]


def variants(
    *, one_hot: Loss, integer: Loss, token_chunks: Loss, vocab_tiles: Loss
) -> tuple[Variant, ...]:
    """The case's variants, in the order it measures them: the loss alone with one-hot labels
    (the baseline), then the `grad` of each loss the case module passes in."""

    def of(loss: Loss) -> Callable[[Params], Callable[..., Any]]:
        return lambda p: grad(loss)

    return (
        Variant("forward", "baseline", "the loss alone (one-hot labels)", lambda p: one_hot),
        Variant(
            "grad-one-hot",
            "reproduction",
            "value_and_grad, one-hot labels, float32 logits",
            of(one_hot),
        ),
        Variant(
            "grad-integer", "fix", "value_and_grad, integer labels, float32 logits", of(integer)
        ),
        Variant(
            "tokens-chunked",
            "fix",
            "lax.scan over token chunks, each under jax.checkpoint",
            of(token_chunks),
        ),
        Variant(
            "vocab-tiled",
            "fix",
            "recommended: custom_vjp over vocabulary slices, gradient written slice by slice",
            of(vocab_tiles),
        ),
    )
