"""`frozen-params`'s measurement setup: the parameters and batch at each scale, the
arguments of each variant, the sizes and the floor. The reproduction and its fixes are in
`runbook.cases.frozen_params`, which passes in what this needs of it (its optimizers)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._case_types import Variant

Params = dict[str, dict[str, jax.Array]]


def params(scale: Mapping[str, Any], concrete: bool) -> Params:
    layers, width, rank = scale["layers"], scale["width"], scale["rank"]
    shapes = {"frozen": {"w": (layers, width, width)}, "lora": {"a": (layers, width, rank)}}
    shapes["lora"]["b"] = (layers, rank, width)
    if not concrete:
        abstract: Params = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=_is_shape
        )
        return abstract
    rng = np.random.default_rng(0)
    scales = {"w": 1 / np.sqrt(width), "a": 1 / np.sqrt(width), "b": 1 / np.sqrt(rank)}
    return {
        group: {
            k: jnp.asarray(scales[k] * rng.standard_normal(s, dtype=np.float32))
            for k, s in tree.items()
        }
        for group, tree in shapes.items()
    }


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def batch(scale: Mapping[str, Any], concrete: bool) -> tuple[Any, Any]:
    shape = (scale["tokens"], scale["width"])
    if not concrete:
        return jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.float32)
    rng = np.random.default_rng(1)
    return (
        jnp.asarray(rng.standard_normal(shape, dtype=np.float32)),
        jnp.asarray(0.5 * rng.standard_normal(shape, dtype=np.float32)),
    )


def _opt_state(init: Callable[[Any], Any], params: Any, concrete: bool) -> Any:
    return init(params) if concrete else jax.eval_shape(init, params)


def inputs(
    optimizer_of: Callable[[Params], tuple[Callable[[Any], Any], Any]],
) -> Callable[[Mapping[str, Any], Mapping[str, Any], bool], tuple[Any, ...]]:
    """Args for a variant: ``(params, x, y)``, or ``(params, opt_state, x, y)`` for steps."""

    def args(scale: Mapping[str, Any], p: Mapping[str, Any], concrete: bool) -> tuple[Any, ...]:
        tree = params(scale, concrete)
        x, y = batch(scale, concrete)
        if p["program"] == "gradient":
            return tree, x, y
        init, target = optimizer_of(tree)
        return tree, _opt_state(init, target, concrete), x, y

    return args


def comparable(result: Any) -> Any:
    """What the same-result check compares: the loss, the adapters' gradients or new params.

    Gradient programs return ``(loss, gradients)``, whole-tree or adapters only; train
    steps return ``(params, optimizer state, loss)``, whose optimizer states differ in
    structure between variants (the new parameters depend on them).
    """
    if len(result) == 3:
        new_params, _, value = result
        return new_params, value
    value, grads = result
    return value, grads.get("lora", grads)


def loss_inputs(scale: Mapping[str, Any], p: Mapping[str, Any], concrete: bool) -> tuple[Any, ...]:
    return (params(scale, concrete), *batch(scale, concrete))


def sizes(scale: Mapping[str, Any]) -> dict[str, int]:
    layers, width, rank, tokens = (scale[k] for k in ("layers", "width", "rank", "tokens"))
    return {
        "frozen": layers * width * width * 4,
        "adapters": 2 * layers * width * rank * 4,
        "batch": 2 * tokens * width * 4,
        "carry": tokens * width * 4,
        "layers": layers,
    }


def floor_bytes(program: str, scale: Mapping[str, Any], offloaded: bool = False) -> int:
    """What a gradient or train step of the adapters must hold, at the least.

    The weights and the batch; the adapters' gradients (and, for a train step, Adam's two
    moments of the adapters); the loss; and one activation per layer: the backward pass of
    layer ``l`` needs its input ``h_l`` and its output ``h_(l+1)`` (for ``tanh``'s
    derivative), so ``h_1 ... h_L`` beside the batch's ``h_0``, stored or recomputed, in
    device memory unless `offloaded` to the host's. A train step's new parameters and state
    reuse the donated buffers.
    """
    s = sizes(scale)
    held = s["frozen"] + s["adapters"] + s["batch"] + 4
    if program == "train step":
        held += 2 * s["adapters"]
    return held + s["adapters"] + (0 if offloaded else s["layers"] * s["carry"])


def floor(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any], platform: str
) -> int:
    """The case's floor; `trainable-offload` keeps its activations in the host's memory,
    except on CPU, where XLA has one memory."""
    if variant.role == "baseline":
        s = sizes(scale)
        return s["frozen"] + s["adapters"] + s["batch"] + 4
    offloaded = variant.name == "trainable-offload" and platform != "cpu"
    return floor_bytes(params["program"], scale, offloaded)
