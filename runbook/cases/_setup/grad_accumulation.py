"""`grad-accumulation`'s measurement setup: the scales, each variant's inputs, how the
MultiSteps fix is run for the same-result check, and the floor. The steps and optimizers are
in `runbook.cases.grad_accumulation`, which passes in what this needs of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Args = Callable[[Mapping[str, Any], Mapping[str, Any], bool], tuple[Any, ...]]

# float32 throughout. "seed": eight layers of 4,096 (512 MiB of weights, 1 GiB of Adam's
# moments) and batches of up to 32,768 rows (512 MiB each activation of the whole batch),
# split into 8 micro-batches: the whole batch's activations outweigh the parameters and the
# optimizer state together, as in the reports. Each program compiles in seconds.
SCALES: dict[str, dict[str, Any]] = {
    "seed": {"layers": 8, "width": 4096, "batch": (8192, 16384, 32768), "micro_batches": 8},
    "small": {"layers": 3, "width": 64, "batch": (64,), "micro_batches": 4},
    "tiny": {"layers": 2, "width": 16, "batch": (16,), "micro_batches": 4},
}
ITEM = 4  # bytes of one float32

# The fixes sum the same gradients in another order (float32), or round each micro-batch's
# to bfloat16 first. Measured at the tiny and small scales (jax 0.12.0.1, XLA:CPU, the
# updated parameters and Adam's moments): float32 accumulators within 1e-8 of the whole
# batch's step, the bfloat16 one within 3e-4; a sum never divided by the number of
# micro-batches is 0.07 to 0.18 off.
TOLERANCE = 1e-3


def grid(scale: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"batch": b, "micro_batches": scale["micro_batches"]} for b in scale["batch"]]


def _arrays(scale: Mapping[str, Any], rows: int, concrete: bool) -> tuple[list[Any], Any]:
    layers, width = scale["layers"], scale["width"]
    if not concrete:
        w = jax.ShapeDtypeStruct((width, width), jnp.float32)
        return [w] * layers, jax.ShapeDtypeStruct((rows, width), jnp.float32)
    rng = np.random.default_rng(0)
    params = [
        jnp.asarray(rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width))
        for _ in range(layers)
    ]
    return params, jnp.asarray(rng.standard_normal((rows, width), dtype=np.float32))


def inputs(init: Callable[[Any], Any], part: bool = False) -> Args:
    """``(params, opt_state, x)``: the state `init` makes for the parameters, and the whole
    batch, or (`part`) its first micro-batch."""

    def args(scale: Mapping[str, Any], params: Mapping[str, Any], concrete: bool) -> Any:
        rows = params["batch"] // (params["micro_batches"] if part else 1)
        weights, x = _arrays(scale, params["batch"], concrete)
        if concrete:
            return weights, init(weights), x[:rows]
        return (
            weights,
            jax.eval_shape(init, weights),
            jax.ShapeDtypeStruct((rows, x.shape[1]), x.dtype),
        )

    return args


def per_micro_batch(
    multisteps: Callable[[int], Any],
) -> Callable[[Callable[..., Any], Mapping[str, Any], Mapping[str, Any]], Any]:
    """How the MultiSteps fix makes one update: its compiled step called on each
    micro-batch of the whole batch in turn, from the state `multisteps(k).init` makes."""

    def run(step: Callable[..., Any], scale: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        k = params["micro_batches"]
        weights, x = _arrays(scale, params["batch"], True)
        state = multisteps(k).init(weights)
        value = None
        for part in jnp.split(x, k):
            weights, state, value = step(weights, state, part)
        return weights, state, value

    return run


def floor_bytes(variant: str, scale: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    """Bytes every compiler must hold at the least: the arguments (the parameters, Adam's
    two moments, MultiSteps' accumulator where it wraps Adam, the rows the step takes), the
    loss (the rest of the outputs are donated back into the arguments), and what the
    backward pass reads of the rows in flight (every layer's output but the last, for one
    micro-batch where the step takes or scans micro-batches), plus the scan's accumulator."""
    layers, width = int(scale["layers"]), int(scale["width"])
    batch, k = int(params["batch"]), int(params["micro_batches"])
    weights = layers * width * width * ITEM
    taken = batch // k if variant in ("micro-batch", "multisteps") else batch
    in_flight = batch if variant in ("full-batch", "multisteps-every-1") else batch // k
    arguments = 3 * weights + taken * width * ITEM
    if variant.startswith("multisteps"):
        arguments += weights  # the accumulator
    accumulator = {"scan-f32": weights, "scan-bf16": weights // 2}.get(variant, 0)
    saved = (layers - 1) * in_flight * width * ITEM
    return arguments + 4 + saved + accumulator


def floor(variant: Any, scale: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    return floor_bytes(variant.name, scale, params)
