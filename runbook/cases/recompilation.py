"""`recompilation`: a jitted function called with a new shape, or a new static argument,
each time compiles again, and every executable stays cached.

`jax.jit` keys its cache on the shapes and dtypes of the arguments and on the values of its
static arguments. A loop that feeds batches of a row count not seen before (the last batch
of an epoch, variable-length data), or passes a schedule value (a temperature, a learning
rate) as a static argument, compiles a new executable at each new key, and keeps every one
of them: host memory grows with the number of distinct keys (and device memory on a GPU,
where an executable holds some), although no array grows. One compiled program never shows
it: each executable's `memory_analysis()` is the same. Reports: jax-ml/jax#2072, #7930,
#10828, #16778, #19429, #5531. The functions below are the reproductions and their fixes;
copy the ones you need. Their real runs (resident sets, compile counts, seconds) are in
`runbook.runs.recompilation`; the page's measurements in `runbook.site.recompilation`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._case_types import Case, Variant

# The temperature the compile-time programs and the same-result check use: dividing by
# one leaves the batch as it is, so every variant computes the same loss.
TEMPERATURE = 1.0


def loss(params: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    """A small two-layer network's mean squared output over the rows of `x`."""
    y = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return jnp.mean(y**2)


def masked_loss(params: Mapping[str, jax.Array], x: jax.Array, count: jax.Array) -> jax.Array:
    """`loss` over the first `count` rows of `x` only: the rows past them are padding.

    `count` is an argument (traced), so one executable serves every count of a bucket.
    """
    y = jnp.tanh(x @ params["w1"]) @ params["w2"]
    real = (jnp.arange(x.shape[0]) < count)[:, None]
    return jnp.sum(jnp.where(real, y**2, 0.0)) / (count * y.shape[1])


def scaled_loss(params: Mapping[str, jax.Array], x: jax.Array, temperature: Any) -> jax.Array:
    """`loss` of the batch divided by `temperature` (a schedule value, e.g. annealed)."""
    return loss(params, x / temperature)


def bucket(rows: int) -> int:
    """The smallest power of two that holds `rows` rows."""
    return 1 << max(rows - 1, 0).bit_length()


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """`x` with zero rows appended up to `rows` rows (on the host: no compilation)."""
    return np.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def run_each_shape(
    step: Callable[..., Any],
    params: Mapping[str, jax.Array],
    batches: Iterable[np.ndarray],
    on_step: Callable[[], None] | None = None,
) -> list[float]:
    """The reproduction: ``step = jax.jit(loss)`` called on each batch as it comes.

    A batch with a row count the loop has not seen yet compiles a new executable, and the
    jitted function keeps every executable it compiled (jax-ml/jax#2072's loop).
    """
    losses = []
    for x in batches:
        losses.append(float(step(params, x)))
        if on_step is not None:
            on_step()
    return losses


def run_bucketed(
    step: Callable[..., Any],
    params: Mapping[str, jax.Array],
    batches: Iterable[np.ndarray],
    on_step: Callable[[], None] | None = None,
) -> list[float]:
    """The fix: ``step = jax.jit(masked_loss)`` on each batch padded to a power-of-two bucket.

    Row counts up to ``2**k`` compile at most ``k + 1`` executables; the real row count is
    an argument, so the padding rows are masked out of the loss, not compiled in.
    """
    losses = []
    for x in batches:
        count = x.shape[0]
        padded = pad_rows(x, bucket(count))
        losses.append(float(step(params, padded, np.int32(count))))
        if on_step is not None:
            on_step()
    return losses


def run_each_static(
    step: Callable[..., Any],
    params: Mapping[str, jax.Array],
    batches: Iterable[np.ndarray],
    temperatures: Iterable[float],
    on_step: Callable[[], None] | None = None,
) -> list[float]:
    """The second reproduction: ``step = jax.jit(scaled_loss, static_argnames="temperature")``
    with a new temperature each step: each new value is a new cache key, compiled again."""
    losses = []
    for x, t in zip(batches, temperatures, strict=True):
        losses.append(float(step(params, x, temperature=t)))
        if on_step is not None:
            on_step()
    return losses


def run_traced_static(
    step: Callable[..., Any],
    params: Mapping[str, jax.Array],
    batches: Iterable[np.ndarray],
    temperatures: Iterable[float],
    on_step: Callable[[], None] | None = None,
) -> list[float]:
    """Its fix: ``step = jax.jit(scaled_loss)``, the temperature passed as an array argument.

    A traced value is part of the key by its dtype and shape only: one executable serves
    every temperature. Keep as static only what changes the program (a shape, a flag).
    """
    losses = []
    for x, t in zip(batches, temperatures, strict=True):
        losses.append(float(step(params, x, np.float32(t))))
        if on_step is not None:
            on_step()
    return losses


