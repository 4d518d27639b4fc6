"""`inplace-copy`: an in-place update copies the whole buffer because the old one is still read.

``buf.at[i].set(x)`` on a donated buffer can write into the buffer itself: XLA updates it in
place. It cannot when the program still reads the old buffer after the update: the old
values must survive, so XLA copies the whole buffer first and updates the copy. Reports:
jax-ml/jax#9132, #1034, #25399, #40101, openxla/xla#45912. Whether reading the old values
first helps depends on the compiler target and the release; making the update depend on
what was read avoids the copy on every target measured (the page decides each).
The functions below are the reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._case_types import Case, Params, Variant


def update_then_read(buf: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The reproduction: update the first rows, then compare the new buffer with the old.

    ``new - buf`` reads `buf` after the update, so `buf` must outlive it: the update
    cannot write into `buf`, even when `buf` is donated.
    """
    new = buf.at[: rows.shape[0]].set(rows)
    return new, jnp.sum(new - buf)


def read_then_update(buf: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Read the old rows first, then update: the same result, computed from the slice.

    Nothing orders the read before the update but the compiler's schedule; whether it
    still copies depends on the target and the release (measured on the page).
    """
    change = jnp.sum(rows - buf[: rows.shape[0]])
    return buf.at[: rows.shape[0]].set(rows), change


def read_then_update_ordered(buf: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`read_then_update` with the read ordered before the update by a barrier.

    `jax.lax.optimization_barrier` returns its operands unchanged, but only once all of
    them are computed: the update takes the buffer from it, so it runs after the read.
    """
    change = jnp.sum(rows - buf[: rows.shape[0]])
    change, buf = jax.lax.optimization_barrier((change, buf))
    return buf.at[: rows.shape[0]].set(rows), change


def update_from_read(buf: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The recommended fix: the update is computed from the old rows it replaces.

    ``.add(rows - old)`` writes ``old + (rows - old)``: the update needs the read, so the
    read comes first on every compiler and the buffer is updated in place. In floating
    point the written rows equal `rows` to within rounding.
    """
    delta = rows - buf[: rows.shape[0]]
    return buf.at[: rows.shape[0]].add(delta), jnp.sum(delta)


def update_only(buf: jax.Array, rows: jax.Array) -> jax.Array:
    """The baseline: the update alone, which every compiler does in place when donated."""
    return buf.at[: rows.shape[0]].set(rows)


def floor_bytes(scale: Mapping[str, Any]) -> int:
    """What the step must hold at the least: the buffer, once."""
    return int(scale["size"]) * 4


def _args(scale: Mapping[str, Any], params: Params, concrete: bool) -> tuple[Any, Any]:
    size, k = scale["size"], scale["rows"]
    if concrete:
        rng = np.random.default_rng(0)
        return (jnp.asarray(rng.standard_normal(size, np.float32)),
                jnp.asarray(rng.standard_normal(k, np.float32)))  # fmt: skip
    return (jax.ShapeDtypeStruct((size,), jnp.float32), jax.ShapeDtypeStruct((k,), jnp.float32))


def _floor(variant: Variant, scale: Mapping[str, Any], params: Params) -> int:
    return floor_bytes(scale)


def _donated(fn: Callable[..., Any]) -> Callable[[Params], Callable[..., Any]]:
    return lambda p: jax.jit(fn, donate_argnums=0)


def _variant(
    name: str, role: str, summary: str, fn: Callable[..., Any], since: str = ""
) -> Variant:
    return Variant(name, role, summary, _donated(fn), since=since)


CASE = Case(
    name="inplace-copy",
    title="An in-place update copies the whole buffer",
    symptom="updating a few rows of a large donated array needs a second copy of the array",
    devices=1,
    scales={
        "seed": {"size": 64 * 2**20, "rows": 1024},  # a 256 MiB float32 buffer
        "small": {"size": 2**20, "rows": 1024},
        "tiny": {"size": 4096, "rows": 64},
    },
    variants=(
        _variant("update-only", "baseline", "the update alone (donated)", update_only),
        _variant(
            "read-after",
            "reproduction",
            "update, then read the old buffer (update_then_read)",
            update_then_read,
        ),
        _variant(
            "read-first",
            "fix",
            "read the old rows, then update (read_then_update)",
            read_then_update,
        ),
        _variant(
            "barrier",
            "fix",
            "read first, ordered by lax.optimization_barrier (read_then_update_ordered)",
            read_then_update_ordered,
            since="jax.lax.optimization_barrier",
        ),
        _variant(
            "from-read",
            "fix",
            "recommended: the update computed from the rows it replaces (update_from_read)",
            update_from_read,
        ),
    ),
    args=_args,
    grid=lambda s: [{"size": s["size"], "rows": s["rows"]}],
    floor=_floor,
    tolerance=1e-5,
    runnable_scale="small",
    cause="the old buffer is read after the update, so XLA updates a copy and keeps the original",
    recommended="from-read",
)
