"""Measurement setup of `sharding-replicated`: the mesh, the state's shapes and the batch at
each scale, the `Variant` programs and inputs built from them, and what the same-result
check compares. The case passes in what of it these need (its devices, mesh axis,
optimizer, `init` and `jit_step`): this module imports no case."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import _case_types
from ..._case_types import Params

Place = Callable[[Mesh, Any], Any]


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def batch(scale: Mapping[str, Any], concrete: bool) -> tuple[Any, Any]:
    """The batch (x, y): their shapes, or seeded arrays when `concrete`."""
    shape = (scale["batch"], scale["width"])
    if not concrete:
        return jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.float32)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape, dtype=np.float32)
    return x, np.tanh(rng.standard_normal(shape, dtype=np.float32))


def as_stacked(result: Any) -> Any:
    """What the same-result check compares: new parameters stacked, and the loss."""
    params, _, loss = result
    return np.stack(params) if isinstance(params, list) else np.asarray(params), np.asarray(loss)


@dataclass(frozen=True)
class Inputs:
    """The case's programs and inputs per scale, from what the case passes in."""

    devices: int
    axis: str
    optimizer: Callable[[], optax.GradientTransformation]
    init: Callable[[jax.Array, int, int], tuple[list[jax.Array], Any]]
    jit_step: Callable[[Callable[..., Any], Mesh, tuple[Any, Any]], Any]

    def mesh(self) -> Mesh:
        """The case's devices: this process's, or a target's when compiling for one."""
        return Mesh(np.array(_case_types.devices(self.devices)), (self.axis,))

    def state_shapes(self, scale: Mapping[str, Any], stacked: bool) -> tuple[Any, Any]:
        layers, width = scale["layers"], scale["width"]
        if stacked:
            params: Any = jax.ShapeDtypeStruct((layers, width, width), jnp.float32)
        else:
            params = [jax.ShapeDtypeStruct((width, width), jnp.float32) for _ in range(layers)]
        return params, jax.eval_shape(self.optimizer().init, params)

    def args(self, place: Place, stacked: bool) -> Callable[..., tuple[Any, ...]]:
        def args(scale: Mapping[str, Any], params: Params, concrete: bool) -> tuple[Any, ...]:
            mesh = self.mesh()
            data = NamedSharding(mesh, P(self.axis))
            shapes = self.state_shapes(scale, stacked)
            shardings = tuple(place(mesh, s) for s in shapes)
            x, y = batch(scale, concrete)
            if not concrete:
                return (
                    *(_abstract(s, sh) for s, sh in zip(shapes, shardings, strict=True)),
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=data),
                    jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=data),
                )
            listed, opt_state = self.init(jax.random.key(0), scale["layers"], scale["width"])
            layers: Any = listed
            if stacked:
                layers = jnp.stack(listed)
                opt_state = self.optimizer().init(layers)
            state = jax.device_put((layers, opt_state), shardings)
            return (*state, jax.device_put(x, data), jax.device_put(y, data))

        return args

    def program(
        self, step: Callable[..., Any], place: Place, stacked: bool
    ) -> Callable[[Params], Callable[..., Any]]:
        def program(params: Params) -> Callable[..., Any]:
            mesh = self.mesh()
            shapes = self.state_shapes(params, stacked)
            shardings = (place(mesh, shapes[0]), place(mesh, shapes[1]))
            fn: Callable[..., Any] = self.jit_step(step, mesh, shardings)
            return fn

        return program
