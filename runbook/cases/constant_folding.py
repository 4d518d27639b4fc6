"""`constant-folding`: a large array built inside `jit` from no argument is folded on the host.

A jitted function that builds a large array from nothing it is given (`jnp.ones`, an
in-place update, a reduction: no argument feeds its values) hands XLA a computation whose
result is known before any call. XLA's constant-folding pass then evaluates it while
compiling, on the host, one element at a time with its slow interpreter, and compiles the
result into the executable as a constant. Compiling takes seconds to minutes, the host holds
the intermediate arrays meanwhile, and XLA may log "Constant folding an instruction is
taking > 1s". `memory_analysis()` counts none of it. Reports: jax-ml/jax#14655, #12789,
#21300, #18475, #19653, #677. The functions below are the reproduction and its fixes; copy
the one you need. Their real runs (a compile and run in a fresh process) are in
`runbook.runs.constant_folding`; the page's measurements in `runbook.site.constant_folding`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._case_types import Case, Variant

TERMS = 4  # terms summed per entry of the table


def make_table(base: jax.Array) -> jax.Array:
    """A (rows, cols) table from a (rows, cols, terms) `base`: its first row of terms set
    to 2, then each entry the sum of its terms (an in-place update and a reduction, the
    way a user builds a table)."""
    edited = base.at[0, :, :].set(2.0)
    return edited.sum(axis=-1)


def table_inside_jit(x: jax.Array) -> jax.Array:
    """The reproduction: `x` scaled by a table built inside the jitted function.

    The table's values come from `jnp.ones`, not from `x` (only its shape does): XLA knows
    them before any call and folds the whole table while compiling. Use it as
    ``jax.jit(table_inside_jit)(x)``.
    """
    return x * make_table(jnp.ones((*x.shape, TERMS), x.dtype))


def table_from_argument(x: jax.Array, start: jax.Array) -> jax.Array:
    """The fix: the table's values depend on an argument, so nothing is left to fold.

    `start` fills the table's base (pass ``1.0`` for the reproduction's table); XLA cannot
    know it while compiling, so the table is computed on the device at each call. Use it
    as ``jax.jit(table_from_argument)(x, jnp.float32(1.0))``.
    """
    return x * make_table(jnp.full((*x.shape, TERMS), start, x.dtype))


NO_CONSTANT_FOLDING = {"xla_disable_hlo_passes": "constant_folding"}


def jit_without_constant_folding(fn: Callable[..., Any]) -> jax.stages.Wrapped:
    """The other fix: `jax.jit(fn)` with XLA's constant-folding pass switched off for this
    function only (its other programs keep it); the table is then computed at each call."""
    return jax.jit(fn, compiler_options={"xla_disable_hlo_passes": "constant_folding"})


def table_bytes(scale: Mapping[str, Any]) -> int:
    """Bytes of the table (and of `x`, and of the output) at `scale`: float32."""
    return int(scale["rows"] * scale["cols"] * 4)


def base_bytes(scale: Mapping[str, Any]) -> int:
    """Bytes of the table's base, `TERMS` values per entry: float32."""
    return table_bytes(scale) * TERMS


def _x(scale: Mapping[str, Any], concrete: bool) -> Any:
    shape = (scale["rows"], scale["cols"])
    if not concrete:
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


def _x_only(scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool) -> tuple[Any]:
    return (_x(scale, concrete),)


def _x_and_start(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[Any, Any]:
    start = jnp.float32(1.0) if concrete else jax.ShapeDtypeStruct((), jnp.float32)
    return _x(scale, concrete), start


def floor_bytes(scale: Mapping[str, Any]) -> int:
    """What any variant must hold at run time at the least: `x` and the output. A variant
    that computes the table at run time can compute each entry where it scales `x` (fused),
    holding no table; a folded table is a constant, which no run-time total counts."""
    return 2 * table_bytes(scale)


def _floor(variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    return floor_bytes(scale)


CASE = Case(
    name="constant-folding",
    title="Arrays built inside jit from no argument are folded while compiling",
    symptom="compiling a jitted function takes seconds to minutes and the host's memory "
    "grows while it compiles; XLA logs 'Constant folding an instruction is taking > 1s'",
    devices=1,
    scales={
        "seed": {"rows": 2048, "cols": 4096},
        "small": {"rows": 256, "cols": 4096},
        "tiny": {"rows": 16, "cols": 256},
    },
    variants=(
        Variant(
            "table-inside-jit",
            "reproduction",
            "a table built from jnp.ones inside the jitted function (table_inside_jit)",
            lambda p: jax.jit(table_inside_jit),
            args=_x_only,
        ),
        Variant(
            "table-from-argument",
            "fix",
            "recommended: the table's values depend on an argument (table_from_argument)",
            lambda p: jax.jit(table_from_argument),
            args=_x_and_start,
        ),
        Variant(
            "no-constant-folding",
            "fix",
            "the reproduction compiled with XLA's constant folding off "
            "(jit_without_constant_folding)",
            lambda p: jit_without_constant_folding(table_inside_jit),
            since="jax.jit(compiler_options=)",
            args=_x_only,
        ),
    ),
    args=_x_only,
    grid=lambda s: [{"rows": s["rows"], "cols": s["cols"]}],
    floor=_floor,
    runnable_scale="seed",
    cause="a table whose values depend on no argument is a constant computation: XLA "
    "evaluates it on the host while compiling and compiles the result in as a constant",
    recommended="table-from-argument",
    figures="runbook.runs.constant_folding:run_figures",
    key_figure="compile_seconds",
    runtime=True,
)
