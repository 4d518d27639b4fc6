"""`pmap-loop`: a Python loop inside a `jax.pmap`-ed function runs out of memory.

The user maps a function over 4 devices with ``in_axes=(0, None)``: each device gets its
slice of the index batch and the whole input array, and a Python ``for`` loop adds up an
expensive function of one row per iteration. The functions below are the reproduction
and its fixes; copy the one you need.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .. import _case_types
from .._case_types import Case, Variant
from ._setup import pmap_loop as _setup

DEVICES = _setup.DEVICES
ITERATIONS = (1, 2, 4, 8, 16, 32)


def expensive(row: jax.Array, width: int) -> jax.Array:
    """A row folded into a (rows, width) matrix, times its transpose: a real intermediate.

    The (rows, rows) product must be materialised before `tanh` and the sum can use it.
    """
    a = row.reshape(-1, width)
    return jnp.sum(jnp.tanh(a @ a.T))


def loop_sum(inds: jax.Array, inputs: jax.Array, width: int) -> jax.Array:
    """The reproduction's body: a Python loop, unrolled into one copy per iteration."""
    total = jnp.zeros((), inputs.dtype)
    for i in range(inds.shape[0]):
        total += expensive(inputs[inds[i]], width)
    return total


def fori_sum(inds: jax.Array, inputs: jax.Array, width: int) -> jax.Array:
    """The same sum as a rolled loop: one copy of the body, reused every iteration."""

    def body(i: jax.Array, total: jax.Array) -> jax.Array:
        return total + expensive(inputs[inds[i]], width)

    # zeros_like(an element) rather than zeros(()): inside shard_map the carry must vary
    # across devices like the values added to it.
    total: jax.Array = lax.fori_loop(0, inds.shape[0], body, jnp.zeros_like(inputs[0, 0]))
    return total


def map_sum(inds: jax.Array, inputs: jax.Array, width: int, batch_size: int = 4) -> jax.Array:
    """`lax.map` over the indices, `batch_size` rows at a time (a loop of small vmaps)."""
    values = lax.map(lambda i: expensive(inputs[i], width), inds, batch_size=batch_size)
    return jnp.sum(values)


def vmap_sum(inds: jax.Array, inputs: jax.Array, width: int) -> jax.Array:
    """The write-up's advice: `jax.vmap` over the iterations (all of them at once)."""
    return jnp.sum(jax.vmap(lambda i: expensive(inputs[i], width))(inds))


def pmapped(
    body: Callable[..., jax.Array],
    width: int,
    *,
    sharded: bool = False,
    devices: Sequence[jax.Device] | None = None,
) -> Callable[..., Any]:
    """``jax.pmap`` of `body`: the input replicated (``in_axes=None``) or split by rows."""
    in_axes = (0, 0 if sharded else None)
    mapped: Callable[..., Any] = jax.pmap(
        functools.partial(body, width=width), in_axes=in_axes, devices=devices
    )
    return mapped


def shard_mapped(
    body: Callable[[jax.Array, jax.Array, int], jax.Array], width: int, mesh: jax.sharding.Mesh
) -> jax.stages.Wrapped:
    """The recommended fix: `jax.jit` + `jax.shard_map` over `mesh`'s axis "d", rows
    sharded, loop rolled."""

    # inds: (1, k) local row numbers; rows: this device's rows
    def per_device(inds: jax.Array, rows: jax.Array) -> jax.Array:
        return body(inds[0], rows, width)[None]

    spec = P("d")
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec), out_specs=spec))


def _pmapped(body: Callable[..., jax.Array], *, sharded: bool = False) -> Callable[..., Any]:
    return pmapped(body, _WIDTH, sharded=sharded, devices=_case_types.devices(DEVICES))


# On CPU, jaxlib 0.10's YNNPACK fusion swallows the matrix product into a fused kernel
# whose scratch memory XLA's buffer assignment does not see. Switching it off makes the
# compile-time figures account for what the process really uses (see the pmap-loop page).
CPU_ACCOUNTING_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def options() -> dict[str, Any]:
    """The XLA options this case compiles with: the accounting fix on CPUs that have YNN."""
    if jax.default_backend() != "cpu":
        return {}
    try:
        jax.jit(lambda a: a).lower(1.0).compile(dict(CPU_ACCOUNTING_OPTIONS))
    except Exception:  # noqa: BLE001 - older jaxlib: no such option, and no such fusion
        return {}
    return dict(CPU_ACCOUNTING_OPTIONS)


_WIDTH = 256

CASE = Case(
    name="pmap-loop",
    title="A Python loop inside pmap: out of memory on every device",
    symptom="a pmap-ed function with a Python for loop runs out of memory on each device",
    devices=DEVICES,
    scales={
        "seed": {"rows": 128, "row": 2048 * _WIDTH, "width": _WIDTH},
        "small": {"rows": 128, "row": 1024 * _WIDTH, "width": _WIDTH},
        "tiny": {"rows": 16, "row": 16 * _WIDTH, "width": _WIDTH},
    },
    variants=(
        Variant(
            "serial",
            "baseline",
            "one device's share of the work, jit on a single device",
            lambda p: jax.jit(functools.partial(loop_sum, width=_WIDTH)),
            args=_setup.serial_args,
        ),
        Variant(
            "pmap-loop",
            "reproduction",
            "pmap, whole input replicated, Python for loop",
            lambda p: _pmapped(loop_sum),
        ),
        Variant(
            "pmap-fori",
            "fix",
            "pmap, whole input replicated, lax.fori_loop",
            lambda p: _pmapped(fori_sum),
        ),
        Variant(
            "pmap-map",
            "fix",
            "pmap, whole input replicated, lax.map(batch_size=4)",
            lambda p: _pmapped(map_sum),
            since="jax.lax.map(batch_size=)",
        ),
        Variant(
            "pmap-vmap",
            "fix",
            "pmap, whole input replicated, jax.vmap over iterations",
            lambda p: _pmapped(vmap_sum),
        ),
        Variant(
            "pmap-sharded",
            "fix",
            "pmap, input split by rows (in_axes=0), Python for loop",
            lambda p: _pmapped(loop_sum, sharded=True),
            args=_setup.sharded_pmap_args,
        ),
        Variant(
            "shard_map-fori",
            "fix",
            "recommended: jit + shard_map, input sharded by rows, lax.fori_loop",
            lambda p: shard_mapped(fori_sum, _WIDTH, _setup.mesh()),
            args=_setup.sharded_jit_args,
            since="jax.shard_map",
        ),
    ),
    args=_setup.replicated_args,
    grid=lambda scale: [{"iterations": k} for k in ITERATIONS if k <= scale["rows"] // DEVICES],
    floor=_setup.floor,
    options=options,
    tolerance=1e-4,
    cause="in_axes=None copies the whole input to every device, and the Python loop "
    "unrolls into one set of intermediates per iteration",
    recommended="shard_map-fori",
)
