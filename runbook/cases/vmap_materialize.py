"""`vmap-materialize`: `jax.vmap` builds every example's temporaries at once.

Under `jax.vmap`, each intermediate of the per-example function exists for the whole batch
at the same time. When an example's intermediate is large (a modified copy of a big
array), the batch of them is what runs out of memory: jax-ml/jax#23358 (40 GB for
``x.at[i].set(7).sum()`` over 100k indices), jax-ml/jax#21377 (a pairwise kernel under
nested `vmap`). The functions below are the reproduction and its fixes; copy the one you
need.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._case_types import Case, Variant

BATCH_SIZES = (10, 100, 1000)  # the lax.map(batch_size=k) variants
RECOMMENDED = "map-100"


def per_example(x: jax.Array, i: jax.Array) -> jax.Array:
    """One example of jax-ml/jax#23358: set ``x[i]`` to 7 in a copy of `x`, and sum it."""
    return x.at[i].set(7.0).sum()


def set_and_sum(x: jax.Array, idx: jax.Array) -> jax.Array:
    """The reproduction (jax-ml/jax#23358): `per_example` for every index, under `jax.vmap`.

    Every example's modified copy of `x` exists at once: ``len(idx) * x.nbytes``.
    """
    return jax.vmap(lambda i: per_example(x, i))(idx)


def set_and_sum_rolled(x: jax.Array, idx: jax.Array) -> jax.Array:
    """A rolled loop: `lax.map` without a batch size runs one example at a time."""
    sums: jax.Array = lax.map(lambda i: per_example(x, i), idx)
    return sums


def set_and_sum_mapped(x: jax.Array, idx: jax.Array, batch_size: int = 100) -> jax.Array:
    """Fix: `lax.map` with a `batch_size`: `vmap` over `batch_size` examples at a time.

    ``batch_size`` examples' copies of `x` exist at once. Choose it to divide ``len(idx)``:
    otherwise `lax.map` computes the remainder apart and concatenates (a copy of the output).
    """
    sums: jax.Array = lax.map(lambda i: per_example(x, i), idx, batch_size=batch_size)
    return sums


