"""`frozen-params`: frozen parameters still get full-size zero gradients.

Fine-tuning low-rank adapters on a large frozen network, the gradient of the whole
parameter tree is mostly zeros, and those zeros can be real arrays: jax-ml/jax#23316,
nstarman/quax#248, jax-ml/jax#4853. The functions below are the reproduction and its
fixes; copy the one you need.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .._case_types import Case, Variant
from ._setup import frozen_params as _setup

Params = dict[str, dict[str, jax.Array]]

OPTIMIZER = optax.adam(1e-3)
PROGRAMS = ("gradient", "train step")


def model(
    frozen: dict[str, jax.Array],
    lora: dict[str, jax.Array],
    x: jax.Array,
    remat: bool = False,
    policy: Callable[..., bool] | None = None,
) -> jax.Array:
    """A scan over layers; each is a frozen matrix ``w`` plus a low-rank adapter ``a @ b``.

    With `remat`, each layer is under `jax.checkpoint` (see the scan-residuals case), with
    `policy` if one is given; a layer's input is named ``"carry"`` for policies to name.
    """

    def layer(
        h: jax.Array, weights: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[jax.Array, None]:
        w, a, b = weights
        h = checkpoint_name(h, "carry")
        return jnp.tanh(h @ w + (h @ a) @ b), None

    body = jax.checkpoint(layer, policy=policy) if remat else layer
    h, _ = lax.scan(body, x, (frozen["w"], lora["a"], lora["b"]))
    return h


def loss(params: Params, x: jax.Array, y: jax.Array, remat: bool = False, **kw: Any) -> jax.Array:
    """Mean squared error of the model; `params` is ``{"frozen": ..., "lora": ...}``."""
    return jnp.mean((model(params["frozen"], params["lora"], x, remat, **kw) - y) ** 2)


def loss_stopped(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """`loss` with the frozen weights under `lax.stop_gradient`."""
    frozen = jax.tree.map(lax.stop_gradient, params["frozen"])
    return loss({"frozen": frozen, "lora": params["lora"]}, x, y)


def grad_stop_gradient(params: Params, x: jax.Array, y: jax.Array) -> tuple[jax.Array, Params]:
    """The reproduction: the gradient of the whole tree, frozen weights under stop_gradient.

    Returns ``(loss, gradients)``; the frozen part of the gradients is zeros of the frozen
    weights' shapes.
    """
    return jax.value_and_grad(loss_stopped)(params, x, y)


def grad_masked(params: Params, x: jax.Array, y: jax.Array) -> tuple[jax.Array, Params]:
    """The gradient of the whole tree, the frozen part replaced by zeros afterwards."""
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return value, {"frozen": jax.tree.map(jnp.zeros_like, grads["frozen"]), "lora": grads["lora"]}


def grad_trainable(
    params: Params, x: jax.Array, y: jax.Array, remat: bool = False, **kw: Any
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Fix: differentiate with respect to the adapters only (the trainable subtree).

    Returns ``(loss, adapter gradients)``. Same as ``jax.grad(f, argnums=...)`` with the
    adapters passed as their own argument. `remat` checkpoints each layer (`model`'s `policy`).
    """

    def loss_of_adapters(lora: dict[str, jax.Array]) -> jax.Array:
        return loss({"frozen": params["frozen"], "lora": lora}, x, y, remat, **kw)

    return jax.value_and_grad(loss_of_adapters)(params["lora"])


grad_trainable_remat = functools.partial(grad_trainable, remat=True)


