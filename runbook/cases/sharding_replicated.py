"""`sharding-replicated`: a train step whose parameters and optimizer state sit whole on
every device.

A model trained on a mesh of devices, its batch split over them (data parallelism), keeps
its parameters and Adam's two moments replicated: every device holds all of them. Sharding
them over the mesh (FSDP) divides that by the number of devices, but the compiled step then
gathers each layer's weights back for the forward and the backward pass; unless the
layers run one at a time (`lax.scan` over stacked layers, `jax.checkpoint` on the body),
the gathered weights of every layer are alive together. Reports: jax-ml/jax#14075,
#16679, #18263, #19893, #26946. The functions below are the reproduction and its fixes;
copy the one you need.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._case_types import Case, Params, Variant
from ._setup import sharding_replicated as _setup

DEVICES = 8
AXIS = "fsdp"  # the mesh's one axis: the batch and (in the fixes) the parameters split on it
LEARNING_RATE = 1e-3


def optimizer() -> optax.GradientTransformation:
    """Adam: two moments per parameter, so the state is three times the parameters."""
    return optax.adam(LEARNING_RATE)


# --- the model: a stack of square layers ---------------------------------------------------


def forward(layers: list[jax.Array], x: jax.Array) -> jax.Array:
    """The reproduction's model: each layer one (width, width) matrix, applied in turn."""
    for w in layers:
        x = jnp.tanh(x @ w)
    return x


