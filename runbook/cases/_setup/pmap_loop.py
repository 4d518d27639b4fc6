"""The `pmap-loop` case's measurement setup: its devices, its inputs at each scale (placed
as each program takes them) and its floor. The programs are in `runbook.cases.pmap_loop`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ... import _case_types
from ..._case_types import Variant

DEVICES = 4


def _rows_per_device(scale: Mapping[str, Any]) -> int:
    rows: int = scale["rows"] // DEVICES
    return rows


def _local_indices(scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool) -> Any:
    k = params["iterations"]
    if not concrete:
        return jax.ShapeDtypeStruct((DEVICES, k), jnp.int32)
    rng = np.random.default_rng(0)
    return rng.integers(0, _rows_per_device(scale), size=(DEVICES, k)).astype(np.int32)


def _inputs(scale: Mapping[str, Any], concrete: bool) -> Any:
    shape = (scale["rows"], scale["row"])
    if not concrete:
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    rng = np.random.default_rng(1)
    return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(scale["row"])).astype(np.float32)


def mesh() -> jax.sharding.Mesh:
    """The case's devices in a mesh: this process's, or a target's when compiling for one."""
    return jax.sharding.Mesh(np.array(_case_types.devices(DEVICES)), ("d",))


def replicated_args(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[Any, Any]:
    """(global indices per device, the whole input): what the user passed to pmap."""
    local = _local_indices(scale, params, concrete)
    x = _inputs(scale, concrete)
    if not concrete:
        return local, x
    offsets = np.arange(DEVICES, dtype=np.int32)[:, None] * _rows_per_device(scale)
    # Placed as pmap will use them (indices split, input on every device), so that a real
    # run measures the program rather than a staging copy made at call time.
    device_mesh = mesh()
    inds = jax.device_put(local + offsets, NamedSharding(device_mesh, P("d")))
    return inds, jax.device_put(x, NamedSharding(device_mesh, P()))


def sharded_pmap_args(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[Any, Any]:
    """(local indices, inputs split into a (devices, rows/devices, row) stack)."""
    inds = _local_indices(scale, params, concrete)
    shape = (DEVICES, _rows_per_device(scale), scale["row"])
    if not concrete:
        return inds, jax.ShapeDtypeStruct(shape, jnp.float32)
    sharding = NamedSharding(mesh(), P("d"))
    return jax.device_put(inds, sharding), jax.device_put(
        _inputs(scale, True).reshape(shape), sharding
    )


def sharded_jit_args(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[Any, Any]:
    """(local indices, the whole input), both sharded over devices along their first axis."""
    sharding = NamedSharding(mesh(), P("d"))
    inds, x = _local_indices(scale, params, concrete), _inputs(scale, concrete)
    if not concrete:
        return (
            jax.ShapeDtypeStruct(inds.shape, inds.dtype, sharding=sharding),
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        )
    return jax.device_put(inds, sharding), jax.device_put(x, sharding)


def serial_args(
    scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool
) -> tuple[Any, Any]:
    """One device's share of the work: its indices and the whole input."""
    if not concrete:
        inds, x = replicated_args(scale, params, False)
        return jax.ShapeDtypeStruct(inds.shape[1:], inds.dtype), x
    return jnp.asarray(_local_indices(scale, params, True)[0]), jnp.asarray(_inputs(scale, True))


def product_bytes(scale: Mapping[str, Any]) -> int:
    """One iteration's (rows, rows) product in `expensive`."""
    product: int = (scale["row"] // scale["width"]) ** 2 * 4
    return product


def floor_bytes(variant: str, scale: Mapping[str, Any], iterations: int, platform: str) -> int:
    """Per device: the input it holds, its indices and output, and on CPU and GPU one
    iteration's product.

    XLA's TPU compiler fuses the product into the `tanh` and the sum that read it, tile by
    tile: the product is never written to memory there, so the TPU floor leaves it out.
    """
    rows: int = scale["rows"] if variant in _REPLICATED else _rows_per_device(scale)
    row: int = scale["row"]
    inputs = rows * row * 4
    indices = iterations * 4
    output = 4
    product = 0 if platform == "tpu" else product_bytes(scale)
    return inputs + indices + output + product


def floor(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any], platform: str
) -> int:
    """The case's `floor=`: `floor_bytes` at the point of the sweep measured."""
    return floor_bytes(variant.name, scale, params["iterations"], platform)


_REPLICATED = {"serial", "pmap-loop", "pmap-fori", "pmap-map", "pmap-vmap"}
