"""`gather-grad`: the gradient of a split-index gather needs about twice the forward's memory.

jax-ml/jax#30015 gathers ``x[tuple(jnp.split(idx, 3, -1))]`` with ``idx`` of shape
``(2048**3, 3)``. The functions below are the reproduction and its fixes; copy the one
you need.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._case_types import Case, Variant


def loss(x: jax.Array, idx: jax.Array) -> jax.Array:
    """The reproduction: split the (N, 3) index into columns and index with the tuple."""
    columns = tuple(jnp.split(idx, 3, axis=-1))
    return jnp.sum(x[columns][..., 0] * 2.5)


_POINTS = lax.GatherDimensionNumbers(
    offset_dims=(), collapsed_slice_dims=(0, 1, 2), start_index_map=(0, 1, 2)
)


def gather_points(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x[idx[:, 0], idx[:, 1], idx[:, 2]]`` with the (N, 3) index handed to XLA whole.

    Assumes in-bounds, non-negative indices (as the reproduction's data has); jnp indexing
    would also wrap negative indices, which costs a rewritten copy of the index array.
    """
    return lax.gather(
        x,
        idx,
        _POINTS,
        slice_sizes=(1, 1, 1),
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def loss_whole_index(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Fix 1: the same sum, with the index array reaching the gather whole."""
    return jnp.sum(gather_points(x, idx) * 2.5)


def loss_chunked(x: jax.Array, idx: jax.Array, chunk: int = 2**22) -> jax.Array:
    """Fix 2: sum over chunks of the index under `lax.scan`.

    The backward pass then handles one chunk at a time, so its temporaries are
    chunk-sized instead of index-sized. `chunk` must divide the number of rows.
    """
    if idx.shape[0] % chunk:
        raise ValueError(f"`chunk` ({chunk}) must divide the number of rows ({idx.shape[0]})")
    chunks = idx.reshape(-1, chunk, idx.shape[-1])

    def body(total: jax.Array, rows: jax.Array) -> tuple[jax.Array, None]:
        return total + loss_whole_index(x, rows), None

    return lax.scan(body, jnp.zeros((), x.dtype), chunks)[0]


def _args(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct] | tuple[jax.Array, jax.Array]:
    side, rows = scale["side"], scale["rows"]
    dtype = jnp.dtype(params["index_dtype"])
    if not concrete:
        return (
            jax.ShapeDtypeStruct((side,) * 3, jnp.float32),
            jax.ShapeDtypeStruct((rows, 3), dtype),
        )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((side,) * 3, dtype=np.float32)
    # Drawn in the index's own dtype and put on the device as it is: an int64 draw and
    # jnp.asarray's copy would hold three times the index at once on the host.
    idx = rng.integers(0, side, size=(rows, 3), dtype=dtype)
    return jax.device_put(x), jax.device_put(idx)


def _sharded_args(
    scale: Mapping[str, Any], params: Mapping[str, Any], mesh: Any
) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The inputs split the natural way: the index rows over the mesh, `x` on every device."""
    x, idx = _args(scale, params, False)
    return (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
        jax.ShapeDtypeStruct(idx.shape, idx.dtype, sharding=NamedSharding(mesh, P("d", None))),
    )


def _chunk(scale: Mapping[str, Any]) -> int:
    chunk: int = min(scale["chunk"], scale["rows"])
    return chunk


CASE = Case(
    name="gather-grad",
    title="Gradient of a gather: twice the forward's memory",
    symptom="jax.grad of x[tuple(jnp.split(idx, 3, -1))] needs far more memory than the forward",
    devices=1,
    scales={
        "seed": {"side": 128, "rows": 2048**3, "chunk": 2**22},
        "medium": {"side": 128, "rows": 2**27, "chunk": 2**22},
        "small": {"side": 64, "rows": 2**24, "chunk": 2**20},
        "tiny": {"side": 8, "rows": 2**10, "chunk": 2**6},
    },
    variants=(
        Variant("forward", "baseline", "the loss itself, no gradient", lambda p: loss),
        Variant(
            "grad", "reproduction", "jax.grad of the split-index gather", lambda p: jax.grad(loss)
        ),
        Variant(
            "grad-whole-index",
            "fix",
            "jax.grad with the (N, 3) index passed to lax.gather whole",
            lambda p: jax.grad(loss_whole_index),
        ),
        Variant(
            "grad-chunked",
            "fix",
            "jax.grad of a lax.scan over index chunks",
            lambda p: jax.grad(lambda x, idx: loss_chunked(x, idx, p["chunk"])),
        ),
    ),
    args=_args,
    grid=lambda scale: [{"index_dtype": d, "chunk": _chunk(scale)} for d in ("int32", "int16")],
    tolerance=1e-4,
    cause="jnp indexing re-joins the split index columns with a concatenate; on CPU the "
    "gradient's scatter needs that full-size copy of the index as a real array",
    recommended="grad-chunked",
    shard=_sharded_args,
)