def set_and_sum_rewrite(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Fix by algebra: the sum with ``x[i]`` replaced by 7 is ``x.sum() - x[i] + 7``.

    No copy of `x` at all. (Float32 rounding differs from summing the modified copy.)
    """
    return x.sum() - x[idx] + 7.0


per_example_jit = jax.jit(per_example)


def python_loop(x: jax.Array, idx: Any) -> np.ndarray:
    """The baseline users compare `vmap` with: ``per_example_jit = jax.jit(per_example)``,
    called once per index.

    Each call's result stays a `jax.Array` until the loop ends; then all are fetched.
    """
    results = [per_example_jit(x, i) for i in idx]
    return np.stack(jax.device_get(results))


# In-flight examples of each variant: how many copies of `x` it needs at once.
def _in_flight(variant: str, n: int) -> int:
    if variant == "vmap":
        return n
    if variant == "rolled":
        return 1
    if variant.startswith("map-"):
        return int(variant.removeprefix("map-"))
    return 0


def _inputs(scale: Mapping[str, Any], p: Mapping[str, Any], concrete: bool) -> tuple[Any, Any]:
    n = scale["n"]
    if not concrete:
        return jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(rng.integers(0, n, n, dtype=np.int32))


def copies_held(variant: str, n: int, platform: str = "cpu") -> int:
    """Copies of ``x`` that `platform`'s compiler must hold in memory for `variant`.

    XLA's CPU compiler writes each example's modified copy of ``x`` before summing it: one
    copy per example in flight. XLA's GPU compiler fuses a single example's update into the
    sum that reads it (the rolled loop holds no copy), but writes a batch of examples'
    updates as a scatter into a broadcast of ``x``, which it does not fuse into the sum:
    one copy per example of the batch. XLA's TPU compiler can place a batch's copies in the
    chip's on-core memory (memory space 1), which the figures, device memory only, do not
    count: in device memory it need hold none.
    """
    k = _in_flight(variant, n)
    if platform == "tpu" or (platform != "cpu" and k == 1):
        return 0
    return k


def floor_bytes(variant: str, n: int, platform: str = "cpu") -> int:
    """Inputs and output (``x``, the indices, one float per index) plus the copies of ``x``
    `platform`'s compiler must hold (`copies_held`): on CPU one per example in flight,
    ``n`` under `vmap`, ``k`` for ``lax.map(batch_size=k)``, 1 for the rolled loop, none
    for the rewrite."""
    return 3 * 4 * n + copies_held(variant, n, platform) * 4 * n


def _floor(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any], platform: str
) -> int:
    return floor_bytes(variant.name, scale["n"], platform)


def _mapped(k: int) -> Variant:
    return Variant(
        f"map-{k}",
        "fix",
        f"lax.map(..., batch_size={k}): {k} examples at a time",
        lambda p: functools.partial(set_and_sum_mapped, batch_size=k),
        since="jax.lax.map(batch_size=)",
    )


CASE = Case(
    name="vmap-materialize",
    title="vmap builds every example's temporaries at once",
    symptom="a per-example function that is cheap alone runs out of memory under jax.vmap",
    devices=1,
    scales={
        "seed": {"n": 100_000},
        "small": {"n": 8_000},
        "medium": {"n": 16_000},  # vmap against the Python loop only
        "tiny": {"n": 1_000},
    },
    variants=(
        Variant("vmap", "reproduction", "jax.vmap over every index", lambda p: set_and_sum),
        Variant(
            "rolled",
            "fix",
            "lax.map without batch_size: one example at a time",
            lambda p: set_and_sum_rolled,
        ),
        *(_mapped(k) for k in BATCH_SIZES),
        Variant(
            "rewrite", "fix", "x.sum() - x[idx] + 7: no copy of x", lambda p: set_and_sum_rewrite
        ),
    ),
    args=_inputs,
    grid=lambda scale: [{"n": scale["n"]}],
    floor=_floor,
    tolerance=1e-5,
    cause="vmap batches every operation of the per-example function, so each example's copy "
    "of x exists at the same time",
    recommended=RECOMMENDED,
)


# --- jax-ml/jax#21377: a pairwise kernel under successive vmaps --------------------------------

PAIRWISE_BATCH = 4  # masks at a time under lax.map


def kernel_21377(x: jax.Array, y: jax.Array, which: jax.Array) -> jax.Array:
    """jax-ml/jax#21377's kernel of two points: a product over the dimensions `which` keeps."""
    return jnp.prod(1 + which * jnp.exp(-((x - y) ** 2)))


def rbf(x: jax.Array, y: jax.Array, which: jax.Array) -> jax.Array:
    """An RBF kernel on the dimensions `which` keeps (a 0/1 mask)."""
    return jnp.exp(-jnp.sum(which * (x - y) ** 2))


def gram_nested(
    kernel: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], xs: jax.Array, which: jax.Array
) -> jax.Array:
    """The kernel matrix of `xs` by two nested `vmap`s, as in jax-ml/jax#21377."""
    row = jax.vmap(kernel, in_axes=(0, None, None))
    return jax.vmap(row, in_axes=(None, 0, None))(xs, xs, which)


def gram_matmul(xs: jax.Array, which: jax.Array) -> jax.Array:
    """The RBF kernel matrix by a matrix product: |x-y|^2 = |x|^2 + |y|^2 - 2 x.y (weighted)."""
    xw = xs * which
    sq = jnp.sum(xw * xs, axis=1)
    return jnp.exp(-(sq[:, None] + sq[None, :] - 2 * xw @ xs.T))


def activation(
    gram: Callable[[jax.Array, jax.Array], jax.Array],
    xs: jax.Array,
    which: jax.Array,
    yb: jax.Array,
) -> jax.Array:
    """jax-ml/jax#21377's quantity for one mask: ``yb . (K yb)``."""
    return jnp.dot(yb, gram(xs, which) @ yb)


def activations_vmap(
    gram: Callable[[jax.Array, jax.Array], jax.Array],
    xs: jax.Array,
    masks: jax.Array,
    ys: jax.Array,
) -> jax.Array:
    """Every mask at once, under `vmap` (the report's code)."""
    return jax.vmap(functools.partial(activation, gram), in_axes=(None, 0, 0))(xs, masks, ys)


def activations_mapped(
    gram: Callable[[jax.Array, jax.Array], jax.Array],
    xs: jax.Array,
    masks: jax.Array,
    ys: jax.Array,
    batch_size: int = PAIRWISE_BATCH,
) -> jax.Array:
    """`batch_size` masks at a time, under `lax.map`."""
    out: jax.Array = lax.map(lambda m: activation(gram, xs, *m), (masks, ys), batch_size=batch_size)
    return out
