"""`resharding`: activations and logits that the partitioner computes whole on every device.

A language model trained with FSDP on one mesh axis splits its batch over that axis and,
to hold each device's share of the weights, one axis of every weight too: the embedding's
and the projections' model dimension. Nothing in the step says how to split what the layers
compute. The embedding lookup returns its table's sharding, split on the model dimension,
so the batch dimension cannot be split on the same axis; every product that follows sums
over the split dimension and leaves each device the whole global batch's activations, and
the logits after them. A `jax.lax.with_sharding_constraint` of the activations to the
batch axis tells the partitioner what to split instead. Reports: jax-ml/jax#21562,
openxla/xla#15207, jax-ml/jax#14075, #25010, #16679 (cited by the issue commissioning this
case). The functions below are the reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._case_types import Case, Variant
from ._setup import resharding as _setup

DEVICES = 8
AXIS = "data"  # the mesh's one axis: it splits the batch and one axis of every weight
LEARNING_RATE = 1e-2

Params = dict[str, jax.Array]  # {"embed": (vocab, width), "up": (layers, width, hidden),
#                                 "down": (layers, hidden, width)}


def block(x: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """One residual MLP layer: ``x + gelu(x @ up) @ down``."""
    return x + jax.nn.gelu(x @ up) @ down


def loss(
    params: Params,
    tokens: jax.Array,
    labels: jax.Array,
    pin: Callable[[jax.Array], jax.Array] | None = None,
    pin_every_layer: bool = True,
    remat: bool = False,
) -> jax.Array:
    """Next-token cross-entropy of a tied-embedding MLP language model.

    `pin` (None: nothing) is applied to the embedded tokens and, with `pin_every_layer`,
    to each layer's output and to the logits. With `remat`, each layer is a
    `jax.checkpoint`: its backward pass recomputes it from its input.
    """
    same = lambda x: x
    first = pin or same
    every = pin if pin is not None and pin_every_layer else same
    layer = jax.checkpoint(block) if remat else block
    x = first(params["embed"][tokens])
    for i in range(params["up"].shape[0]):
        x = every(layer(x, params["up"][i], params["down"][i]))
    logits = every(x @ params["embed"].T)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def activations_on(mesh: Mesh, axis: str = AXIS) -> Callable[[jax.Array], jax.Array]:
    """The fix: pin a value's leading (batch) dimension to `axis`, the rest whole.

    ``jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(axis)))``: each device
    computes its share of the batch, and the partitioner gathers each layer's weights
    instead of the activations (FSDP as meant).
    """
    sharding = NamedSharding(mesh, P(axis))

    def pin(x: jax.Array) -> jax.Array:
        out: jax.Array = jax.lax.with_sharding_constraint(x, sharding)
        return out

    return pin


def fsdp(mesh: Mesh, axis: str = AXIS) -> dict[str, NamedSharding]:
    """Where the parameters live: each weight's model dimension split over `axis` (the
    embedding's columns, the up projections' rows, the down projections' columns)."""
    return {
        "embed": NamedSharding(mesh, P(None, axis)),
        "up": NamedSharding(mesh, P(None, axis, None)),
        "down": NamedSharding(mesh, P(None, None, axis)),
    }


def train_step(mesh: Mesh, constrain: str | None = None, remat: bool = False) -> jax.stages.Wrapped:
    """One SGD step on the FSDP mesh, jitted with in- and out-shardings that agree and the
    parameters donated.

    `constrain`: None (the reproduction: nothing says how to split the activations),
    ``"embedding"`` (the embedded tokens only) or ``"every"`` (the embedded tokens, each
    layer's output and the logits).
    """
    pin = activations_on(mesh) if constrain else None

    def step(params: Params, tokens: jax.Array, labels: jax.Array) -> tuple[Params, jax.Array]:
        value, grads = jax.value_and_grad(loss)(
            params, tokens, labels, pin, constrain == "every", remat
        )
        new = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
        return new, value

    params, batch = fsdp(mesh), NamedSharding(mesh, P(AXIS))
    return jax.jit(
        step,
        in_shardings=(params, batch, batch),
        out_shardings=(params, NamedSharding(mesh, P())),
        donate_argnums=0,
    )


def init(key: jax.Array, vocab: int, width: int, hidden: int, layers: int) -> Params:
    """Scaled normal weights."""
    k = jax.random.split(key, 3)

    def normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        out: jax.Array = jax.random.normal(key, shape) / np.sqrt(fan_in)
        return out

    return {
        "embed": normal(k[0], (vocab, width), width),
        "up": normal(k[1], (layers, width, hidden), width),
        "down": normal(k[2], (layers, hidden, width), hidden),
    }


def _program(constrain: str | None, remat: bool) -> Callable[[Mapping[str, Any]], Any]:
    return lambda params: train_step(_setup.mesh(DEVICES, AXIS), constrain, remat)


CASE = Case(
    name="resharding",
    title="Activations and logits computed whole on every device",
    symptom="an FSDP train step runs out of memory on each device, and holds about what one "
    "device would hold for the whole global batch",
    devices=DEVICES,
    scales=_setup.SCALES,
    variants=(
        Variant(
            "unconstrained",
            "reproduction",
            "weights split on their model dimension, batch split, activations unconstrained",
            _program(None, False),
        ),
        Variant(
            "constrain-embedding",
            "fix",
            "with_sharding_constraint of the embedded tokens to P('data') only",
            _program("embedding", False),
        ),
        Variant(
            "constrain-every",
            "fix",
            "the embedded tokens, each layer's output and the logits pinned to P('data')",
            _program("every", False),
        ),
        Variant(
            "constrain-remat",
            "fix",
            "recommended: every value pinned, each layer under jax.checkpoint",
            _program("every", True),
        ),
    ),
    args=_setup.args(init, fsdp, DEVICES, AXIS),
    grid=_setup.grid,
    floor=_setup.floor(DEVICES),
    tolerance=_setup.TOLERANCE,
    runnable_scale="small",
    cause="the embedding's model dimension and the batch are split on the same mesh axis, "
    "and nothing pins the activations: the partitioner keeps the model dimension split and "
    "computes the whole global batch on every device",
    recommended="constrain-remat",
    compare=_setup.compare,
)
