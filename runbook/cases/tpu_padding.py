"""`tpu-padding`: a convolution with few channels is stored padded to TPU tiles.

XLA's TPU compiler stores an array in tiles over its two most minor dimensions, (8, 128)
for float32, and pads each dimension up to its tile. Where the compiler puts a dimension of
size 1 or 2 in the 128-wide place, the array takes up to 128 times its bytes. Reports:
google/flax#1733 (a 3-D convolution with 2 channels and 1 feature: 10.96 GB of HLO
temporaries for 140 MB of data), jax-ml/jax#7502 (a 32x expansion in take_along_axis).
Whether a given shape is padded is the compiler's choice of layout, decided per program and
per release: the page measures each shape it discusses. The functions below are the
reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._case_types import Case, Params, Variant


def conv_few_channels(x: jax.Array, k: jax.Array) -> jax.Array:
    """The reproduction (flax#1733): a 3-D convolution of an NDHWC volume with few channels.

    `k` is ``(3, 3, 1, channels, features)``: a 3 x 3 window over depth and height, one wide
    over the width. On a TPU the compiler lays the convolution's operands out with the
    channel or feature dimension in the 128-wide place of the tile.
    """
    return lax.conv_general_dilated(
        x, k, (1, 1, 1), ((1, 1), (1, 1), (0, 0)), dimension_numbers=("NDHWC", "DHWIO", "NDHWC")
    )


def conv_channels_first(x: jax.Array, k: jax.Array) -> jax.Array:
    """The same convolution with channels-first dimension numbers (NCDHW in, NCDHW out).

    The advice "put a large dimension last" applied to the names of the dimensions: the
    compiler still chooses where each dimension is stored (measured on the page).
    """
    y = lax.conv_general_dilated(
        jnp.moveaxis(x, -1, 1),
        jnp.transpose(k, (4, 3, 0, 1, 2)),
        (1, 1, 1),
        ((1, 1), (1, 1), (0, 0)),
        dimension_numbers=("NCDHW", "OIDHW", "NCDHW"),
    )
    return jnp.moveaxis(y, 1, -1)


def conv_depthwise_over_width(x: jax.Array, k: jax.Array) -> jax.Array:
    """The recommended fix: the width, which the window spans once, becomes the feature
    dimension of a depthwise 2-D convolution; one per input channel, summed.

    Each channel's volume ``x[..., c]`` is an NHWC image whose "channels" are the width
    positions: every width position gets the same 3 x 3 kernel (``feature_group_count`` =
    width), so the minor dimension the compiler tiles is the width, not the 2 channels.
    For one output feature (``k.shape[-1] == 1``).
    """
    width, channels = x.shape[-2], x.shape[-1]
    y = jnp.zeros(x.shape[:-1], x.dtype)
    for c in range(channels):
        kernel = jnp.broadcast_to(k[:, :, 0, c, 0][:, :, None, None], (3, 3, 1, width))
        y = y + lax.conv_general_dilated(
            x[..., c],
            kernel,
            (1, 1),
            ((1, 1), (1, 1)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=width,
        )
    return y[..., None]


def centre_tap(x: jax.Array, k: jax.Array) -> jax.Array:
    """The baseline: the kernel's centre tap alone, a weighted sum over the channels.

    It reads the volume and writes the output, as the convolution does, with no window.
    """
    return jnp.einsum("ndhwc,cf->ndhwf", x, k[1, 1, 0])


def logical_bytes(scale: Mapping[str, Any], channels: int) -> tuple[int, int, int]:
    """The volume's, the kernel's and the output's bytes, unpadded (float32)."""
    voxels = scale["batch"] * scale["depth"] * scale["height"] * scale["width"]
    return voxels * channels * 4, 9 * channels * scale["features"] * 4, voxels * 4


def floor_bytes(scale: Mapping[str, Any], channels: int) -> int:
    """What the program must hold at the least: its input and output, unpadded.

    Every compiler stores at least these bytes (a TPU's padding only adds), so it is a
    lower bound on every target.
    """
    return sum(logical_bytes(scale, channels))


def _args(scale: Mapping[str, Any], params: Params, concrete: bool) -> tuple[Any, Any]:
    c = params["channels"]
    volume = (scale["batch"], scale["depth"], scale["height"], scale["width"], c)
    kernel = (3, 3, 1, c, scale["features"])
    if concrete:
        rng = np.random.default_rng(0)
        return (
            jnp.asarray(rng.standard_normal(volume, np.float32)),
            jnp.asarray(rng.standard_normal(kernel, np.float32) / 3),
        )
    return jax.ShapeDtypeStruct(volume, jnp.float32), jax.ShapeDtypeStruct(kernel, jnp.float32)


def _floor(variant: Variant, scale: Mapping[str, Any], params: Params) -> int:
    return floor_bytes(scale, params["channels"])


def _jit(fn: Any) -> Any:
    return lambda p: jax.jit(fn)


CASE = Case(
    name="tpu-padding",
    title="A convolution with few channels is padded to TPU tiles",
    symptom="on a TPU, a program needs many times the bytes it needs on a CPU or GPU, and "
    "XLA's out-of-memory message reports 'Extra memory due to padding'",
    devices=1,
    scales={
        # google/flax#1733's volume: 8 x 2176 x 1056 voxels, 2 channels, 1 feature.
        "seed": {
            "batch": 1,
            "depth": 8,
            "height": 2176,
            "width": 1056,
            "channels": 2,
            "features": 1,
        },
        "small": {
            "batch": 1,
            "depth": 4,
            "height": 256,
            "width": 128,
            "channels": 2,
            "features": 1,
        },
        "tiny": {"batch": 1, "depth": 3, "height": 8, "width": 16, "channels": 2, "features": 1},
    },
    variants=(
        Variant(
            "centre-tap", "baseline", "the kernel's centre tap alone (no window)", _jit(centre_tap)
        ),
        Variant(
            "ndhwc-conv",
            "reproduction",
            "lax.conv_general_dilated, NDHWC, 2 channels (conv_few_channels)",
            _jit(conv_few_channels),
        ),
        Variant(
            "channels-first",
            "fix",
            "the same convolution named NCDHW (conv_channels_first)",
            _jit(conv_channels_first),
        ),
        Variant(
            "depthwise-width",
            "fix",
            "recommended: a depthwise convolution over the "
            "width, per channel (conv_depthwise_over_width)",
            _jit(conv_depthwise_over_width),
        ),
    ),
    args=_args,
    grid=lambda s: [{"channels": s["channels"]}],
    floor=_floor,
    tolerance=1e-5,
    runnable_scale="small",
    cause="XLA's TPU compiler stores the convolution's operands with the 2 channels or the 1 "
    "feature in the 128-wide dimension of its (8, 128) tiles",
    recommended="depthwise-width",
    shown_on="v5e",
)
