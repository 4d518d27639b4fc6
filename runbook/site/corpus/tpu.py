"""Corpus programs whose mechanism one compiler makes: diagnosed compiled for a TPU v5e,
without the device (an Entry's ``target``); skipped where this machine has no TPU compiler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._entry import Built, program

S = jax.ShapeDtypeStruct
f32 = jnp.float32
TPU = "v5e"


def _conv(x: jax.Array, k: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _seg_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(_conv(x, params["hidden"]))
    logits = _conv(h, params["head"])  # one mask logit per pixel
    return jnp.mean(jnp.maximum(logits, 0) - logits * y + jnp.log1p(jnp.exp(-jnp.abs(logits))))


@program(
    "tpu-padding",
    source="tensorflow/tensorflow#30803",
    shape="a segmentation head's gradient: 64 features, then a one-logit mask",
    target=TPU,
)
def segmentation_head_grad() -> Built:
    params = {"hidden": S((3, 3, 64, 64), f32), "head": S((3, 3, 64, 1), f32)}
    return jax.jit(jax.grad(_seg_loss)), (
        params,
        S((32, 256, 256, 64), f32),
        S((32, 256, 256, 1), f32),
    )


def _cloud_in_cell(positions: jax.Array, grid: int = 256) -> jax.Array:
    """Paint particles onto a periodic grid: each adds to its 8 neighbouring cells."""
    base = jnp.floor(positions)
    corners = jnp.array([[i, j, k] for i in (0, 1) for j in (0, 1) for k in (0, 1)], f32)
    cells = base[:, None, :] + corners[None]  # [N, 8, 3]
    weight = jnp.prod(1 - jnp.abs(positions[:, None, :] - cells), -1)  # [N, 8]
    c = cells.astype(jnp.int32) % grid
    index = (c[..., 0] * grid + c[..., 1]) * grid + c[..., 2]
    return jnp.zeros(grid**3, f32).at[index.reshape(-1)].add(weight.reshape(-1))


@program(
    "tpu-padding",
    source="DifferentiableUniverseInitiative/flowpm#27",
    shape="int32 cell indices shaped [particles, 8, 3]",
    target=TPU,
)
def particle_painting() -> Built:
    return jax.jit(_cloud_in_cell), (S((2**22, 3), f32),)


def _gray_energy(x: jax.Array, k: jax.Array) -> jax.Array:
    return jnp.sum(jax.nn.relu(_conv(x, k)))


@program(
    "tpu-padding",
    source="google/flax#1733",
    shape="a grayscale image batch, one channel in, 8 features out, kernel gradient",
    target=TPU,
)
def grayscale_conv_grad() -> Built:
    return jax.jit(jax.grad(_gray_energy, argnums=1)), (
        S((64, 512, 512, 1), f32),
        S((3, 3, 1, 8), f32),
    )


@program(
    source="pytorch/xla#6429 (dimensions in multiples of 128)",
    shape="a 128-channel convolution's kernel gradient, compiled for a TPU",
    target=TPU,
)
def wide_conv_grad() -> Built:
    return jax.jit(jax.grad(_gray_energy, argnums=1)), (
        S((32, 128, 128, 128), f32),
        S((3, 3, 128, 128), f32),
    )
