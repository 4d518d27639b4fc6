"""`resharding`'s measurement setup: the scales, the mesh, the inputs, the floor and what the
same-result check compares. The case passes in what these need of it (`init`, where the
parameters live, its devices and mesh axis): this module imports no case."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import _case_types
from ..._case_types import Variant

# float32 throughout. "seed": an FSDP language-model step of the size nanodo's default
# configuration trains (512 tokens a sequence, global batch 256 over 8 devices, width 512,
# MLP 2,048, 6 layers), with a 4,096-token vocabulary so that the activations, not the
# logits, are what the fix divides.
SCALES: dict[str, dict[str, int]] = {
    "seed": {"vocab": 4096, "width": 512, "hidden": 2048, "layers": 6, "batch": 256, "length": 512},
    "small": {"vocab": 256, "width": 64, "hidden": 128, "layers": 2, "batch": 16, "length": 32},
    "tiny": {"vocab": 64, "width": 16, "hidden": 32, "layers": 2, "batch": 8, "length": 8},
}
ITEM = 4  # bytes of one float32
# The fixes compute the same sums split differently: the partial sums add up in another
# order, so the new parameters agree to float32 rounding, not bit for bit.
TOLERANCE = 1e-4


def grid(scale: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{}]


def mesh(devices: int, axis: str) -> Mesh:
    """The case's devices: this process's, or a target's when compiling for one."""
    return Mesh(np.array(_case_types.devices(devices)), (axis,))


def _shapes(scale: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    v, d, f, n = (int(scale[k]) for k in ("vocab", "width", "hidden", "layers"))
    return {"embed": (v, d), "up": (n, d, f), "down": (n, f, d)}


def args(
    init: Callable[..., dict[str, jax.Array]],
    place: Callable[[Mesh], dict[str, NamedSharding]],
    devices: int,
    axis: str,
) -> Callable[[Mapping[str, Any], Mapping[str, Any], bool], tuple[Any, ...]]:
    """``(params, tokens, labels)`` placed as the step takes them: shapes, or seeded
    arrays when `concrete`."""

    def make(scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool) -> Any:
        m = mesh(devices, axis)
        shardings, batch = place(m), NamedSharding(m, P(axis))
        tokens_shape = (int(scale["batch"]), int(scale["length"]))
        if not concrete:
            weights = {
                k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=shardings[k])
                for k, s in _shapes(scale).items()
            }
            token = jax.ShapeDtypeStruct(tokens_shape, jnp.int32, sharding=batch)
            return weights, token, token
        sizes = (int(scale[k]) for k in ("vocab", "width", "hidden", "layers"))
        weights = jax.device_put(init(jax.random.key(0), *sizes), shardings)
        rng = np.random.default_rng(0)
        text = rng.integers(0, int(scale["vocab"]), (tokens_shape[0], tokens_shape[1] + 1))
        tokens, labels = (
            jax.device_put(t.astype(np.int32), batch) for t in (text[:, :-1], text[:, 1:])
        )
        return weights, tokens, labels

    return make


def floor_bytes(scale: Mapping[str, Any], devices: int) -> int:
    """Per device, what every variant's step must hold at the least, with its share of the
    batch.

    Its share of the parameters (donated: the new ones may take their place) and of the
    tokens and labels; its share of the logits, once; and what the backward pass reads
    that no variant recomputes: each layer's input (a checkpointed layer recomputes the
    rest from it), and one layer's product ``x @ up``.
    """
    v, d, f, n, b, t = (
        int(scale[k]) for k in ("vocab", "width", "hidden", "layers", "batch", "length")
    )
    tokens = b * t // devices
    params = (v * d + 2 * n * d * f) * ITEM // devices
    batch = 2 * tokens * 4
    logits = tokens * v * ITEM
    saved = n * tokens * d * ITEM + tokens * f * ITEM
    return params + batch + logits + saved


def floor(devices: int) -> Callable[[Variant, Mapping[str, Any], Mapping[str, Any]], int]:
    """The case's `Case.floor` on `devices` devices."""
    return lambda variant, scale, params: floor_bytes(scale, devices)


def compare(result: Any) -> Any:
    """The new parameters and the loss, gathered to this process."""
    new, value = result
    return {k: np.asarray(w) for k, w in new.items()}, np.asarray(value)
