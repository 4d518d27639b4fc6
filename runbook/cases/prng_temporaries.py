"""`prng-temporaries`: a large random array needs several times its size in temporaries.

``jax.random.normal(key, shape)`` turns a key into bits, the bits into uniform floats, the
floats into normal ones. With JAX's default generator (threefry2x32) XLA's CPU compiler
keeps the counters and the bits of the whole array alive at once: several times the output
in temporaries, before the output exists. Reports: jax-ml/jax#21045, #20328, #17865,
#19893, openxla/xla#10415. How much depends on the compiler target, the key's
implementation and ``jax_threefry_partitionable``; the page decides each per target.
The functions below are the reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._case_types import Case, Params, Variant

BLOCKS = 64  # row blocks of `normal_blocked`: the temporaries are a few blocks, not the array


def normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The reproduction: one call draws the whole array (`key` of any implementation)."""
    return jax.random.normal(key, shape, jnp.float32)


def normal_blocked(key: jax.Array, shape: tuple[int, ...], blocks: int = BLOCKS) -> jax.Array:
    """The fix for every target: draw the array one block of rows at a time.

    `jax.lax.map` runs the blocks one after another, each with its own key (`split`), so
    the generator's temporaries are those of one block. The numbers differ from one
    `normal` call of the same key (another stream of the same distribution); the rows must
    divide into `blocks`.
    """
    rows, *rest = shape
    if rows % blocks:
        raise ValueError(f"{rows} rows do not divide into {blocks} blocks")
    keys = jax.random.split(key, blocks)
    stacked: jax.Array = jax.lax.map(lambda k: normal(k, (rows // blocks, *rest)), keys)
    return stacked.reshape(shape)


def normal_sharded(
    key: jax.Array, shape: tuple[int, ...], sharding: jax.sharding.Sharding
) -> jax.Array:
    """Draw the array already sharded: each device makes its own shard.

    Only with ``jax_threefry_partitionable=True`` (JAX's default since 0.5) does each
    device generate just its shard's bits; with False each device needs several times it.
    """
    draw = jax.jit(normal, static_argnums=1, out_shardings=sharding)
    out: jax.Array = draw(key, shape)
    return out


def make_key(seed: int, impl: str) -> jax.Array:
    """A typed key of generator `impl`: ``"threefry2x32"`` (JAX's default), ``"rbg"``."""
    return jax.random.key(seed, impl=impl)


def _shape(scale: Mapping[str, Any]) -> tuple[int, int]:
    return (scale["rows"], scale["cols"])


def _key(impl: str) -> Callable[[Mapping[str, Any], Params, bool], tuple[Any]]:
    def args(scale: Mapping[str, Any], params: Params, concrete: bool) -> tuple[Any]:
        if concrete:
            return (make_key(0, impl),)
        return (jax.eval_shape(lambda: make_key(0, impl)),)

    return args


def floor_bytes(scale: Mapping[str, Any]) -> int:
    """What drawing the array must hold at the least: the array itself."""
    rows, cols = _shape(scale)
    return rows * cols * 4


def _floor(variant: Variant, scale: Mapping[str, Any], params: Params) -> int:
    return floor_bytes(scale)


def _program(fn: Callable[..., jax.Array]) -> Callable[[Params], Callable[..., Any]]:
    return lambda p: jax.jit(lambda key: fn(key, (p["rows"], p["cols"])))


CASE = Case(
    name="prng-temporaries",
    title="A large random array needs several times its size in temporaries",
    symptom="initialising a large array with jax.random runs out of memory although the "
    "array itself fits",
    devices=1,
    scales={
        "seed": {"rows": 16384, "cols": 16384},
        "small": {"rows": 2048, "cols": 2048},
        "tiny": {"rows": 64, "cols": 64},
    },
    variants=(
        Variant(
            "threefry",
            "reproduction",
            "jax.random.normal with JAX's default key (threefry2x32), the whole array at once",
            _program(normal),
            args=_key("threefry2x32"),
        ),
        Variant(
            "rbg",
            "fix",
            "the same call with an rbg key (XLA's RngBitGenerator)",
            _program(normal),
            args=_key("rbg"),
        ),
        Variant(
            "blocked",
            "fix",
            f"recommended: threefry, {BLOCKS} blocks of rows drawn one after another "
            "(normal_blocked)",
            _program(normal_blocked),
            args=_key("threefry2x32"),
        ),
    ),
    args=_key("threefry2x32"),
    grid=lambda s: [{"rows": s["rows"], "cols": s["cols"]}],
    floor=_floor,
    significance=0.01,  # the fixes draw another stream: a KS test, not a tolerance
    runnable_scale="small",
    cause="the generator's counters and bits for the whole array are live at once before "
    "they become the output",
    recommended="blocked",
)
