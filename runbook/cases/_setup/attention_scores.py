"""The measurement setup of `attention-scores` (`runbook.cases.attention_scores`): its scales,
its variants (the backward pass of each attention function, jitted), their inputs at each
scale, its floor and where cuDNN's attention cannot compile. A reader copies none of it: the
attention functions themselves are in the case module, which passes them in."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._case_types import Params, Variant

Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

SCALES = {
    "seed": {"batch": 1, "heads": 8, "dim": 64, "tokens": (8192,)},
    "small": {"batch": 1, "heads": 2, "dim": 16, "tokens": (1024,)},
    "tiny": {"batch": 1, "heads": 2, "dim": 8, "tokens": (512,)},
}


def _shape(scale: Mapping[str, Any], params: Params) -> tuple[int, int, int, int]:
    return (scale["batch"], params["tokens"], scale["heads"], scale["dim"])


def args(scale: Mapping[str, Any], params: Params, concrete: bool) -> tuple[Any, ...]:
    """q, k, v and d_out, bf16 ``(batch, tokens, heads, dim)``: abstract unless `concrete`."""
    shape = _shape(scale, params)
    if not concrete:
        return tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for _ in range(4))
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))


def floor_bytes(scale: Mapping[str, Any], params: Params) -> int:
    """What the backward pass must hold at the least: its inputs q, k, v and d_out, and its
    outputs, the three gradients: seven bf16 arrays of the inputs' shape."""
    b, t, h, d = _shape(scale, params)
    return 7 * b * t * h * d * 2


def floor(variant: Variant, scale: Mapping[str, Any], params: Params) -> int:
    return floor_bytes(scale, params)


def cudnn_unavailable(platform: str) -> str | None:
    """Why `attention_cudnn` cannot compile for `platform` here; None when it can."""
    if platform not in ("cuda", "gpu"):
        return f"cuDNN attention compiles for NVIDIA GPUs only, not {platform.upper()}"
    if importlib.util.find_spec("nvidia.cudnn") is None:
        return "cuDNN not found: install nvidia-cudnn-cu12"
    return None


def attention_backward(
    attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """The backward pass of `attend`: ``(q, k, v, d_out)`` to the gradients of q, k, v; `d_out`,
    the gradient of the loss with respect to the output, is what the layers above hand down."""

    def backward(
        q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        grads: tuple[jax.Array, jax.Array, jax.Array] = jax.vjp(attend, q, k, v)[1](d_out)
        return grads

    return backward


def variants(
    *,
    xla: Attend,
    chunked: Attend,
    cudnn: Attend,
    blockwise: Attend,
    chunk: int,
    block: int,
) -> tuple[Variant, ...]:
    """The case's variants, in the order it measures them: each program is
    `attention_backward` of one attention function, jitted. `chunk` and `block` are
    the case's `CHUNK` and `BLOCK`, for the summaries."""

    def gradient_of(attend: Attend) -> Callable[[Params], Callable[..., Any]]:
        return lambda p: jax.jit(attention_backward(attend))

    return (
        Variant(
            "xla",
            "reproduction",
            'jax.nn.dot_product_attention(implementation="xla"), causal',
            gradient_of(xla),
            since="jax.nn.dot_product_attention(implementation=)",
        ),
        Variant(
            "chunked",
            "fix",
            f"queries in chunks of {chunk} under jax.checkpoint (attention_chunked)",
            gradient_of(chunked),
        ),
        Variant(
            "cudnn",
            "fix",
            'jax.nn.dot_product_attention(implementation="cudnn"), NVIDIA GPUs only',
            gradient_of(cudnn),
            since="jax.nn.dot_product_attention(implementation=)",
            unavailable=cudnn_unavailable,
        ),
        Variant(
            "blockwise",
            "fix",
            f"recommended: blocks of {block} queries and keys, with its own gradient "
            "(attention_blockwise)",
            gradient_of(blockwise),
        ),
    )