def loss_fn(layers: list[jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((forward(layers, x) - y) ** 2)


def train_step(
    layers: list[jax.Array], opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[list[jax.Array], Any, jax.Array]:
    """One step of Adam on the layers: the same function for every placement."""
    loss, grads = jax.value_and_grad(loss_fn)(layers, x, y)
    updates, opt_state = optimizer().update(grads, opt_state, layers)
    return optax.apply_updates(layers, updates), opt_state, loss


def scanned_loss(stacked: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    """The same model with the layers stacked into one (layers, width, width) array.

    `lax.scan` runs the layers one after another; `jax.checkpoint` on the body keeps only
    each layer's input for the backward pass and recomputes the rest, so the program holds
    one layer's gathered weights at a time.
    """

    @jax.checkpoint
    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        return jnp.tanh(h @ w), None

    out, _ = jax.lax.scan(layer, x, stacked)
    return jnp.mean((out - y) ** 2)


def scanned_train_step(
    stacked: jax.Array, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[jax.Array, Any, jax.Array]:
    """`train_step` for stacked layers: the loss scanned over them."""
    loss, grads = jax.value_and_grad(scanned_loss)(stacked, x, y)
    updates, opt_state = optimizer().update(grads, opt_state, stacked)
    return optax.apply_updates(stacked, updates), opt_state, loss


# --- where the state lives ---------------------------------------------------------------


def replicated(mesh: Mesh, tree: Any) -> Any:
    """The reproduction's placement: every leaf whole on every device (``P()``)."""
    return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), tree)


def fsdp(mesh: Mesh, tree: Any, axis: str = AXIS) -> Any:
    """The fix: each array split along its last-but-one axis (a layer's rows) over `axis`.

    A (width, width) layer gets ``P(axis, None)``; stacked (layers, width, width) gets
    ``P(None, axis, None)``, every layer split the same way; scalars (Adam's step count)
    stay whole. The axis must divide by the mesh's size (see `check_divides`).
    """

    def spec(leaf: Any) -> NamedSharding:
        ndim = len(leaf.shape)
        if ndim < 2:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(*([None] * (ndim - 2)), axis, None))

    return jax.tree_util.tree_map(spec, tree)


def check_divides(tree: Any, mesh: Mesh, axis: str = AXIS) -> None:
    """Raise where an array's split axis does not divide by the mesh axis's size."""
    size = mesh.shape[axis]
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if len(leaf.shape) >= 2 and leaf.shape[-2] % size:
            name = jax.tree_util.keystr(path)
            raise ValueError(f"{name}: {leaf.shape[-2]} rows do not divide over {size} devices")


def jit_step(
    step: Callable[..., Any], mesh: Mesh, state_shardings: tuple[Any, Any]
) -> jax.stages.Wrapped:
    """`step` jitted with the state's shardings in and out, donated: the new state may
    reuse the old one's memory, as a training loop does."""
    data = NamedSharding(mesh, P(AXIS))
    params, opt = state_shardings
    return jax.jit(
        step,
        in_shardings=(params, opt, data, data),
        out_shardings=(params, opt, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )


def init_sharded(
    key: jax.Array, layers: int, width: int, mesh: Mesh
) -> tuple[list[jax.Array], Any]:
    """Create the parameters and Adam's state already sharded: no device ever holds all.

    `jax.eval_shape` gives the state's shapes without computing it; `jit` with those
    shapes' shardings as `out_shardings` makes each device compute only its shard.
    """
    shapes = jax.eval_shape(functools.partial(init, layers=layers, width=width), key)
    shardings = (fsdp(mesh, shapes[0]), fsdp(mesh, shapes[1]))
    make = jax.jit(functools.partial(init, layers=layers, width=width), out_shardings=shardings)
    state: tuple[list[jax.Array], Any] = make(key)
    return state


def init(key: jax.Array, layers: int, width: int) -> tuple[list[jax.Array], Any]:
    """The parameters (scaled normal) and Adam's state for them."""
    keys = jax.random.split(key, layers)
    params = [jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width) for k in keys]
    return params, optimizer().init(params)


# --- what a step must hold ---------------------------------------------------------------


def state_bytes(scale: Mapping[str, Any]) -> int:
    """Parameters and Adam's two moments, whole: three times the parameters."""
    nbytes: int = 3 * scale["layers"] * scale["width"] ** 2 * 4
    return nbytes


def floor_bytes(variant_name: str, scale: Mapping[str, Any]) -> int:
    """Per device, what a step must hold at the least.

    Its share of the state (parameters and Adam's moments) and of the batch, and one layer
    whole (its gathered weights, or its gradient before the update). A scanned step also
    holds its share of every layer's gradient at once: the backward scan returns them
    stacked, and the update reads them after it. (Unrolled, each layer's update may run as
    soon as its gradient exists.)
    """
    share = 1 if variant_name in _REPLICATED else DEVICES
    batch: int = 2 * scale["batch"] * scale["width"] * 4 // DEVICES
    layer: int = scale["width"] ** 2 * 4
    gradients = state_bytes(scale) // 3 // share if variant_name in _SCANNED else 0
    return state_bytes(scale) // share + batch + layer + gradients


def _floor(variant: Variant, scale: Mapping[str, Any], params: Params) -> int:
    return floor_bytes(variant.name, scale)


_REPLICATED = {"replicated"}
_SCANNED = {"fsdp-scan"}

# the case's programs and inputs per scale: runbook/cases/_setup/sharding_replicated.py
_inputs = _setup.Inputs(
    devices=DEVICES, axis=AXIS, optimizer=optimizer, init=init, jit_step=jit_step
)

CASE = Case(
    name="sharding-replicated",
    title="Parameters and optimizer state replicated on every device",
    symptom="a train step on several devices runs out of memory on each of them although "
    "the model's state would fit the devices together",
    devices=DEVICES,
    scales={
        "seed": {"layers": 48, "width": 11584, "batch": 256},
        "issue": {"layers": 16, "width": 8192, "batch": 256},
        "small": {"layers": 4, "width": 256, "batch": 64},
        "tiny": {"layers": 2, "width": 64, "batch": 16},
    },
    variants=(
        Variant(
            "replicated",
            "reproduction",
            "parameters and Adam state whole on every device (P()), batch split",
            _inputs.program(train_step, replicated, False),
            args=_inputs.args(replicated, False),
        ),
        Variant(
            "fsdp",
            "fix",
            "parameters and Adam state split by rows (P('fsdp', None)), layers a Python list",
            _inputs.program(train_step, fsdp, False),
            args=_inputs.args(fsdp, False),
        ),
        Variant(
            "fsdp-scan",
            "fix",
            "recommended: split by rows, layers stacked and scanned with jax.checkpoint",
            _inputs.program(scanned_train_step, fsdp, True),
            args=_inputs.args(fsdp, True),
        ),
    ),
    args=_inputs.args(replicated, False),
    grid=lambda s: [{"layers": s["layers"], "width": s["width"], "batch": s["batch"]}],
    floor=_floor,
    tolerance=1e-4,
    runnable_scale="small",
    cause="every device holds the whole state; sharded, every layer's gathered weights are "
    "alive at once unless the layers run one at a time",
    recommended="fsdp-scan",
    compare=_setup.as_stacked,
)