def grad_trainable_offload(
    params: Params, x: jax.Array, y: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Fix on a GPU or a TPU: `grad_trainable_remat`, each layer's input kept in the host's
    pinned memory instead of the device's. The backward pass copies one back per layer.

    On CPU, XLA has one memory: this compiles to `grad_trainable_remat`'s program.
    """
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["carry"],
        offload_src="device",
        offload_dst="pinned_host",
    )
    return grad_trainable(params, x, y, remat=True, policy=policy)


def labels(params: Params) -> Params:
    """Optax labels for `params`: each leaf labelled with its group, "frozen" or "lora"."""
    return {group: jax.tree.map(lambda _, g=group: g, tree) for group, tree in params.items()}


def masked_optimizer() -> optax.GradientTransformation:
    """Adam on the adapters, `optax.set_to_zero` on the frozen weights (optax's freezing recipe)."""
    return optax.multi_transform(
        {"lora": OPTIMIZER, "frozen": optax.set_to_zero()}, param_labels=labels
    )


def step_stop_gradient(
    params: Params, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[Params, Any, jax.Array]:
    """The reproduction's train step: stop_gradient on the frozen weights, Adam on the whole tree.

    Returns ``(new params, new optimizer state, loss)``.
    """
    value, grads = grad_stop_gradient(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def step_masked(
    params: Params, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[Params, Any, jax.Array]:
    """Train step: the gradient of the whole tree, then `masked_optimizer` (frozen: no update)."""
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = masked_optimizer().update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def step_trainable(
    params: Params,
    opt_state: Any,
    x: jax.Array,
    y: jax.Array,
    grad: Callable[
        [Params, jax.Array, jax.Array], tuple[jax.Array, dict[str, jax.Array]]
    ] = grad_trainable,
) -> tuple[Params, Any, jax.Array]:
    """Fix: differentiate and update the adapters only; the frozen weights pass through."""
    value, grads = grad(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params["lora"])
    lora = optax.apply_updates(params["lora"], updates)
    return {"frozen": params["frozen"], "lora": lora}, opt_state, value


def jit_step(step: Callable[..., Any]) -> Any:
    """A train step as users jit it: parameters and optimizer state donated."""
    return jax.jit(step, donate_argnums=(0, 1))


_WHOLE_ADAM = _setup.inputs(lambda params: (OPTIMIZER.init, params))
_MASKED = _setup.inputs(lambda params: (masked_optimizer().init, params))
_ADAPTERS_ADAM = _setup.inputs(lambda params: (OPTIMIZER.init, params["lora"]))


def _program(
    gradient: Callable[..., Any], step: Callable[..., Any]
) -> Callable[[Mapping[str, Any]], Callable[..., Any]]:
    return lambda p: gradient if p["program"] == "gradient" else jit_step(step)


CASE = Case(
    name="frozen-params",
    title="Frozen parameters still get full-size zero gradients",
    symptom="fine-tuning adapters on a frozen network, the gradient holds zeros the size of "
    "the frozen weights",
    devices=1,
    scales={
        "seed": {"layers": 32, "width": 8192, "rank": 16, "tokens": 2048},
        "small": {"layers": 8, "width": 1024, "rank": 8, "tokens": 1024},
        "tiny": {"layers": 2, "width": 32, "rank": 4, "tokens": 16},
    },
    variants=(
        Variant("forward", "baseline", "the loss alone", lambda p: loss, args=_setup.loss_inputs),
        Variant(
            "stop-gradient",
            "reproduction",
            "stop_gradient on the frozen weights; gradient of the whole tree (Adam on all)",
            _program(grad_stop_gradient, step_stop_gradient),
            args=_WHOLE_ADAM,
        ),
        Variant(
            "masked",
            "fix",
            "gradient of the whole tree, frozen part zeroed (optax.multi_transform + set_to_zero)",
            _program(grad_masked, step_masked),
            args=_MASKED,
        ),
        Variant(
            "trainable-only",
            "fix",
            "differentiate (and update) the adapters only",
            _program(grad_trainable, step_trainable),
            args=_ADAPTERS_ADAM,
        ),
        Variant(
            "trainable-remat",
            "fix",
            "recommended: the adapters only, each layer under jax.checkpoint",
            _program(
                grad_trainable_remat, functools.partial(step_trainable, grad=grad_trainable_remat)
            ),
            args=_ADAPTERS_ADAM,
        ),
        Variant(
            "trainable-offload",
            "fix",
            "the adapters only, each layer under jax.checkpoint, its input offloaded to pinned "
            "host memory (save_and_offload_only_these_names)",
            _program(
                grad_trainable_offload,
                functools.partial(step_trainable, grad=grad_trainable_offload),
            ),
            args=_ADAPTERS_ADAM,
            since="jax.checkpoint_policies.save_and_offload_only_these_names",
        ),
    ),
    args=_WHOLE_ADAM,
    grid=lambda scale: [{"program": p} for p in PROGRAMS],
    floor=_setup.floor,
    tolerance=1e-4,
    compare=_setup.comparable,
    cause="a gradient returned from jit holds zeros the size of the frozen weights, and Adam "
    "over the whole tree keeps moments for them",
    recommended="trainable-remat",
)
