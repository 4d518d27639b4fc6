"""`closure-constant`: arrays captured in a jitted closure become constants.

A jitted function that closes over an array (a global, an embedding table built outside)
does not take it as an input: JAX embeds its value in the program it lowers, and XLA
compiles it into the executable. The process then holds the array once for the user and
again in the program text, the compiler's module and the cached executable; none of it
is in `memory_analysis()`. Reports: jax-ml/jax#282, #11448, #12719, #16278, #23457,
#10596, #19429. The functions below are the reproduction and its fix; copy the one you
need. Their real runs (a session's host memory) are in `runbook.runs.closure_constant`; the
page's measurements in `runbook.site.closure_constant`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._case_types import Case, Variant


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """An embedding lookup: the row of `table` for each id."""
    return jnp.take(table, ids, axis=0)


def make_lookup_captured(table: jax.Array) -> jax.stages.Wrapped:
    """The reproduction: a jitted lookup that closes over `table`.

    `table` is not an argument of the jitted function, so JAX embeds its value in the
    program as a constant (jax-ml/jax#23457's pattern).
    """
    return jax.jit(lambda ids: lookup(table, ids))


def embed(table: jax.Array, ids: jax.Array) -> jax.Array:
    """The fix: the table is an argument of the jitted function (jax-ml/jax#10596).

    Use it as ``jax.jit(embed)(table, ids)``: the table is an input buffer, read where it
    lives; the program holds no copy of it, and a new table needs no new compilation.
    """
    return lookup(table, ids)


_lock = threading.Lock()


@functools.cache
def _table_cached(kind: str, vocab: int, dim: int) -> jax.Array:
    if kind == "zeros":
        return jnp.zeros((vocab, dim), jnp.float32)
    normal = jax.random.normal(jax.random.key(0), (vocab, dim), jnp.float32)
    scaled: jax.Array = normal / np.sqrt(dim)  # np.sqrt's scalar is Any to mypy
    return scaled


def table(kind: str, vocab: int, dim: int) -> jax.Array:
    """The embedding table, made once per process: ``"random"`` (normal) or ``"zeros"``."""
    with _lock:  # pages compile for several targets in threads: make it once
        made: jax.Array = jax.block_until_ready(_table_cached(kind, vocab, dim))
        return made


def _ids(scale: Mapping[str, Any], concrete: bool) -> Any:
    shape = (scale["tokens"],)
    if not concrete:
        return jax.ShapeDtypeStruct(shape, jnp.int32)
    rng = np.random.default_rng(1)
    return jnp.asarray(rng.integers(0, scale["vocab"], shape, dtype=np.int32))


def _ids_only(scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool) -> tuple[Any]:
    return (_ids(scale, concrete),)


def _table_and_ids(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[Any, Any]:
    if concrete:
        t: Any = table("random", params["vocab"], params["dim"])
    else:
        t = jax.ShapeDtypeStruct((params["vocab"], params["dim"]), jnp.float32)
    return t, _ids(scale, concrete)


def _captured(kind: str) -> Callable[[Mapping[str, Any]], jax.stages.Wrapped]:
    return lambda p: make_lookup_captured(table(kind, p["vocab"], p["dim"]))


def sizes(scale: Mapping[str, Any]) -> dict[str, int]:
    """Bytes of the table, the ids and the looked-up rows at `scale`."""
    v, d, t = scale["vocab"], scale["dim"], scale["tokens"]
    return {"table": v * d * 4, "ids": t * 4, "rows": t * d * 4}


def floor_bytes(scale: Mapping[str, Any]) -> int:
    """What a lookup must hold at the least: the table (once), the ids, the rows it returns.

    The floor of what the process holds (the resident figures of a real run). The
    compile-time totals have their own floor, `compiled_floor_bytes`.
    """
    return sum(sizes(scale).values())


def compiled_floor_bytes(variant: str, scale: Mapping[str, Any]) -> int:
    """The floor of `variant`'s compile-time total: the ids and the rows, and the table where
    it is an argument.

    A captured table is a constant of the program: `memory_analysis` leaves it out of the
    arguments, outputs and temporaries, so its total need not count it (a compiler may
    still copy it into a buffer of its own, which the total then counts).
    """
    s = sizes(scale)
    return s["ids"] + s["rows"] + (0 if variant.startswith("captured") else s["table"])


def _floor(variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    return compiled_floor_bytes(variant.name, scale)


CASE = Case(
    name="closure-constant",
    title="Arrays captured in a jitted closure become constants",
    symptom="a jitted function that closes over a large array takes far more host memory "
    "than the array, and memory_analysis does not show it",
    devices=1,
    scales={
        "seed": {"vocab": 32768, "dim": 1024, "tokens": 4096},
        "small": {"vocab": 4096, "dim": 512, "tokens": 1024},
        "tiny": {"vocab": 64, "dim": 16, "tokens": 32},
    },
    variants=(
        Variant(
            "captured-zeros",
            "baseline",
            "a table of zeros captured in the jitted lookup",
            _captured("zeros"),
            args=_ids_only,
        ),
        Variant(
            "captured-random",
            "reproduction",
            "a random table captured in the jitted lookup (make_lookup_captured)",
            _captured("random"),
            args=_ids_only,
        ),
        Variant(
            "embed",
            "fix",
            "recommended: the table passed as an argument (jax-ml/jax#10596)",
            lambda p: jax.jit(embed),
            args=_table_and_ids,
        ),
    ),
    args=_ids_only,
    grid=lambda s: [{"vocab": s["vocab"], "dim": s["dim"]}],
    floor=_floor,
    runnable_scale="seed",
    cause="a captured array is compiled into the program as a constant: the process holds "
    "copies of it that memory_analysis does not count",
    recommended="embed",
    figures="runbook.runs.closure_constant:host_figures",
    key_figure="rss_peak",
)