def init_params(scale: Mapping[str, Any], seed: int = 0) -> dict[str, jax.Array]:
    """The network's weights, drawn on the host and put on the device (no compilation)."""
    rng = np.random.default_rng(seed)
    f, h, o = scale["features"], scale["hidden"], scale["outputs"]
    w1 = rng.standard_normal((f, h), dtype=np.float32) / np.float32(np.sqrt(f))
    w2 = rng.standard_normal((h, o), dtype=np.float32) / np.float32(np.sqrt(h))
    return {"w1": jnp.asarray(w1), "w2": jnp.asarray(w2)}


# The compile-time programs: one step at the grid point (the largest batch), as compiled.
def _batch(scale: Mapping[str, Any], rows: int, concrete: bool) -> Any:
    if not concrete:
        return jax.ShapeDtypeStruct((rows, scale["features"]), jnp.float32)
    rng = np.random.default_rng(2)
    return jnp.asarray(rng.standard_normal((rows, scale["features"]), dtype=np.float32))


def _weights(scale: Mapping[str, Any], concrete: bool) -> Any:
    if concrete:
        return init_params(scale)
    f, h, o = scale["features"], scale["hidden"], scale["outputs"]
    return {
        "w1": jax.ShapeDtypeStruct((f, h), jnp.float32),
        "w2": jax.ShapeDtypeStruct((h, o), jnp.float32),
    }


def _args(scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool) -> tuple[Any, ...]:
    return _weights(scale, concrete), _batch(scale, params["rows"], concrete)


def _padded_args(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[Any, ...]:
    rows = params["rows"]
    count: Any = jnp.int32(rows) if concrete else jax.ShapeDtypeStruct((), jnp.int32)
    if not concrete:
        return _weights(scale, False), _batch(scale, bucket(rows), False), count
    x = pad_rows(np.asarray(_batch(scale, rows, True)), bucket(rows))
    return _weights(scale, True), jnp.asarray(x), count


def _traced_args(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[Any, ...]:
    t: Any = jnp.float32(TEMPERATURE) if concrete else jax.ShapeDtypeStruct((), jnp.float32)
    return (*_args(scale, params, concrete), t)


def floor_bytes(scale: Mapping[str, Any], rows: int) -> int:
    """What one step must hold at the least: the weights, a batch of `rows` rows, the loss."""
    f, h, o = int(scale["features"]), int(scale["hidden"]), int(scale["outputs"])
    return 4 * (f * h + h * o + rows * f + 1)


CASE = Case(
    name="recompilation",
    title="A new shape or static argument each call compiles again",
    symptom="host memory grows step after step in a loop whose arrays do not grow, and "
    "each step is slow",
    devices=1,
    scales={
        "seed": {"calls": 24, "features": 256, "hidden": 2048, "outputs": 256},
        "issue": {"calls": 200, "features": 256, "hidden": 2048, "outputs": 256},
        "tiny": {"calls": 8, "features": 16, "hidden": 32, "outputs": 8},
    },
    variants=(
        Variant(
            "each-shape",
            "reproduction",
            "a jitted loss called on batches of a new row count each step (run_each_shape)",
            lambda p: jax.jit(loss),
        ),
        Variant(
            "bucketed",
            "fix",
            "recommended: batches padded to power-of-two buckets, the real count masked "
            "(run_bucketed)",
            lambda p: jax.jit(masked_loss),
            args=_padded_args,
        ),
        Variant(
            "each-static",
            "reproduction",
            "a new float static argument each step (run_each_static); compiled here with "
            "the value baked in, as a static argument is",
            lambda p: jax.jit(functools.partial(scaled_loss, temperature=TEMPERATURE)),
        ),
        Variant(
            "traced-static",
            "fix",
            "the float passed as an array argument (run_traced_static)",
            lambda p: jax.jit(scaled_loss),
            args=_traced_args,
        ),
    ),
    args=_args,
    grid=lambda s: [{"rows": s["calls"]}],
    floor=lambda variant, scale, params: floor_bytes(scale, params["rows"]),
    runnable_scale="seed",
    cause="jax.jit compiles once per distinct argument shape or static value and keeps "
    "every executable: one compiled program never shows it",
    recommended="bucketed",
    figures="runbook.runs.recompilation:run_figures",
    key_figure="rss_growth",
    runtime=True,
)
