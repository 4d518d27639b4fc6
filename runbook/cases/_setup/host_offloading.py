"""`host-offloading`'s measurement setup: the scales, the inputs of each variant and the floor.
The layer stack, its policies and the host-weights step are in `runbook.cases.host_offloading`,
which passes in what this needs of them (where the host-weights step takes its weights)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._case_types import Variant, devices

Args = Callable[[Mapping[str, Any], Mapping[str, Any], bool], tuple[Any, ...]]

# bfloat16 throughout, as such stacks are trained. "seed": the shape, 8 sequences of
# 2048 tokens at width 4096, up to 24 layers; the MLP is as wide as the model (the issue
# names no MLP width). Each seed program compiles in seconds on every target.
SCALES: dict[str, dict[str, Any]] = {
    "seed": {"batch": 8, "tokens": 2048, "hidden": 4096, "mlp": 4096, "layers": (6, 12, 24)},
    "small": {"batch": 2, "tokens": 64, "hidden": 128, "mlp": 256, "layers": (4,)},
    "tiny": {"batch": 1, "tokens": 8, "hidden": 16, "mlp": 32, "layers": (2,)},
}
DTYPE = jnp.bfloat16
ITEM = 2  # bytes of one bfloat16

# The fixes compute the same products as the reproduction, recomputed or copied back: their
# gradients were bit-identical to it on XLA:CPU (jax 0.10.2, 0.12.0.1) and on an H100 (jax
# 0.11.2). The tolerance, about two bfloat16 roundings, leaves room for a compiler that fuses
# a recomputed layer differently; the loss is scaled so the gradients are of order one.
TOLERANCE = 1e-2


def grid(scale: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"layers": n} for n in scale["layers"]]


def _shapes(
    scale: Mapping[str, Any], layers: int
) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...]]:
    d: int = scale["hidden"]
    f: int = scale["mlp"]
    weights: dict[str, tuple[int, ...]] = {"up": (layers, d, f), "down": (layers, f, d)}
    return weights, (int(scale["batch"]), int(scale["tokens"]), d)


def args(scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool) -> tuple[Any, Any]:
    """``(weights, x)``: the stacked weights and a batch of token activations."""
    shapes, x_shape = _shapes(scale, params["layers"])
    if not concrete:
        abstract = {k: jax.ShapeDtypeStruct(s, DTYPE) for k, s in shapes.items()}
        return abstract, jax.ShapeDtypeStruct(x_shape, DTYPE)
    rng = np.random.default_rng(0)
    d, f = scale["hidden"], scale["mlp"]
    init = {"up": 1 / np.sqrt(d), "down": 1 / np.sqrt(f)}
    weights = {
        k: jnp.asarray(init[k] * rng.standard_normal(s, dtype=np.float32), DTYPE)
        for k, s in shapes.items()
    }
    x = jnp.asarray(rng.standard_normal(x_shape, dtype=np.float32), DTYPE)
    return weights, x


def host_weight_args(host_sharding: Callable[[Any], Any]) -> Args:
    """The host-weights step's inputs: the weights in the host memory that
    `host_sharding(device)` names, abstract or real; the batch as `args` gives it."""

    def inputs(scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool) -> Any:
        weights, x = args(scale, params, concrete)
        host = host_sharding(devices(1)[0])
        if concrete:
            return jax.device_put(weights, host), x
        placed = {
            k: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=host) for k, w in weights.items()
        }
        return placed, x

    return inputs


def no_host_memory(platform: str) -> str | None:
    """Why the host-weights step cannot be measured for `platform` here, or None."""
    if platform == "cuda":
        return (
            "JAX's compile-only GPU devices list no memories, so the pinned_host placement "
            "of the weights is dropped and the GPU compiler sees them on the device"
        )
    return None


# Per layer, what a strategy must keep on the device for the backward pass, in activations
# of (batch, tokens, width): each layer's input (the first is the argument x itself, so one
# fewer) and the product h @ up. Offloaded values are on the host, not counted.
_SAVED: dict[str, tuple[bool, bool]] = {  # (layer inputs, products)
    "forward": (False, False),
    "save-all": (True, True),
    "offload-output": (True, False),
    "remat": (True, False),
    "save-dots": (True, True),
    "offload-dots": (True, False),
    "offload-input": (False, False),
    "host-weights": (False, False),
}


def floor_bytes(variant: str, scale: Mapping[str, Any], layers: int, platform: str) -> int:
    """Device bytes every compiler must hold at the least.

    The inputs and outputs on the device (the host-weights step keeps its weights and
    gradients in host memory), plus the saved activations `_SAVED` lists, except on the
    TPU: XLA's TPU compiler does not count a scan's saved stacks in the temporaries it
    reports at small sizes (the measuring page), so its floor is the inputs and outputs.
    """
    b, t, d, f = (int(scale[k]) for k in ("batch", "tokens", "hidden", "mlp"))
    weights = 2 * layers * d * f * ITEM
    x = b * t * d * ITEM
    on_host = variant == "host-weights"
    arguments = x + (0 if on_host else weights)
    outputs = 4 + (0 if variant == "forward" or on_host else weights)
    inputs_saved, products_saved = _SAVED[variant]
    saved = 0
    if platform != "tpu":
        saved += (layers - 1) * b * t * d * ITEM if inputs_saved else 0
        saved += layers * b * t * f * ITEM if products_saved else 0
    return arguments + outputs + saved


def floor(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any], platform: str
) -> int:
    return floor_bytes(variant.name, scale, params["layers"], platform)
