"""`donation`: a train step holds two copies of its state.

A jitted train step returns new parameters and optimizer state shaped like the ones it was
given. Unless those arguments are donated, the caller still owns the old ones, so XLA
writes the new state beside them: jax-ml/jax#1733, #1273. Donation can also fail, with or
without a warning (#9237, #9675), and a loop that reads a donated buffer's new value costs
a full copy on recent XLA (openxla/xla#45912). The functions below are the reproduction,
its fixes and the ways donation fails; copy the one you need. The check that a donation
happened (`donation_check`) and the page's measurements are in `runbook.site.donation`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from .._case_types import Case, Variant

Params = list[jax.Array]

OPTIMIZER = optax.adam(1e-3)


def model(params: Params, x: jax.Array) -> jax.Array:
    """A stack of square layers, ``tanh`` between them."""
    for w in params[:-1]:
        x = jnp.tanh(x @ w)
    return x @ params[-1]


def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error of the model."""
    return jnp.mean((model(params, x) - y) ** 2)


def train_step(
    params: Params, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[Params, Any, jax.Array]:
    """One Adam step: returns ``(new params, new optimizer state, loss)``."""
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def jit_step() -> Any:
    """The reproduction: the train step jitted as it is. The caller still holds the old
    parameters and optimizer state, so XLA writes the new ones beside them."""
    return jax.jit(train_step)


def donated_step() -> Any:
    """Fix (recommended): donate the parameters and the optimizer state. The new state is
    written into the old state's buffers; the old arrays are deleted after the call."""
    return jax.jit(train_step, donate_argnums=(0, 1))


def misnumbered_step() -> Any:
    """A donation that half fails: meant ``(params, opt_state)``, wrote ``(0, 2)``. The
    parameters are donated, the optimizer state is not, and the batch ``x`` (argument 2)
    matches no output: JAX warns about ``x`` only."""
    return jax.jit(train_step, donate_argnums=(0, 2))


def mixed_dtype_update(
    params: Params, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[Params, Any, jax.Array]:
    """A train step that hands back its new parameters in bfloat16 (say, for a bfloat16
    forward pass next step): donated, the float32 parameters' buffers fit no output."""
    new, opt_state, value = train_step(params, opt_state, x, y)
    return [p.astype(jnp.bfloat16) for p in new], opt_state, value


def update_read_update(x: jax.Array, reads: int = 8) -> jax.Array:
    """openxla/xla#45912's pattern: update a donated array, read the new value in a loop,
    update it again. Each step is elementwise, so all of it could happen in place."""
    a = jnp.exp(x)  # exp: costly enough that XLA does not recompute it in the last fusion
    stride = x.shape[0] // reads
    s: jax.Array = lax.fori_loop(0, reads, lambda i, s: s + a[i * stride], jnp.zeros((), x.dtype))
    return a * s


def update_read_once(x: jax.Array, reads: int = 8) -> jax.Array:
    """`update_read_update` with the reads outside a loop (a strided slice): same result."""
    a = jnp.exp(x)
    return a * jnp.sum(a[:: x.shape[0] // reads][:reads])


def _sizes(scale: Mapping[str, Any]) -> dict[str, int]:
    layers, width, tokens = scale["layers"], scale["width"], scale["tokens"]
    weight = width * width * 4
    return {
        "params": layers * weight,
        "layer": weight,
        "state": 3 * layers * weight,  # the parameters and Adam's two moments
        "batch": 2 * tokens * width * 4,
        "activations": (layers - 1) * tokens * width * 4,
    }


def floor_bytes(scale: Mapping[str, Any], platform: str = "cpu") -> int:
    """What one train step must hold, at the least: the parameters, Adam's two moments and
    its step count, the batch, one layer's gradient (each gradient exists whole before Adam
    uses it; the new state reuses the donated buffers), the activations the backward pass
    needs (each hidden layer's output) and the loss.

    XLA's TPU compiler fuses each gradient's matrix product into the Adam update that reads
    it, tile by tile, so no layer's gradient exists whole there: on ``platform="tpu"`` the
    floor leaves it out.
    """
    s = _sizes(scale)
    gradient = 0 if platform == "tpu" else s["layer"]
    return s["state"] + 4 + s["batch"] + gradient + s["activations"] + 4


def _floor(
    variant: Variant, scale: Mapping[str, Any], params: Mapping[str, Any], platform: str
) -> int:
    return floor_bytes(scale, platform)


def _params(scale: Mapping[str, Any], concrete: bool) -> list[Any]:
    layers, width = scale["layers"], scale["width"]
    if not concrete:
        return [jax.ShapeDtypeStruct((width, width), jnp.float32) for _ in range(layers)]
    rng = np.random.default_rng(0)
    return [
        jnp.asarray(rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width))
        for _ in range(layers)
    ]


def _inputs(scale: Mapping[str, Any], p: Mapping[str, Any], concrete: bool) -> tuple[Any, ...]:
    """``(params, opt_state, x, y)``: abstract, or real arrays when `concrete`."""
    params = _params(scale, concrete)
    state = OPTIMIZER.init(params) if concrete else jax.eval_shape(OPTIMIZER.init, params)
    shape = (scale["tokens"], scale["width"])
    if not concrete:
        batch = jax.ShapeDtypeStruct(shape, jnp.float32)
        return params, state, batch, batch
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    y = jnp.asarray(0.5 * rng.standard_normal(shape, dtype=np.float32))
    return params, state, x, y


CASE = Case(
    name="donation",
    title="A train step holds two copies of its state",
    symptom="a jitted train step needs twice its parameters and optimizer state",
    devices=1,
    scales={
        "seed": {"layers": 4, "width": 16384, "tokens": 1024},
        "small": {"layers": 4, "width": 2048, "tokens": 512},
        "tiny": {"layers": 2, "width": 64, "tokens": 16},
    },
    variants=(
        Variant("no-donation", "reproduction", "jax.jit(train_step)", lambda p: jit_step()),
        Variant(
            "donated",
            "fix",
            "recommended: donate_argnums=(0, 1), parameters and optimizer state",
            lambda p: donated_step(),
        ),
        Variant(
            "misnumbered",
            "fix",
            "donate_argnums=(0, 2): the batch donated instead of the optimizer state",
            lambda p: misnumbered_step(),
        ),
    ),
    args=_inputs,
    grid=lambda scale: [{"optimizer": "adam"}],
    floor=_floor,
    tolerance=1e-5,
    cause="the caller still owns the old parameters and optimizer state, so the new ones "
    "are written beside them unless the arguments are donated",
    recommended="donated",
)

LOOP_SCALE = {"seed": 2**28, "small": 2**24, "tiny": 2**10}  # elements of the #45912 array
